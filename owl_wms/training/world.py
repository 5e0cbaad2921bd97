"""World-model training: rectified flow with diffusion forcing on encoded episodes.

x_t = (1 - t) x + t z, target v = z - x. Two kinds of sample are mixed:
- diffusion forcing: t = sigmoid(randn) drawn independently per frame;
- pipeline-shaped: every frame but the last at t = alpha (the streaming history), the last
  frame at a step of the sampling schedule, so the few-step sampler sees its own inputs.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class LatentEpisodes:
    """All encoded episodes in memory; windows of ``frames`` consecutive frames."""

    def __init__(self, folder: str | Path, vae_scale: float, frames: int):
        paths = sorted(Path(folder).glob("ep_*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no encoded episodes in {str(folder)!r}; run scripts.encode_latents first")
        eps = [load_file(str(p)) for p in paths]
        self.latents = [e["latents"].float() / vae_scale for e in eps]
        self.mouse = [e["mouse"].float() for e in eps]
        self.buttons = [e["buttons"].float() for e in eps]
        self.frames = frames
        if min(x.shape[0] for x in self.latents) < frames:
            raise ValueError(f"episodes are shorter than the training window of {frames} frames")

    def batch(self, size: int, gen: torch.Generator):
        ep = torch.randint(0, len(self.latents), (size,), generator=gen).tolist()
        xs, ms, bs = [], [], []
        for e in ep:
            start = int(torch.randint(0, self.latents[e].shape[0] - self.frames + 1, (1,), generator=gen))
            s = slice(start, start + self.frames)
            xs.append(self.latents[e][s])
            ms.append(self.mouse[e][s])
            bs.append(self.buttons[e][s])
        return torch.stack(xs), torch.stack(ms), torch.stack(bs)


def sample_times(b: int, n: int, gen: torch.Generator, pipeline_frac: float, alpha: float,
                 schedule: tuple[float, ...]) -> torch.Tensor:
    t = torch.sigmoid(torch.randn(b, n, generator=gen))
    pipe = torch.rand(b, generator=gen) < pipeline_frac
    if pipe.any():
        steps = torch.tensor(schedule[:-1])
        last = steps[torch.randint(0, len(steps), (int(pipe.sum()),), generator=gen)]
        t[pipe] = alpha
        t[pipe, -1] = last
    return t


def flow_loss(core, x, mouse, buttons, t, gen: torch.Generator):
    z = torch.randn(x.shape, generator=gen).to(x)
    tt = t[:, :, None, None, None].to(x)
    x_t = (1 - tt) * x + tt * z
    v = core(x_t, t.to(x), mouse.to(x), buttons.to(x))
    return F.mse_loss(v.float(), (z - x).float())
