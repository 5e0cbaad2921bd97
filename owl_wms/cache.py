"""KV caches. ``StaticCache``: one preallocated slab per layer, rolled on update (the
original's layout, kept for parity and as the reference for every other layout).

Contract used by attention (ARCHITECTURE Part 3): ``should_update``,
``enable_cache_updates()``, ``disable_cache_updates()``, ``update(k, v, layer)``,
``get(layer, new_k=None, new_v=None)``, ``get_offset(layer)``, ``reset(batch_size)``,
``truncate(frames)``, ``shape``, ``to(...)``. K is stored after RoPE.
"""
from __future__ import annotations

import torch

from .config import ModelConfig


class StaticCache:
    def __init__(self, config: ModelConfig, max_length: int, batch_size: int = 1,
                 device="cpu", dtype=torch.bfloat16):
        if max_length < 1:
            raise ValueError(f"StaticCache max_length={max_length} must be a positive number of frames")
        self.config = config
        self.tpf = config.tokens_per_frame
        self.max_frames = max_length
        self.capacity = max_length * self.tpf
        self.device, self.dtype = torch.device(device), dtype
        self.should_update = False
        self.reset(batch_size)

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self, batch_size: int = 1):
        c = self.config
        self.batch_size = batch_size
        shape = (batch_size, c.n_heads, self.capacity, c.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(c.n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(c.n_layers)]
        self.offsets = [0] * c.n_layers  # tokens ever written: the RoPE position of the next token
        self.lengths = [0] * c.n_layers  # valid tokens in the slab, oldest first
        return self

    def enable_cache_updates(self):
        self.should_update = True

    def disable_cache_updates(self):
        self.should_update = False

    def to(self, device=None, dtype=None):
        self.device = torch.device(device) if device is not None else self.device
        self.dtype = dtype or self.dtype
        self.k = [t.to(self.device, self.dtype) for t in self.k]
        self.v = [t.to(self.device, self.dtype) for t in self.v]
        return self

    @property
    def shape(self):
        return tuple(self.k[0].shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def get_offset(self, layer: int = 0) -> int:
        return self.offsets[layer]

    def n_frames(self, layer: int = 0) -> int:
        return self.lengths[layer] // self.tpf

    # -- data ----------------------------------------------------------------------------------
    def _check(self, new_k, new_v):
        b, h, n, d = new_k.shape
        expect = (self.batch_size, self.config.n_heads, d, self.config.head_dim)
        if (b, h, d) != (expect[0], expect[1], expect[3]) or new_v.shape != new_k.shape:
            raise ValueError(f"cache write of k{tuple(new_k.shape)} v{tuple(new_v.shape)} does not match the "
                             f"cache (batch {expect[0]}, heads {expect[1]}, head dim {expect[3]})")
        if n % self.tpf or n > self.capacity:
            raise ValueError(f"cache write of {n} tokens: must be whole frames ({self.tpf} tokens each) "
                             f"and at most the cache's {self.max_frames} frames")
        return n

    @torch.no_grad()
    def update(self, new_k, new_v, layer: int):
        n = self._check(new_k, new_v)
        length = self.lengths[layer]
        if length + n > self.capacity:
            shift = length + n - self.capacity
            # The original's roll: copies the whole slab every frame once full.
            self.k[layer] = torch.roll(self.k[layer], -shift, dims=2)
            self.v[layer] = torch.roll(self.v[layer], -shift, dims=2)
            length -= shift
        self.k[layer][:, :, length:length + n] = new_k
        self.v[layer][:, :, length:length + n] = new_v
        self.lengths[layer] = length + n
        self.offsets[layer] += n

    def get(self, layer: int, new_k=None, new_v=None):
        """Chronological K/V; with new_k/new_v, the window as if they were appended (no mutation)."""
        length = self.lengths[layer]
        k, v = self.k[layer][:, :, :length], self.v[layer][:, :, :length]
        if new_k is None:
            return k, v
        n = self._check(new_k, new_v)
        keep = min(length, self.capacity - n)
        return (torch.cat([k[:, :, length - keep:], new_k], dim=2),
                torch.cat([v[:, :, length - keep:], new_v], dim=2))

    @torch.no_grad()
    def truncate(self, frames: int):
        """Forget the oldest ``frames`` frames of every layer (positions keep counting)."""
        drop = frames * self.tpf
        for i in range(self.config.n_layers):
            keep = max(self.lengths[i] - drop, 0)
            self.k[i][:, :, :keep] = self.k[i][:, :, self.lengths[i] - keep:self.lengths[i]].clone()
            self.v[i][:, :, :keep] = self.v[i][:, :, self.lengths[i] - keep:self.lengths[i]].clone()
            self.lengths[i] = keep
