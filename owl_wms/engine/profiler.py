"""Per-frame profile lines (the profile_kv setting). Lives outside the forward pass; when the
setting is off the pipeline holds a ``NoProfiler``, so nothing is timed or synchronised.

Sections inside a frame (quantize, dequantize, attention) are timed by wrapping those public
methods on the live objects (``instrument``) - the model and cache code know nothing of it.
"""
from __future__ import annotations

import resource
import time

import torch

from ..cache import QuantizedStaticCache
from ..ring import RingCache


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class NoProfiler:
    """What the pipeline holds when profiling is off: the hooks it calls, doing nothing (a hook
    missing here is an AttributeError, not a silent no-op)."""

    def start(self):
        return None

    def mark(self, name: str):
        return None

    def cut_started(self, event: str):
        return None

    def history_done(self, event: str, kv_bytes: int):
        return None

    def frame_done(self, pipe):
        return None

    def frame(self, *args, **kwargs):
        return None


class KVProfiler:
    @classmethod
    def attach(cls, pipe, tp=None) -> "KVProfiler":
        """A profiler for ``pipe``: attention timed inside each block (eager models only:
        compiled blocks cannot be timed from outside) and, under tensor parallelism, the
        all-reduces and the step exchange and checks."""
        s = pipe.settings
        self = cls(s.device, s.profile_kv_first, s.profile_kv_every, printer=lambda text: pipe.log(text))
        if not s.compile:
            for block in pipe.runner.core.transformer.blocks:
                self.instrument(block.attn, "attend_out", "attn")
        if tp is not None:
            for method in ("all_reduce", "all_gather", "exchange", "check_scalars"):
                self.instrument(tp, method, "comm")
        self.watch_cache(pipe.cache)
        return self

    def watch_cache(self, cache):
        """Time a quantized cache's encode and decode: over the ring, each owner layer's K and V
        (eager calls only: compiled, they are inside the model's one graph)."""
        if isinstance(cache, RingCache):
            for layer in cache.owners:
                for ring in (layer.k, layer.v):
                    if ring.quantized:
                        self.instrument(ring, "encode", "quant")
                        self.instrument(ring, "decode", "dequant")
        if isinstance(cache, QuantizedStaticCache):
            for method, section in (("encode", "quant"), ("decode", "dequant")):
                self.instrument(cache, method, section)

    def cut_started(self, event: str):
        if event == "cut":
            self.start()

    def history_done(self, event: str, kv_bytes: int):
        if event == "cut":
            self.prefill(kv_bytes)
        elif event == "recompute":
            self.mark("recompute")

    def frame_done(self, pipe):
        """The frame's line, after decoding."""
        self.mark("decoder")
        cache = pipe.cache
        self.frame(pipe.kv_bytes, cache.scale_nbytes() if cache is not None else 0, epoch=pipe.cache_epoch,
                   event=pipe.lifecycle.event)

    def __init__(self, device: str, first: int, every: int, printer=print):
        self.device, self.first, self.every, self.print = device, first, every, printer
        self.frames = 0
        self.marks: list[tuple[str, float]] = []
        self.sections: dict[str, float] = {}  # name -> ms accumulated since start()
        self.last: dict[str, float] = {}

    def instrument(self, obj, method: str, section: str):
        """Replace obj.method with a timed wrapper that adds to ``section`` (instance only)."""
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.sync()
            self.sections[section] = self.sections.get(section, 0.0) + (time.perf_counter() - t0) * 1000
            return out

        setattr(obj, method, timed)

    def sync(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def start(self):
        self.sync()
        self.marks = [("start", time.perf_counter())]
        self.sections = {}

    def mark(self, name: str):
        self.sync()
        self.marks.append((name, time.perf_counter()))

    def _spans(self):
        return [(n, (t - self.marks[i][1]) * 1000) for i, (n, t) in enumerate(self.marks[1:])]

    def prefill(self, kv_bytes: int):
        self.mark("prefill")
        s = self._spans()[-1][1] / 1000
        self.print(f"[KV-Profile] prefill_s={s:.3f} kv_bytes={kv_bytes} peak_mem_mb={peak_memory_mb(self.device):.1f}")

    def frame(self, kv_bytes: int, scale_bytes: int = 0, epoch: int = 0, event: str = "frame"):
        """One frame's line; ``epoch`` and ``event`` come from the cache lifecycle (a recompute
        shows as event=recompute with its own recompute_ms span)."""
        self.frames += 1
        self.last = {**dict(self._spans()), **self.sections}  # this frame's ms by section
        if self.frames <= self.first or self.frames % self.every == 0 or event != "frame":
            parts = " ".join(f"{n}_ms={ms:.2f}" for n, ms in [*self._spans(), *self.sections.items()])
            self.print(f"[KV-Profile] frame={self.frames} epoch={epoch} event={event} {parts} kv_bytes={kv_bytes} "
                       f"kv_scale_bytes={scale_bytes} peak_mem_mb={peak_memory_mb(self.device):.1f}")
