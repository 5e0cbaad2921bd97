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
    def __init__(self, n_layers: int, window: int):
        self.window, self.keep = window, n_layers * (window - 1) + 1
        self.x = self.t = self.mouse = self.buttons = None
        self.start, self.prefill_end, self.bias = 0, 0, ()

    def reset(self, cfg, device, dtype, prefill_end: int):
        """An empty history on ``device``; the next ``prefill_end`` frames are the prefill."""
        c, s = cfg.channels, cfg.sample_size
        empty = lambda *shape: torch.zeros(1, 0, *shape).to(device, dtype)  # noqa: E731
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

    def state(self) -> tuple[dict, dict]:
        """(tensors, metadata) for a snapshot."""
        return (dict(zip(TENSORS, self.tensors())),
                {"start": self.start, "prefill_end": self.prefill_end, "bias": list(self.bias)})

    def load_state(self, tensors: dict, meta: dict, device, dtype):
        self.x, self.t, self.mouse, self.buttons = (tensors[k].to(device, dtype) for k in TENSORS)
        self.start, self.prefill_end, self.bias = meta["start"], meta["prefill_end"], tuple(meta["bias"])
