"""The cache-free baseline (kv_cache "none"): every model call recomputes the whole visible
history, so a cached run can be checked against it frame for frame.

Each frame's cache-writing input is kept, enough frames to cover the receptive field
(n_layers * (window - 1) + 1: deep-layer keys and values carry older context), and every
frame attends as it did when the cache took it: the history under the frame mask (the
prefill), later frames as decoded, each under the soft-forgetting bias of its time.
"""
from __future__ import annotations

import torch

from ..controls import N_BUTTONS

TENSORS = ("x", "t", "mouse", "buttons")


class NoCacheHistory:
    def __init__(self, cfg, window: int, device, dtype):
        self.cfg, self.window, self.keep = cfg, window, cfg.n_layers * (window - 1) + 1
        self.device, self.dtype = device, dtype
        self.x = self.t = self.mouse = self.buttons = None
        self.start, self.prefill_end, self.bias = 0, 0, ()

    def reset(self, prefill_end: int):
        """An empty history; the next ``prefill_end`` frames are the prefill."""
        c, s = self.cfg.channels, self.cfg.sample_size
        empty = lambda *shape: torch.zeros(1, 0, *shape).to(self.device, self.dtype)  # noqa: E731
        self.x, self.t, self.mouse, self.buttons = empty(c, s, s), empty(), empty(2), empty(N_BUTTONS)
        self.start, self.prefill_end, self.bias = 0, prefill_end, ()

    def velocity(self, core, x, t, m, b, write: bool, bias: float) -> torch.Tensor:
        """The model's velocity for the new frames ``x`` after the kept history; ``write`` keeps them."""
        xs, ts, ms, bs = (torch.cat([old, new], dim=1) for old, new in zip(self.tensors(), (x, t, m, b)))
        decode_from = max(self.prefill_end - self.start, 0)
        biases = (*self.bias, *(float(bias),) * x.shape[1])
        v = core(xs, ts, ms, bs, frame_offset=self.start, window_cap=self.window,
                 attn_bias=biases if any(biases) else 0.0, decode_from=decode_from)[:, -x.shape[1]:]
        if write:
            drop = max(xs.shape[1] - self.keep, 0)
            self.x, self.t, self.mouse, self.buttons = xs[:, drop:], ts[:, drop:], ms[:, drop:], bs[:, drop:]
            self.start, self.bias = self.start + drop, biases[drop:]
        return v

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.t, self.mouse, self.buttons

    def nbytes(self) -> int:
        """Bytes of the inputs kept (no K/V is held)."""
        return 0 if self.x is None else sum(t.numel() * t.element_size() for t in self.tensors())

    def get_offset(self, layer: int = 0) -> int:
        """Tokens taken since the reset: the next token's position, as a cache's offset."""
        return 0 if self.x is None else (self.start + self.x.shape[1]) * self.cfg.tokens_per_frame

    def state_dict(self) -> tuple[dict, dict]:
        """(tensors, metadata) for a snapshot."""
        tensors = {} if self.x is None else dict(zip(TENSORS, self.tensors()))
        return tensors, {"kind": "none", "start": self.start, "prefill_end": self.prefill_end, "bias": list(self.bias)}

    def load_state_dict(self, tensors: dict, meta: dict):
        if meta.get("kind") != "none":
            raise ValueError("this snapshot holds a KV cache; this pipeline runs without one (kv_cache none)")
        self.x, self.t, self.mouse, self.buttons = (tensors[k].to(self.device, self.dtype) if tensors else None
                                                    for k in TENSORS)
        self.start, self.prefill_end, self.bias = meta["start"], meta["prefill_end"], tuple(meta["bias"])
