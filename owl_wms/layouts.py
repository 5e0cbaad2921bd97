"""Cache layouts over frame slots (docs/architecture.md, The KV cache).

A ``FrameStore`` holds named buffers ``[b, h, C, ...]`` whose dim 2 is a frame slot (K/V data
``[.., tpf, dh]`` and their scales alike), each with an int64 tag per slot: the absolute frame
it holds (-1: empty). A layout moves every buffer and its tag with the same code, so a frame's
scales cannot part from its tokens (the ring bug of the original); guards compare the tags.

    roll     slots in time order; a full store rolls every buffer by the new frames (the original)
    pointer  ring: frame f lives in slot f % C; reads gather time order with a fixed-shape index

(The in-place layout, a ring attention reads as it lies, is the tensor-state ring: ring.py.)
"""
from __future__ import annotations

import torch

LAYOUTS = ("roll", "pointer")


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
        self.scratch: dict[tuple, torch.Tensor] = {}  # gather targets (pointer layout), freed with the store

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


class RingLayout(Layout):
    """Frame f lives in slot f % C: the write pointer is ``written % C``; nothing ever moves."""

    name = "pointer"

    def __init__(self, scratch: bool = True):
        self.scratch = scratch
        self._index: dict[tuple, torch.Tensor] = {}

    def pointer(self, store) -> int:
        return store.written % store.capacity

    def write(self, store, items, n):
        c = store.capacity
        m = min(n, c)
        first = store.written + n - m
        start = first % c
        head = min(m, c - start)  # up to the end of the ring, then wrap to slot 0
        for name, item in items.items():
            item = item[:, :, n - m:]
            self._put(store, name, item[:, :, :head], start, first)
            if head < m:
                self._put(store, name, item[:, :, head:], 0, first + head)
        store.length = min(store.length + n, c)
        store.written += n

    def read(self, store, frames):
        c = store.capacity
        start = (store.written - frames) % c
        out = {}
        for name, b in store.bufs.items():
            key = (c, frames, start, b.device)
            i = self._index.get(key)
            if i is None:  # one small index per (capacity, frames, pointer, device): a fixed-shape gather
                i = self._index[key] = ((torch.arange(frames) + start) % c).to(b.device)
            if self.scratch:
                shape = (*b.shape[:2], frames, *b.shape[3:])
                buf = store.scratch.get((name, shape))
                if buf is None or buf.dtype != b.dtype or buf.device != b.device:
                    buf = store.scratch[(name, shape)] = torch.empty(shape, dtype=b.dtype, device=b.device)
                torch.index_select(as_bytes(b), 2, i, out=as_bytes(buf))
                out[name] = buf
            else:
                out[name] = torch.index_select(as_bytes(b), 2, i).view(b.dtype)
        return out

    def slot_of(self, store, frame):
        return frame % store.capacity

    def forget(self, store, frames):
        drop = min(frames, store.length)
        oldest = store.written - store.length
        for f in range(oldest, oldest + drop):
            for t in store.tags.values():
                t[f % store.capacity] = -1
        store.length -= drop


def make_layout(name: str, scratch: bool = True) -> Layout:
    if name == "roll":
        return RollLayout()
    if name == "pointer":
        return RingLayout(scratch)
    raise ValueError(f"unknown cache layout {name!r}; choose one of {LAYOUTS}")
