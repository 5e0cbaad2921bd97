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
        if self.device.type == "cpu":  # one matmul for every block's conditioning (Transformer.fuse_modulations)
            self.core.transformer.fuse_modulations()
        self.core.transformer.set_backends(s.attn_backend, s.attn_backend_decode, s.ring_attention)
        self.kv_plan = plan_layers(self.cache_cfg, s.kv, self.window) if s.kv_cache != "none" else None
        self.ring_blocker = ring_blocker(self.kv_plan, s.kv.ring_mode)
        self.frame_call = self.core  # what runs a generated frame's call over the ring
        self.compiled = None  # "whole" (one graph per frame call) or "blocks" (a graph per block half)
        self.background = None  # the child process compiling the frame call while frames run eagerly
        self.graphs: dict[tuple[int, int], object] = {}  # (batch rows, threads) -> its compiled call, loaded
        self.frame_calls = 0  # generated frames' calls made (the background compile waits for a frame)
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
        # The decoder runs in the model's dtype: where bf16 is fast it is also fast for the
        # decoder's convolutions (1.6x at one frame), and those grow with a batch's rows.
        self.decoder = decoder.to(self.device, s.dtype).eval() if decoder is not None else None
        if self.decoder is not None and s.compile:
            self.decoder.compile(options=self._wrapper())

    def _wrapper(self) -> dict | None:
        # On the CPU a C++ wrapper calls a graph's kernels without a Python line each: in a
        # host-bound frame that Python was the largest fixed cost.
        return {"cpp_wrapper": True} if self.device.type == "cpu" else None

    def _graph_options(self) -> dict:
        return {**(self._wrapper() or {}), **eager_division()}  # in-graph quantization rounds as eager

    def _compiled_frame_call(self):
        return torch.compile(self.core, fullgraph=True, dynamic=False, options=self._graph_options())

    def compile_in_background(self, rows: tuple[int, ...] = (1,), threads: tuple[int, ...] = (), log=print,
                              after_first_frame: bool = True) -> bool:
        """Once the first frame is made (at once where ``after_first_frame`` is False), load the
        frame call's graphs (and the decoder's) an earlier start kept, and compile the others in a
        child process while frames run eagerly (precompile.py says why a process, not a thread):
        one for each CPU thread count (the current one, then those of ``threads``: the counts the
        app may switch to) and each batch size of ``rows``. A call whose batch size and thread
        count have a graph runs it from then on, the others stay eager: never a compile on the
        frames' thread. False where a frame call cannot be one graph (the eager or per-block path
        stays)."""
        if self.graph_blocker is not None or self.compiled is not None or self.background is not None:
            return False
        from torch._inductor import config as inductor

        from .precompile import BackgroundCompile, CompileJob

        try:  # the compile process reads the weights from shared memory: moved there now, before any
            # frame runs (moving them while a frame reads them would free the memory it reads)
            self.core.share_memory()
            if self.decoder is not None:
                self.decoder.share_memory()
        except (RuntimeError, OSError) as exc:
            log(f"[owl] compile: frames stay eager (the weights could not move to shared memory for the compile "
                f"process: {exc}; a small /dev/shm?)")
            return False
        counts = (torch.get_num_threads(), *(t for t in threads if t != torch.get_num_threads()))
        job = CompileJob(self.core, self.decoder.autoencoder if self.decoder is not None else None, self.cache_cfg,
                         self.kv_plan, str(self.device), self.dtype, tuple(rows), counts,
                         self._graph_options(), self.settings.ring_attention, inductor.save_config_portable())
        self.background = BackgroundCompile(job, self._install_graph, self._take_over, log)
        if not after_first_frame:
            self.background.frames_began()
        return True

    def _install_graph(self, rows: int, threads: int, graph) -> None:
        self.graphs[(rows, threads)] = graph

    def _take_over(self, decode) -> None:
        self.compiled = "whole"
        if decode is not None:
            self.decoder.use_decode(decode)

    def compile_state(self) -> str:
        """For a status line: "eager", "compiled", or the background compile's progress."""
        if self.background is not None and not self.background.wait(0):
            return f"{'compiled' if self.compiled else 'eager'}, compiling {self.background.progress()}"
        return "compiled" if self.compiled else "eager"

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
            graph = self.graphs.get((x.shape[0], torch.get_num_threads()))
            try:
                out = graph(x, t, mouse, buttons, kv_cache=cache) if graph is not None else None
                return self.frame_call(x, t, mouse, buttons, kv_cache=cache) if out is None else out
            finally:
                self.frame_calls += 1
                if self.background is not None and self.frame_calls > 2:  # the next frame's call: one is made
                    self.background.frames_began()
                cache.disable_cache_updates()
        try:
            return self.core(x, t, mouse, buttons, kv_cache=cache, attn_bias=bias)
        finally:
            cache.disable_cache_updates()

    @torch.no_grad()
    def denoise(self, x, mouse, buttons, cache, schedule, bias, commit, after_step=None,
                guidance: float = 1.0) -> torch.Tensor:
        """Frames from noise ``x`` [b, 1, c, h, w] down ``schedule``, one model call a step over
        ``cache``; the last step writes the frames whose ``commit`` (a bool, or [b] over the ring)
        is set. ``after_step(i, velocity)`` sees each step's prediction. ``guidance`` other than 1
        makes the first step's prediction ``v_rest + guidance * (v - v_rest)``, ``v_rest`` the
        prediction with the mouse at rest (PipelineConfig.guidance), in one more call."""
        last = len(schedule) - 2
        steps = [torch.full((x.shape[0], 1), t, device=x.device, dtype=x.dtype) for t in schedule[:-1]]
        no = torch.zeros_like(commit) if torch.is_tensor(commit) else False

        def velocity(x, t, i):
            # the rest call comes first: a one-step schedule's call below writes the cache
            rest = self.call(x, steps[i], torch.zeros_like(mouse), buttons, cache, bias, no) \
                if i == 0 and guidance != 1 else None
            v = self.call(x, steps[i], mouse, buttons, cache, bias, commit if i == last else no)
            if rest is not None:
                v = torch.lerp(rest, v, guidance)
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
