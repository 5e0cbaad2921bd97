"""Motion RoPE (ARCHITECTURE Part 1), computed for the positions in use.

No table: angles are built in float64 from the absolute token positions of the call, so
positions never run out (the original's n_frames*tpf table failed after ~1,500 frames).
"""
from __future__ import annotations

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


class MotionRoPE(torch.nn.Module):
    """Rotary angles for (time, column, row) of each token; no stored buffers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tpf = cfg.tokens_per_frame
        self.side = cfg.sample_size
        self.delta = float(cfg.rope_ats_delta)
        t, x, y = rope_dims(cfg)
        s = t + x + y
        # Host tensors whatever the default device (a model built under ``with torch.device("cuda")``):
        # angles are made on the host in float64 and moved once, in cos_sin.
        j = torch.arange(s // 2, dtype=torch.float64, device="cpu")
        freqs = 1.0 / (float(cfg.rope_base) ** (2.0 * j / s))
        n_spatial = (x + y) // 2
        # Which coordinate drives angle j: 0 = x (even spatial), 1 = y (odd spatial), 2 = t.
        axis = torch.full((s // 2,), 2, dtype=torch.long, device="cpu")
        axis[:n_spatial] = torch.arange(n_spatial, device="cpu") % 2
        self._freqs = freqs
        self._axis = axis

    def angles(self, token_offset: int, n_tokens: int) -> torch.Tensor:
        """float64 angles [n_tokens, dh/2] for absolute token positions offset..offset+n-1."""
        p = torch.arange(token_offset, token_offset + n_tokens, dtype=torch.int64, device="cpu")
        frame, within = p // self.tpf, p % self.tpf
        row, col = within // self.side, within % self.side
        t = frame.double() * self.delta
        half = (self.side - 1) / 2.0
        coords = torch.stack([t + col.double() - half, t + row.double() - half, t], dim=-1)  # [n, 3]
        return coords[:, self._axis] * self._freqs

    def cos_sin(self, token_offset: int, n_tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.angles(token_offset, n_tokens)
        return a.cos().float().to(device), a.sin().float().to(device)


def apply_rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (v[2j], v[2j+1]) by angle j; output half-split [u_0..u_k, w_0..w_k].

    v: [b, h, t, dh]; cos/sin: [t, dh/2] float32. Computed in float32, cast back.
    """
    vf = v.float()
    even, odd = vf[..., 0::2], vf[..., 1::2]
    u = even * cos - odd * sin
    w = odd * cos + even * sin
    return torch.cat([u, w], dim=-1).to(v.dtype)
