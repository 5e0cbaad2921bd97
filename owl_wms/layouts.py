"""Cache layouts over frame slots (docs/architecture.md, The KV cache).

A ``FrameStore`` holds named buffers ``[b, h, C, ...]`` whose dim 2 is a frame slot (K/V data
``[.., tpf, dh]`` and their scales alike), each with an int64 tag per slot: the absolute frame
it holds (-1: empty). A layout moves every buffer and its tag with the same code, so a frame's
scales cannot part from its tokens (the ring bug of the original); guards compare the tags.

    roll     slots in time order; a full store rolls every buffer by the new frames (the original)

(The pointer and in-place layouts, where frame f lives in slot f % C, are the tensor-state ring:
ring.py.)
"""
from __future__ import annotations

import torch

LAYOUTS = ("roll",)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 data as raw bytes: CUDA has no roll/index_select kernels for float8, and moving
    bytes is the same thing."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


class FrameStore:
    def __init__(self, capacity: int, shapes: dict[str, tuple], dtypes: dict[str, torch.dtype], device):
        self.capacity = capacity
        self.bufs = {n: torch.zeros(shapes[n], dtype=dtypes[n], device=device) for n in shapes}
        self.tags = {n: torch.full((capacity,), -1, dtype=torch.int64) for n in shapes}
        self.length = 0  # valid frames
        self.written = 0  # frames ever written (the next frame's absolute index)

    def nbytes(self, names=None) -> int:
        return sum(b.numel() * b.element_size() for n, b in self.bufs.items() if names is None or n in names)

    def to(self, device):
        self.bufs = {n: b.to(device) for n, b in self.bufs.items()}


class Layout:
    name = ""

    def write(self, store: FrameStore, items: dict[str, torch.Tensor], n: int):
        raise NotImplementedError

    def read(self, store: FrameStore, frames: int) -> dict[str, torch.Tensor]:
        """The last ``frames`` valid frames of every buffer, oldest first."""
        raise NotImplementedError

    def slot_of(self, store: FrameStore, frame: int) -> int:
        """Slot holding absolute frame ``frame`` (valid frames only)."""
        raise NotImplementedError

    def forget(self, store: FrameStore, frames: int):
        """Drop the oldest ``frames`` valid frames."""
        raise NotImplementedError

    @staticmethod
    def _put(store: FrameStore, name: str, item: torch.Tensor, start: int, first_frame: int):
        """Write frames item[:, :, i] to slots start + i (contiguous), tags following."""
        n = item.shape[2]
        store.bufs[name][:, :, start:start + n] = item
        store.tags[name][start:start + n] = torch.arange(first_frame, first_frame + n)


class RollLayout(Layout):
    name = "roll"

    def write(self, store, items, n):
        c = store.capacity
        m = min(n, c)  # a write longer than the store keeps its last frames
        first = store.written + n - m
        if store.length + m > c:
            shift = store.length + m - c
            for name in store.bufs:  # the original's cost: the whole store moves every frame
                b = store.bufs[name]
                store.bufs[name] = torch.roll(as_bytes(b), -shift, dims=2).view(b.dtype)
                store.tags[name] = torch.roll(store.tags[name], -shift)
            store.length -= shift
        for name, item in items.items():
            self._put(store, name, item[:, :, n - m:], store.length, first)
        store.length += m
        store.written += n

    def read(self, store, frames):
        lo = store.length - frames
        return {n: b[:, :, lo:store.length] for n, b in store.bufs.items()}

    def slot_of(self, store, frame):
        return frame - (store.written - store.length)

    def forget(self, store, frames):
        keep = max(store.length - frames, 0)
        for name in store.bufs:
            b, t = store.bufs[name], store.tags[name]
            b[:, :, :keep] = b[:, :, store.length - keep:store.length].clone()
            t[:keep] = t[store.length - keep:store.length].clone()
            t[keep:] = -1
        store.length = keep


def make_layout(name: str) -> Layout:
    if name == "roll":
        return RollLayout()
    raise ValueError(f"unknown cache layout {name!r}; choose one of {LAYOUTS}")
