"""Rotary position embeddings of GameRFT (docs/architecture.md, The model), computed for the positions in use.

``motion``: frequencies over (time, column + time, row + time); ``ortho``: axial frequencies
over (time, row, column) on normalised coordinates, the original's default. No table: angles
are built in float64 from the absolute token positions of the call, so positions never run
out (the original's n_frames*tpf table failed after ~1,500 frames).
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    dh = cfg.head_dim
    t = cfg.rope_dim_t if cfg.rope_dim_t is not None else dh * 2 // 8
    x = cfg.rope_dim_x if cfg.rope_dim_x is not None else dh * 3 // 8
    y = cfg.rope_dim_y if cfg.rope_dim_y is not None else dh * 3 // 8
    if t + x + y != dh or x != y or t % 2 or x % 2:
        raise ValueError(f"motion RoPE dims (t={t}, x={x}, y={y}) must be even, with x == y and "
                         f"t + x + y == head_dim ({dh}); fix rope_dim_t/x/y in the model config")
    return t, x, y


class RoPE(torch.nn.Module):
    """Rotary angles of absolute token positions; no stored buffers. Subclasses give ``token_angles``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tpf = cfg.tokens_per_frame
        self.side = cfg.sample_size
        self._affine_by_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def token_angles(self, frame: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        """float64 angles [n, dh/2] of the tokens at index ``within`` (int64) of frame ``frame``
        (float64), on their device."""
        raise NotImplementedError

    def angles(self, token_offset: int, n_tokens: int) -> torch.Tensor:
        """float64 angles [n_tokens, dh/2] for absolute token positions offset..offset+n-1 (host)."""
        p = torch.arange(token_offset, token_offset + n_tokens, dtype=torch.int64, device="cpu")
        return self.token_angles((p // self.tpf).double(), p % self.tpf)

    def cos_sin(self, token_offset: int, n_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.angles(token_offset, n_tokens)
        return a.cos().float().to(device), a.sin().float().to(device)

    def frame_cos_sin(self, first_frame: torch.Tensor, n_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, 1, n_frames * tpf, dh/2] of frames first_frame[b] + 0..n-1, made on the
        first_frame's device from the frame indices (no host value, no host tensor: a compiled
        graph or a captured CUDA graph holds no copy): angles are affine in the frame index
        (angle = frame x per-frame step + angle in frame 0), computed in float64 so large
        positions keep their precision."""
        device = first_frame.device
        base, step = self._affine(device)
        frames = (first_frame[:, None] + torch.arange(n_frames, device=device)).to(torch.float64)
        a = (frames[:, :, None, None] * step + base).flatten(1, 2)[:, None]
        return a.cos().float(), a.sin().float()

    def _affine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 angles of frame 0's tokens, their step per frame) on ``device``: kept per device
        by eager calls; a compiled graph makes them inside itself (no Python dict is traced)."""
        compiling = torch.compiler.is_compiling()
        kept = None if compiling else self._affine_by_device.get(str(device))
        if kept is None:
            within = torch.arange(self.tpf, device=device)
            base = self.token_angles(torch.zeros(self.tpf, dtype=torch.float64, device=device), within)
            kept = base, self.token_angles(torch.ones(self.tpf, dtype=torch.float64, device=device), within) - base
            if not compiling:
                self._affine_by_device[str(device)] = kept
        return kept


class MotionRoPE(RoPE):
    """Angles for (time, column + time, row + time) of each token (``rope_impl: motion``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.delta = float(cfg.rope_ats_delta)
        self.base = float(cfg.rope_base)
        t, x, y = rope_dims(cfg)
        self.dims = t + x + y
        self.n_spatial = (x + y) // 2

    def token_angles(self, frame: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        s, device = self.dims, frame.device
        j = torch.arange(s // 2, dtype=torch.float64, device=device)
        freqs = 1.0 / torch.pow(self.base, 2.0 * j / s)
        # Which coordinate drives angle j: 0 = x (even spatial), 1 = y (odd spatial), 2 = t.
        k = torch.arange(s // 2, device=device)
        axis = torch.where(k < self.n_spatial, k % 2, 2)
        t = frame * self.delta
        half = (self.side - 1) / 2.0
        row, col = (within // self.side).double(), (within % self.side).double()
        coords = torch.stack([t + col - half, t + row - half, t], dim=-1)  # [n, 3]
        return coords[:, axis] * freqs


class OrthoRoPE(RoPE):
    """Axial rotary angles on normalised coordinates (``rope_impl: ortho``).

    The original takes rotary-embedding-torch's pixel frequencies f_k = pi * linspace(1, 128,
    dh/8)[k] for four axes (time, row, column, and a padding axis whose angle is always 0), and
    positions from linspace(-1, 1, steps) per axis: time over the n_frames frames of its table,
    row and column over sample_size + 1 steps (the extra one belonged to an audio token). After
    its subsampling, angle j of a head is [t*f, row*f, col*f, 0*f] for the dh/8 frequencies in
    turn. Frames past n_frames continue the same straight line in time (the original's table
    ended there)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.time_step = 2.0 / (cfg.n_frames - 1)
        self.space_step = 2.0 / cfg.sample_size  # linspace(-1, 1, sample_size + 1)
        self.n_freqs = cfg.head_dim // 8

    def token_angles(self, frame: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        freqs = torch.linspace(1.0, 128.0, self.n_freqs, dtype=torch.float64, device=frame.device) * math.pi
        t = frame * self.time_step - 1.0
        y = (within // self.side).double() * self.space_step - 1.0
        x = (within % self.side).double() * self.space_step - 1.0
        coords = torch.stack([t, y, x, torch.zeros_like(t)], dim=-1)  # [n, 4 axes]
        return (coords[:, :, None] * freqs).flatten(1)  # axis-major: [t f0..fm, y f0..fm, x .., 0 ..]


def make_rope(cfg: ModelConfig) -> RoPE:
    return OrthoRoPE(cfg) if cfg.rope_impl == "ortho" else MotionRoPE(cfg)


def apply_rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (v[2j], v[2j+1]) by angle j; output half-split [u_0..u_k, w_0..w_k].

    v: [b, h, t, dh]; cos/sin: [t, dh/2] float32. Computed in float32, cast back.
    """
    vf = v.float()
    even, odd = vf[..., 0::2], vf[..., 1::2]
    u = even * cos - odd * sin
    w = odd * cos + even * sin
    return torch.cat([u, w], dim=-1).to(v.dtype)
