"""The model and the decoder on their device, and how one model call runs: shared by every
session a process serves (pipeline.py holds one session; sessions.py many in one call).

Over the tensor-state ring (owl_wms/ring.py) a generated frame's call is the model as written,
eager or compiled whole with ``torch.compile(fullgraph=True, dynamic=False)``: nothing in the
call is a host value (positions, slots, masks, the bias and the commit flags are tensors), so one
graph serves every frame, wrap-around, hard cut, recompute and bias change, and a batch of
sessions at different positions. The time-ordered reads (the original's rolled slab in
cache.py, the pointer layout's gather from the ring) and the ring under the guard (it checks
every write on the host) run eagerly, or with a graph per block half.
"""
from __future__ import annotations

import torch

from ..cache import plan_layers
from ..quant import eager_division
from ..ring import RingCache, build_cache, ring_blocker
from ..sampler import euler
from ..settings import Settings
from .nocache import NoCacheHistory


class ModelRunner:
    def __init__(self, model, decoder, world, settings: Settings, cache_cfg=None, tp=None):
        """``cache_cfg``: the config the cache is shaped by (a tensor-parallel rank's heads)."""
        s = self.settings = settings
        self.world, self.cfg, self.cache_cfg = world, world.model, cache_cfg or world.model
        self.window = world.pipeline.window_frames
        self.device, self.dtype = torch.device(s.device), s.dtype
        self.model = model.to(self.device, s.dtype).eval()
        self.core = self.model.core
        self.core.transformer.set_backends(s.attn_backend, s.attn_backend_decode)
        self.kv_plan = plan_layers(self.cache_cfg, s.kv, self.window) if s.kv_cache != "none" else None
        self.ring_blocker = ring_blocker(self.kv_plan, s.kv.ring_mode)
        self.frame_call = self.core  # what runs a generated frame's call over the ring
        self.compiled = None  # "whole" (one graph per frame call) or "blocks" (a graph per block half)
        self.background = None  # the thread compiling the frame call while frames run eagerly
        self.graphs: dict[tuple[int, int], object] = {}  # (batch rows, threads) -> its built compiled call
        self.frame_calls = 0  # frame calls made (the background compile starts after the first frame)
        self.calls = 0  # model calls made (a step's count is checked against its plan)
        # why a frame's call cannot be one graph of the model as written (None: it can)
        self.graph_blocker = (self.ring_blocker or ("the ring guard checks every write on the host" if s.kv.guard else None)
                              or ("tensor parallelism communicates inside the blocks" if tp is not None else None)
                              or (None if s.frame_graph else "OWL_FRAME_GRAPH=0"))
        if s.compile:
            if self.graph_blocker is None:
                self.frame_call = self._compiled_frame_call()
                self.compiled = "whole"
            else:
                # Around a host-side cache, only each block's cache-free halves compile.
                self.core.transformer.compile(dynamic=False)
                self.compiled = "blocks"
        self.decoder = decoder.to(self.device).eval() if decoder is not None else None
        if self.decoder is not None and s.compile:
            self.decoder.compile(options=self._wrapper())

    def _wrapper(self) -> dict | None:
        # On the CPU a C++ wrapper calls a graph's kernels without a Python line each: in a
        # host-bound frame that Python was the largest fixed cost.
        return {"cpp_wrapper": True} if self.device.type == "cpu" else None

    def _compiled_frame_call(self):
        options = {**(self._wrapper() or {}), **eager_division()}  # in-graph quantization rounds as eager
        return torch.compile(self.core, fullgraph=True, dynamic=False, options=options)

    def compile_in_background(self, rows: tuple[int, ...] = (1,), threads: tuple[int, ...] = (), log=print) -> bool:
        """Compile the frame call (and the decoder) on a thread of its own while frames run
        eagerly: once the first frame is made, each CPU thread count (the current one, then those
        of ``threads``: the counts the app may switch to) and each batch size of ``rows`` is traced
        and run once on a scratch ring, and a call whose batch size and thread count have their
        graph built runs it from then on (the others stay eager: never a compile on the frames'
        thread). False where a frame call cannot be one graph (the eager or per-block path stays)."""
        if self.graph_blocker is not None or self.compiled is not None or self.background is not None:
            return False
        import threading

        counts = [torch.get_num_threads(), *(t for t in threads if t != torch.get_num_threads())]
        self.background = threading.Thread(target=self._build, args=(rows, counts, log), daemon=True,
                                           name="owl-compile")
        self.background.start()
        return True

    @torch.no_grad()
    def _build(self, rows, counts, log):
        import time

        start = time.perf_counter()
        while self.frame_calls < 2 and time.perf_counter() - start < 30:
            time.sleep(0.02)  # the first frame first: it comes as fast as without a compile
        try:
            call = self._compiled_frame_call()
            decode = self.decoder.compiled_decode(self._wrapper()) if self.decoder is not None else None
            cfg = self.cfg
            for threads in counts:
                torch.set_num_threads(threads)  # this thread's count: a graph is built per count
                for n in rows:
                    scratch = RingCache(self.cache_cfg, self.kv_plan, n, self.device, self.dtype)
                    x = torch.zeros(n, 1, cfg.channels, cfg.sample_size, cfg.sample_size, device=self.device,
                                    dtype=self.dtype)
                    t = torch.ones(n, 1, device=self.device, dtype=self.dtype)
                    call(x, t, x.new_zeros(n, 1, 2), x.new_zeros(n, 1, cfg.n_buttons), kv_cache=scratch)
                    if decode is not None and threads == counts[0]:
                        decode(torch.zeros(n, cfg.channels, cfg.sample_size, cfg.sample_size, device=self.device))
                    self.graphs[(n, threads)] = call
                if threads == counts[0]:
                    self.compiled = "whole"
                    if decode is not None:
                        self.decoder.use_decode(decode)
                    log(f"[owl] compile: the compiled frame call took over after {time.perf_counter() - start:.0f} s "
                        f"(batch sizes {', '.join(map(str, rows))}; {threads} threads"
                        + (f"; {', '.join(map(str, counts[1:]))} threads follow)" if counts[1:] else ")"))
        except Exception as exc:  # noqa: BLE001 - frames go on eagerly; say why once
            log(f"[owl] compile: frames stay eager ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")

    @property
    def uses_ring(self) -> bool:
        return self.ring_blocker is None

    def new_cache(self, rows: int = 1):
        """An empty cache of ``rows`` sessions: the ring, or (one session) a host-side cache."""
        if rows != 1 and not self.uses_ring:
            raise ValueError(f"{rows} sessions in one call need the in-place ring cache; this one can't: "
                             f"{self.ring_blocker}")
        return build_cache(self.cache_cfg, self.settings, self.window, rows, plans=self.kv_plan)

    def inputs(self, *tensors) -> list[torch.Tensor]:
        """Tensors as a model call takes them: on the model's device, in its dtype."""
        return [t.to(self.device, self.dtype) for t in tensors]

    @torch.no_grad()
    def call(self, x, t, mouse, buttons, cache, bias, write) -> torch.Tensor:
        """The model's velocity for ``x`` [b, n, c, h, w] at ``t`` [b, n] over ``cache`` (or the
        cache-free baseline's history), written when ``write`` (a bool, or [b] over the ring).
        ``bias``: the soft-forgetting bias (a float, or [b] over the ring)."""
        self.calls += 1
        if isinstance(cache, NoCacheHistory):
            return cache.velocity(self.core, x, t, mouse, buttons, bool(write), bias)
        if torch.is_tensor(write):  # per row of a batch
            cache.set_commit(write)
        elif write:
            cache.enable_cache_updates()
        if cache.in_place and x.shape[1] == 1:  # a frame over the ring: the graph of the model as written
            cache.set_bias(bias)
            self.frame_calls += 1
            call = self.graphs.get((x.shape[0], torch.get_num_threads()), self.frame_call)
            try:
                return call(x, t, mouse, buttons, kv_cache=cache)
            finally:
                cache.disable_cache_updates()
        try:
            return self.core(x, t, mouse, buttons, kv_cache=cache, attn_bias=bias)
        finally:
            cache.disable_cache_updates()

    @torch.no_grad()
    def denoise(self, x, mouse, buttons, cache, schedule, bias, commit, after_step=None) -> torch.Tensor:
        """Frames from noise ``x`` [b, 1, c, h, w] down ``schedule``, one model call a step over
        ``cache``; the last step writes the frames whose ``commit`` (a bool, or [b] over the ring)
        is set. ``after_step(i, velocity)`` sees each step's prediction."""
        last = len(schedule) - 2
        steps = [torch.full((x.shape[0], 1), t, device=x.device, dtype=x.dtype) for t in schedule[:-1]]
        no = torch.zeros_like(commit) if torch.is_tensor(commit) else False

        def velocity(x, t, i):
            v = self.call(x, steps[i], mouse, buttons, cache, bias, commit if i == last else no)
            if after_step is not None:
                after_step(i, v)
            return v

        return euler(velocity, x, schedule)

    def describe(self) -> str:
        if self.settings.compile_background and self.graph_blocker is None and self.compiled is None:
            return ("[owl] compile: auto: frames run eagerly; where compiling pays (the window, long rollouts) the frame "
                    "call compiles in the background and takes over (OWL_COMPILE=0: never; 1: before the first frame)")
        if self.settings.compile_background and self.graph_blocker is not None:
            return f"[owl] compile: auto: frames run eagerly (no one-graph frame call: {self.graph_blocker})"
        if self.compiled == "whole":
            return "[owl] compile: each generated frame's model call is one graph (the model as written)"
        if self.compiled == "blocks":
            return f"[owl] compile: a graph per block half (not one graph a frame: {self.graph_blocker})"
        return ""
