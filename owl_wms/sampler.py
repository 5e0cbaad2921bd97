"""The few-step Euler sampler of the rectified flow, shared by the engine and training, and the
noise a session samples from.

From noise at t_0 = 1 down a schedule t_0 > t_1 > ... > t_K: x <- x - (t_i - t_{i+1}) v(x, t_i).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def euler(velocity: Callable[[torch.Tensor, float, int], torch.Tensor], x: torch.Tensor,
          levels: Sequence[float]) -> torch.Tensor:
    """Step ``x`` from ``levels[0]`` to ``levels[-1]``; ``velocity(x, t, i)`` is the model's
    prediction at step ``i`` (the caller decides what each step writes or conditions on)."""
    for i, (t, nxt) in enumerate(zip(levels, levels[1:])):
        x = x - (t - nxt) * velocity(x, t, i)
    return x


class NoiseStream:
    """Standard normal noise from one seeded generator on one device: a session's noise, drawn
    in the order its steps ask for it (same seed, same steps: same noise)."""

    def __init__(self, seed: int, device, frame_shape: tuple[int, ...]):
        """``frame_shape``: one frame's noise, what a call without a shape draws."""
        self.seed, self.frame_shape = seed, frame_shape
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, shape=None) -> torch.Tensor:
        return torch.randn(shape or self.frame_shape, generator=self.generator, device=self.generator.device)

    def restart(self) -> None:
        self.generator.manual_seed(self.seed)

    def noised(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """(1 - alpha) x + alpha eps: a clean frame as the history holds it."""
        x = x.float().to(self.generator.device)
        return (1 - alpha) * x + alpha * self(x.shape)

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state.clone())
