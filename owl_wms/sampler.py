"""The few-step Euler sampler of the rectified flow, shared by the engine and training.

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
