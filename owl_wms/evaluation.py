"""Fidelity of a world model against the simulator it was trained on.

Start from the simulator's real history (encoded), follow its recorded actions and compare
decoded frames with what the simulator really shows under the same actions:
- teacher-forced next-frame PSNR/SSIM (after each prediction, the real frame enters the history);
- autoregressive PSNR/SSIM per frame index;
- action sensitivity gap: PSNR with the true actions minus PSNR with another episode's;
- two diagnostics of what the model learned: the PSNR of simply repeating the last real frame
  (a next-frame predictor should beat it) and the action response, the PSNR between two
  predictions from the same history and noise under true and foreign actions (high: the
  controls barely change the frame).
"""
from __future__ import annotations

import numpy as np
import torch
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from .data import level_clip


def frame_metrics(pred: np.ndarray, real: np.ndarray) -> tuple[float, float]:
    """PSNR (dB) and SSIM of two uint8 HxWx3 frames."""
    p = torch.from_numpy(np.ascontiguousarray(pred)).permute(2, 0, 1)[None].float()
    r = torch.from_numpy(np.ascontiguousarray(real)).permute(2, 0, 1)[None].float()
    return (float(peak_signal_noise_ratio(p, r, data_range=255.0)),
            float(structural_similarity_index_measure(p, r, data_range=255.0)))


class Episode:
    """A held-out simulator episode: real frames and actions, history encoded once."""

    def __init__(self, pipe, seed: int, frames: int, style: str = "explore"):
        self.seed, self.window = seed, pipe.window
        self.clip, self.frames = level_clip(pipe.decoder, seed, pipe.window, frames, pipe.frame_shape[0],
                                            name=f"eval-{seed}", style=style)

    def future(self, k: int):
        i = self.window + k
        return self.frames[i], self.clip.mouse[i], self.clip.buttons[i]


def autoregressive(pipe, ep: Episode, n: int, actions: Episode | None = None) -> list[tuple[float, float]]:
    """Metrics per frame index 1..n; ``actions`` substitutes another episode's controls."""
    pipe.load_clip(ep.clip)
    src = actions or ep
    out = []
    for k in range(n):
        _, m, b = src.future(k)
        frame, _ = pipe(m, b)
        out.append(frame_metrics(frame.numpy(), ep.future(k)[0]))
    return out


def observe_real(pipe, ep: Episode, k: int):
    """Teacher forcing: the real future frame k (encoded) enters the history with its actions."""
    real, m, b = ep.future(k)
    pipe.observe(pipe.decoder.encode_uint8(real[None])[None] / pipe.vae_scale, m, b)


def teacher_forced(pipe, ep: Episode, n: int) -> list[tuple[float, float]]:
    pipe.load_clip(ep.clip)
    out = []
    for k in range(n):
        real, m, b = ep.future(k)
        frame = pipe.decode(pipe.generate(m, b, commit=False)).numpy()
        out.append(frame_metrics(frame, real))
        observe_real(pipe, ep, k)
    return out


def copy_previous(ep: Episode, n: int) -> list[tuple[float, float]]:
    """Metrics of predicting each next frame as the last real one (no model)."""
    return [frame_metrics(ep.frames[ep.window + k - 1], ep.future(k)[0]) for k in range(n)]


def action_response(pipe, ep: Episode, other: Episode, n: int) -> list[float]:
    """Teacher-forced PSNR between predictions under ``ep``'s and ``other``'s actions (same noise)."""
    pipe.load_clip(ep.clip)
    c, s = pipe.cfg.channels, pipe.cfg.sample_size
    out = []
    for k in range(n):
        noise = torch.randn((1, 1, c, s, s), generator=pipe.generator)
        mine, theirs = (pipe.decode(pipe.generate(*src.future(k)[1:], noise=noise, commit=False)).numpy()
                        for src in (ep, other))
        out.append(frame_metrics(mine, theirs)[0])
        observe_real(pipe, ep, k)
    return out
