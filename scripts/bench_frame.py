"""Milliseconds per frame of every path, side by side in one run: the original implementation's
eager loop, the eager path, the compiled graph per block half, the model compiled whole (the
default, and beside it and the eager path the other kernel of a frame's attention over the ring),
and batched sessions. The model compiled whole runs as the apps run it: its graphs compiled in a
background process and kept for the next start (this waits for them: minutes the first time),
beside the same compiled in this process before the first frame (``OWL_COMPILE=1``). Every graph
here carries Inductor's kernel-profiling hooks, so torch.profiler sees its kernels; the apps'
graphs do not (a graph is kept per Inductor setting, so these are compiled apart from theirs).

    python -m scripts.bench_frame [--frames 24] [--prod-layers 2] [--sessions 1 2 4 8] [--paths ...]
                                  [--guidance G] [--original PATH] [--json out.json]

Per model (the shipped world or ``--checkpoint``'s; a production-shaped GameRFT, d_model 1536,
24 heads, 64 tokens a frame, a 60-frame window, random weights, ``--prod-layers`` of its 16
layers), each path is prefilled with the same history and then makes the same frames, the
paths taking turns frame by frame so drift in the machine's speed touches every ratio alike.
Reported per path:

- ms for a frame's two model calls (median), and end to end with the decoder (a world's);
  beside the original's own loop (``--original``), this repo's eager path with the original's
  cache layout (bf16 roll) stands for it where no checkout is at hand (a GPU machine);
- the share of Python and launch overhead: 1 - (time inside ATen ops and compiled kernels) /
  wall time, from torch.profiler over a few frames;
- the floor: the frame's FLOPs (torch.utils.flop_counter) over this machine's measured matmul
  rate in the model's dtype;
- on a CPU, per model and dtype, one frame's attention over each ring length of its layers, by
  SDPA and by matmul-softmax-matmul (``attention.matmul_attention``), each compiled, in
  microseconds (on CUDA the compiled model always takes SDPA, so the table is skipped there);
- batched sessions (owl_wms/engine/sessions.py): B sessions, each a frame a step, one model call
  per denoising step, compiled whole, in the first dtype, the batch sizes taking turns step by
  step: ms per step, per session-frame, and the aggregate session-frames a second, as a ratio
  to B = 1's beside its bound (each session beyond one adding only its frame's FLOPs, model
  calls and decoding, at the best matmul rate), the minor page faults a step's denoising took
  (inference/heap.py: none where the heap keeps freed blocks), and the shares of a step's
  denoising spent in attention and in the matmuls (torch.profiler).

``--original PATH``: a checkout of Wayfarer-Labs/owl-wms, branch laptop_inference_v2_bf16 (needs
rotary-embedding-torch). Its GameRFTCore, StaticCache and two-step loop run on the same weights,
driven from here: its modules load under another package name, and its FlexAttention runs
eagerly (compiled FlexAttention does not build on a CPU), as the original's CPU loop did.
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from .common import HEAP_KEPT, machine, minor_faults, path_settings, require_at_least, synchronizer

# (--paths key, path, OWL_* flags); the first is the eager path, the third the default (the model compiled whole)
INT8 = {"OWL_KV_STORAGE": "int8", "OWL_RING_MODE": "inplace"}
# "compiled whole" paths run as the apps run them (OWL_COMPILE=auto): graphs compiled in a
# background process and kept (engine/precompile.py), waited for before the paths are timed
OURS = [("eager", "eager, int8 in-place", {**INT8, "OWL_COMPILE": "0"}),
        ("blocks", "compiled per block, int8 in-place", {**INT8, "OWL_COMPILE": "1", "OWL_FRAME_GRAPH": "0"}),
        ("whole", "compiled whole, int8 in-place", {**INT8, "OWL_COMPILE": "auto"}),
        ("whole-bf16", "compiled whole, bf16 in-place", {"OWL_RING_MODE": "inplace", "OWL_COMPILE": "auto"}),
        ("roll", "eager, bf16 roll (the original's layout)", {"OWL_RING_MODE": "roll", "OWL_COMPILE": "0"}),
        ("whole-here", "compiled whole in this process (OWL_COMPILE=1), int8 in-place", {**INT8, "OWL_COMPILE": "1"})]
PATH = {key: (name, flags) for key, name, flags in OURS}
EAGER, DEFAULT_FLAGS = PATH["eager"][0], PATH["whole"][1]
# --paths key of the default and the eager path each again with the other kernel of a frame's
# attention over the ring (Settings.ring_attention)
OTHER_RING = "other-ring"
PATHS = [key for key, _, _ in OURS] + [OTHER_RING]
ORIGINAL = "original eager loop, roll cache"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
WALK = ([1.0, 0.0], [1] + [0] * 10)


class Ours:
    """One of this repo's paths: a pipeline on its own copy of the model and decoder."""

    def __init__(self, name, flags, model, decoder, world, history, dtype, device):
        from inference.causvid_pipeline import CausvidPipeline
        from owl_wms.settings import without_kv

        settings = path_settings(without_kv(world.inference), {**flags, "OWL_DEVICE": device,
                                                                "OWL_DTYPE": DTYPE_NAMES[dtype]})
        self.name, self.dtype, self.ring = name, dtype, (settings.ring_attention
                                                if settings.kv.ring_mode == "inplace" else None)
        self.pipe = CausvidPipeline(copy.deepcopy(model), copy.deepcopy(decoder), world,
                                    settings, verbose=False)
        self.pipe.prefill(*history)
        if settings.compile_background:
            compile_kept(self.pipe.runner, 1)

    def frame(self):
        return self.pipe.generate(*WALK)

    def decode(self, latent):
        return self.pipe.decode(latent)


def compile_kept(runner, rows: int) -> None:
    """The apps' compiled path for a batch of ``rows``: the frame call's graph (and the
    decoder's) compiled in a background process, or loaded where an earlier run kept them.
    Waits until they are in use."""
    if not runner.compile_in_background((rows,), log=lambda text: None, after_first_frame=False):
        raise SystemExit(f"error: the frame call cannot compile whole here ({runner.graph_blocker})")
    runner.background.wait()
    if runner.compiled != "whole":
        raise SystemExit("error: the background compile did not take over; run the app to see why")


def load_original(path: Path):
    """The original's modules under the package name ``original_owl_wms`` (its imports are
    relative), its FlexAttention rebound to the eager implementation."""
    root = path / "owl_wms"
    if not (root / "models" / "gamerft.py").is_file():
        raise SystemExit(f"error: --original {path}: no owl_wms/models/gamerft.py there; give a checkout of "
                         "Wayfarer-Labs/owl-wms (branch laptop_inference_v2_bf16)")
    pkg = types.ModuleType("original_owl_wms")
    pkg.__path__ = [str(root)]
    sys.modules["original_owl_wms"] = pkg
    try:
        attn = importlib.import_module("original_owl_wms.nn.attn")
        gamerft = importlib.import_module("original_owl_wms.models.gamerft")
        kv_cache = importlib.import_module("original_owl_wms.nn.kv_cache")
        rope = importlib.import_module("original_owl_wms.nn.rope")
    except ImportError as e:
        raise SystemExit(f"error: --original {path}: {e}; the original needs it (pip install rotary-embedding-torch)")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attn.flex_attention, attn.create_block_mask = flex_attention, create_block_mask
    return gamerft.GameRFTCore, kv_cache.StaticCache, rope.cast_rope_buffers_to_fp32


class Original:
    """The original's two-step loop over its StaticCache (its CausvidPipeline's calls)."""

    def __init__(self, classes, model, decoder, world, history, dtype, device):
        from omegaconf import OmegaConf

        from owl_wms.controls import N_BUTTONS

        core_cls, cache_cls, fp32_rope = classes
        cfg = model.config
        self.cfg = OmegaConf.create({**{k: getattr(cfg, k) for k in (
            "sample_size", "channels", "n_layers", "n_heads", "d_model", "tokens_per_frame", "n_frames", "causal",
            "uncond", "rope_impl", "local_window", "global_window", "local_idx")},
            "n_buttons": N_BUTTONS, "n_mouse_axes": 2, "backbone": "dit", "has_audio": False,
            "rope_ats_delta": float(cfg.rope_ats_delta), "model_id": "game_rft", "cfg_prob": 0.0})
        if cfg.rope_impl == "motion":  # its rotary table ends after n_frames frames; motion angles do not depend on it
            self.cfg.n_frames = max(cfg.n_frames, 4096)
        self.core = core_cls(self.cfg).to(device, dtype).eval()
        fp32_rope(self.core)  # as its pipeline does: rotary tables stay float32
        self.core.load_state_dict(model.core.state_dict())
        self.name, self.device, self.dtype = ORIGINAL, device, dtype
        self.decoder = decoder
        window = world.pipeline.window_frames
        self.cache = cache_cls(self.cfg, max_length=window, batch_size=1, device=device, dtype=dtype)
        x, mouse, buttons = (t[None].to(device, dtype) for t in history)
        with torch.no_grad():
            self.core.transformer.disable_decoding()
            self.cache.enable_cache_updates()
            self.core(x, torch.full((1, window), world.pipeline.history_alpha, device=device, dtype=dtype), mouse,
                      buttons, kv_cache=self.cache)
            self.cache.disable_cache_updates()
            self.core.transformer.enable_decoding()
        self.gen = torch.Generator().manual_seed(0)
        self.mouse = torch.tensor(WALK[0], dtype=dtype, device=device).view(1, 1, 2)
        self.buttons = torch.tensor(WALK[1], dtype=dtype, device=device).view(1, 1, N_BUTTONS)

    @torch.no_grad()
    def frame(self):
        c, s = self.cfg.channels, self.cfg.sample_size
        z = torch.randn(1, 1, c, s, s, generator=self.gen).to(self.device, self.dtype)
        t = lambda v: torch.full((1, 1), v, device=self.device, dtype=self.dtype)  # noqa: E731
        v1 = self.core(z, t(1.0), self.mouse, self.buttons, kv_cache=self.cache)
        x = z - 0.75 * v1
        self.cache.enable_cache_updates()
        v2 = self.core(x, t(0.25), self.mouse, self.buttons, kv_cache=self.cache)
        self.cache.disable_cache_updates()
        return x - 0.25 * v2

    def decode(self, latent):
        return self.decoder.decode(latent)  # this repo's pipeline decoding (the same eager decoder)


def matmul_rate(dtype, device, sizes=(512, 1024, 2048)) -> float:
    """This machine's matmul rate (FLOP/s) in ``dtype``: the best of a few timings of n x n x n
    over ``sizes`` (the largest need not be the fastest on a CPU's caches)."""
    sync, rates = synchronizer(device), []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        best = float("inf")
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            for _ in range(2):
                a @ b
            sync()
            best = min(best, (time.perf_counter() - t0) / 2)
        rates.append(2 * n ** 3 / best)
    return max(rates)


def frame_flops(path) -> tuple[int, int]:
    """FLOPs of one frame's model calls and of decoding it (0 without a decoder)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    # torch's counter has no formula for the CPU's flash attention op: the ring reads count too
    cpu_attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                     lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        latent = path.frame()
    frame = counter.get_total_flops()
    if path.pipe.decoder is None:
        return frame, 0
    with FlopCounterMode(display=False) as counter:
        path.decode(latent)
    return frame, counter.get_total_flops()


def attention_times(cfg, window: int, dtype, repeats: int = 50) -> list[dict]:
    """Microseconds of one frame's queries attending over each ring length of the model's layers
    on the CPU (under a mask with a masked-out slot and a biased one), SDPA beside
    matmul-softmax-matmul, each compiled as in the compiled model: the medians of ``repeats`` calls."""
    from owl_wms.attention import matmul_attention, sdpa_attention

    compiled = {name: torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
                for name, fn in (("sdpa", sdpa_attention), ("matmul", matmul_attention))}
    g = torch.Generator().manual_seed(0)
    heads, tpf = cfg.n_heads, cfg.tokens_per_frame
    dh = cfg.d_model // heads
    slot_counts = sorted({min(window, cfg.decode_window(layer) or window) for layer in range(cfg.n_layers)})
    rows = []
    for slots in slot_counts:
        q, k, v = (torch.randn(1, heads, n, dh, generator=g).to(dtype) for n in (tpf, slots * tpf, slots * tpf))
        mask = torch.zeros(1, slots * tpf)
        mask[:, :tpf], mask[:, tpf:2 * tpf] = float("-inf"), -0.5
        times = {}
        for name, kernel in compiled.items():
            kernel(q, k, v, mask, dh ** -0.5)
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                kernel(q, k, v, mask, dh ** -0.5)
                samples.append(time.perf_counter() - t0)
            times[name] = 1e6 * statistics.median(samples)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "keys": slots * tpf, "queries": tpf, "heads": heads,
                     "sdpa_us": times["sdpa"], "matmul_us": times["matmul"]})
    return rows


def overhead_share(path, frames: int, device) -> float:
    """1 - (self time of ATen ops and compiled kernels) / wall time, over ``frames`` frames. ATen
    ops called from Inductor's C++ wrapper show as its ``aoti_torch_*`` calls."""
    import torch._inductor.config as inductor
    from torch.profiler import ProfilerActivity, profile

    assert inductor.cpp.enable_kernel_profile  # set before anything compiled: kernels show as events
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(frames):
            path.frame()
        sync()
    wall = time.perf_counter() - t0
    busy = sum(e.self_cpu_time_total for e in prof.key_averages()
               if e.key.startswith(("aten::", "aoti_torch_", "cpp_fused", "graph_")) or "kernel" in e.key) / 1e6
    return max(0.0, 1 - busy / wall)


def op_shares(step, steps: int, device: str) -> dict[str, float | None]:
    """Shares of the wall time of ``steps`` calls of ``step`` spent in attention (SDPA, or the
    batched matmuls of the ring's matmul kernel: bmm, which only attention calls), in the
    linear layers' matmuls (addmm, mm), and in the compiled kernels that hold the matmul kernel's
    softmax (Inductor fuses it with the mask, and one of them with a ring write): the self times
    of those ATen ops (called eagerly or from a compiled graph's wrapper) and kernels, from
    torch.profiler. On a GPU the host's times say nothing of the kernels': None there."""
    from torch.profiler import ProfilerActivity, profile

    if device != "cpu":
        return {"attention_share": None, "matmul_share": None, "softmax_share": None}
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    ops = [e for e in events if e.key.startswith(("aten::", "aoti_torch_"))]
    kernels = [e for e in events if "_cpp_fused_" in e.key]  # named so by inductor.cpp.enable_kernel_profile

    def share(*names, among=ops):
        return sum(e.self_cpu_time_total for e in among if any(n in e.key for n in names)) / 1e6 / wall

    return {"attention_share": share("scaled_dot_product", "bmm"),
            "matmul_share": share("addmm", "aoti_torch_cpu_mm_out", "aten::mm"),
            "softmax_share": share("_softmax", among=kernels)}


def run_model(label, model, decoder, world, args, classes) -> list[dict]:
    from owl_wms.controls import no_controls

    g = torch.Generator().manual_seed(0)
    cfg, window = model.config, world.pipeline.window_frames
    history = (torch.randn(window, cfg.channels, cfg.sample_size, cfg.sample_size, generator=g), *no_controls(window))
    paths = []
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        ours = [Ours(name, flags, model, decoder, world, history, dtype, args.device)
                for key, name, flags in OURS if key in args.paths]
        if OTHER_RING in args.paths:  # the default, compiled and eager, beside the other kernel
            other = "sdpa" if ours[0].ring == "matmul" else "matmul"
            ours += [Ours(f"{PATH[key][0]}, {other} ring", {**PATH[key][1], "OWL_RING_ATTENTION": other}, model,
                          decoder, world, history, dtype, args.device)
                     for key in ("whole", "eager") if key in args.paths]
        if args.guidance is not None:  # the default and the eager path again, sampled with control guidance
            ours += [Ours(f"{PATH[key][0]}, guidance {args.guidance:g}", PATH[key][1], model, decoder,
                          world.with_guidance(args.guidance), history, dtype, args.device)
                     for key in ("whole", "eager") if key in args.paths]
        if classes is not None:  # the original's frames are decoded by this repo's eager path (uncompiled decoder)
            paths.append(Original(classes, model, ours[0] if decoder is not None else None, world, history, dtype,
                                  args.device))
        paths += ours
    print(f"\n{label}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, window {window} frames, "
          f"{cfg.tokens_per_frame} tokens a frame; warm-up ({args.warmup} frames each, compiles) ...", flush=True)
    for _ in range(args.warmup):
        for p in paths:
            p.decode(p.frame()) if decoder is not None else p.frame()
    calls, decodes = ([[] for _ in paths] for _ in range(2))
    sync = synchronizer(args.device)
    for _ in range(args.frames):  # the paths take turns, frame by frame
        for i, p in enumerate(paths):
            sync()
            t0 = time.perf_counter()
            latent = p.frame()
            sync()
            t1 = time.perf_counter()
            if decoder is not None:
                p.decode(latent)
                sync()
                decodes[i].append(time.perf_counter() - t1)
            calls[i].append(t1 - t0)
    reference = 1000 * statistics.median(calls[paths.index(next(p for p in paths if p.name == EAGER))])
    rows, floors = [], {}
    for i, p in enumerate(paths):
        dtype_name = str(p.dtype).removeprefix("torch.")
        if dtype_name not in floors:
            rate = matmul_rate(p.dtype, args.device)
            flops, decode_flops = frame_flops(next(q for q in paths if q.name == EAGER and q.dtype == p.dtype))
            floors[dtype_name] = (flops, rate, 1000 * flops / rate, decode_flops)
        flops, rate, floor_ms, _ = floors[dtype_name]
        ms = 1000 * statistics.median(calls[i])
        decode_ms = 1000 * statistics.median(decodes[i]) if decodes[i] else None
        original = next((r for r in rows if r["path"] == ORIGINAL and r["dtype"] == dtype_name), None)
        rows.append({"model": label, "path": p.name, "dtype": dtype_name, "ring_attention": getattr(p, "ring", None),
                     "calls_ms": ms, "decode_ms": decode_ms,
                     "end_to_end_ms": ms + decode_ms if decode_ms is not None else None,
                     "x_eager": reference / ms, "x_original": original["calls_ms"] / ms if original else None,
                     "x_floor": ms / floor_ms, "overhead_share": overhead_share(p, args.profile_frames, args.device),
                     "flops": flops, "matmul_gflops": rate / 1e9, "floor_ms": floor_ms})
    for dtype_name, (flops, rate, floor_ms, decode_flops) in floors.items():
        print(f"{dtype_name}: frame FLOPs (two calls) {flops / 1e6:.0f} M, decoding {decode_flops / 1e6:.0f} M; "
              f"matmul rate {rate / 1e9:.1f} GFLOP/s: floor {floor_ms:.2f} ms")
    print(f"x eager: against {EAGER} in {args.dtype[0]}; x original: against the original in the same dtype")
    print(f"{'path':<48} {'dtype':>8} {'ring':>6} {'calls ms':>9} {'decode ms':>10} {'FPS':>6} {'x eager':>10} "
          f"{'x original':>11} {'x floor':>8} {'overhead':>9}")
    for r in rows:
        dec = f"{r['decode_ms']:.2f}" if r["decode_ms"] is not None else "-"
        fps = f"{1000 / r['end_to_end_ms']:.1f}" if r["end_to_end_ms"] else "-"
        x_orig = f"{r['x_original']:.2f}" if r["x_original"] else "-"
        print(f"{r['path']:<48} {r['dtype']:>8} {r['ring_attention'] or '-':>6} {r['calls_ms']:>9.2f} {dec:>10} {fps:>6} {r['x_eager']:>10.2f} "
              f"{x_orig:>11} {r['x_floor']:>8.1f} {100 * r['overhead_share']:>8.0f}%")
    flops, rate, _, decode_flops = floors[str(DTYPES[args.dtype[0]]).removeprefix("torch.")]
    sessions = session_rows(label, model, decoder, world, history, args, 1000 * (flops + decode_flops) / rate)
    if args.device != "cpu":
        return rows, [], sessions
    attention = [dict(a, model=label) for name in args.dtype
                 for a in attention_times(cfg, window, DTYPES[name])]
    print(f"attention of one frame's queries ({cfg.tokens_per_frame} tokens, {cfg.n_heads} heads) over a ring, "
          "compiled, median us:")
    print(f"{'dtype':>9} {'keys':>6} {'sdpa us':>9} {'matmul us':>10} {'sdpa / matmul':>14}")
    for a in attention:
        print(f"{a['dtype']:>9} {a['keys']:>6} {a['sdpa_us']:>9.1f} {a['matmul_us']:>10.1f} "
              f"{a['sdpa_us'] / a['matmul_us']:>14.2f}")
    return rows, attention, sessions


def batching_bound(sessions: int, base_sessions: int, base_step_ms: float, frame_floor_ms: float) -> float:
    """The most ``sessions`` in one step can make, as a ratio to the session-frames a second of
    ``base_sessions`` whose step takes ``base_step_ms``, when every session more adds its
    frame's floor and nothing else."""
    step_ms = base_step_ms + (sessions - base_sessions) * frame_floor_ms
    return (sessions / step_ms) / (base_sessions / base_step_ms)


def step_and_decode(batch, controls) -> None:
    latents = batch.step(controls)
    if batch.decoder is not None:
        batch.decode(list(latents.values()))


def session_rows(label, model, decoder, world, history, args, frame_floor_ms: float) -> list[dict]:
    """B sessions of the default (compiled whole, int8 in-place) at once, for each B of
    ``args.sessions``: ms per batched step (a frame of every session, decoded with the decoder
    when there is one), per session-frame, and the aggregate rate as a ratio to B = 1's.

    Beside that ratio, its bound: the ratio B sessions would reach if each session beyond the
    smallest batch's added nothing to the step but its frame's FLOPs (model calls and decoding,
    ``frame_floor_ms``) at this machine's best matmul rate. Every session attends over its own
    history and decodes its own frame, so no batching goes past it."""
    from owl_wms.engine.sessions import Sessions, batch_rows
    from owl_wms.settings import without_kv

    if not args.sessions:
        return []
    settings = path_settings(without_kv(world.inference), {**DEFAULT_FLAGS, "OWL_DEVICE": args.device,
                                                           "OWL_DTYPE": args.dtype[0]})
    sync, batches = synchronizer(args.device), {}
    for n in args.sessions:
        batch = Sessions(copy.deepcopy(model), copy.deepcopy(decoder), world, settings,
                         capacity=n, verbose=False)
        pipes = [batch.open(seed=i, clip=None) for i in range(n)]
        for pipe in pipes:
            pipe.prefill(*history)
        batches[n] = (batch, {pipe: WALK for pipe in pipes})
        compile_kept(batch.runner, batch_rows(n))
        for _ in range(args.warmup):
            step_and_decode(batch, batches[n][1])
    denoise, decode, faults = ({n: [] for n in batches} for _ in range(3))
    for _ in range(args.frames):  # the batch sizes take turns, step by step
        for n, (batch, controls) in batches.items():
            sync()
            f0, t0 = minor_faults(), time.perf_counter()
            latents = batch.step(controls)
            sync()
            t1 = time.perf_counter()
            faults[n].append(minor_faults() - f0)
            if decoder is not None:
                batch.decode(list(latents.values()))
                sync()
            decode[n].append(time.perf_counter() - t1)
            denoise[n].append(t1 - t0)
    rows = []
    for n, (batch, controls) in batches.items():
        denoise_ms, decode_ms = (1000 * statistics.median(x[n]) for x in (denoise, decode))
        ms = denoise_ms + decode_ms if decoder is not None else denoise_ms
        rows.append({"model": label, "sessions": n, "dtype": args.dtype[0], "ring_attention": settings.ring_attention,
                     "denoise_ms": denoise_ms,
                     "step_ms": ms, "session_frame_ms": ms / n, "aggregate_fps": 1000 * n / ms,
                     "denoise_fps": 1000 * n / denoise_ms, "decoded": decoder is not None,
                     "page_faults_per_step": statistics.mean(faults[n]), "heap_kept": HEAP_KEPT,
                     **op_shares(functools.partial(batch.step, controls), args.profile_frames, args.device)})
    first = rows[0]
    for r in rows:
        r["x_one_session"] = r["aggregate_fps"] / first["aggregate_fps"]
        r["x_one_session_denoise"] = r["denoise_fps"] / first["denoise_fps"]
        r["session_frame_floor_ms"] = frame_floor_ms
        r["x_one_session_bound"] = batching_bound(r["sessions"], first["sessions"], first["step_ms"], frame_floor_ms)
    what = "a step: denoise + decode" if decoder is not None else "a step: denoise only"
    print(f"batched sessions, compiled whole, int8 in-place, {args.dtype[0]}, {settings.ring_attention} ring ({what}):")
    print(f"{'sessions':>9} {'denoise ms':>11} {'step ms':>9} {'ms/session-frame':>17} {'session-frames/s':>17} "
          f"{'x one session':>14} {'bound':>6} {'x (denoise)':>12} {'faults/step':>12} {'attention':>10} "
          f"{'softmax':>8} {'matmuls':>8}")
    for r in rows:
        print(f"{r['sessions']:>9} {r['denoise_ms']:>11.2f} {r['step_ms']:>9.2f} {r['session_frame_ms']:>17.2f} "
              f"{r['aggregate_fps']:>17.1f} {r['x_one_session']:>14.2f} {r['x_one_session_bound']:>6.2f} "
              f"{r['x_one_session_denoise']:>12.2f} "
              f"{r['page_faults_per_step']:>12.0f} "
              + (f"{r['attention_share']:>10.0%} {r['softmax_share']:>8.0%} {r['matmul_share']:>8.0%}"
                 if r["attention_share"] is not None else ""))
    print("(attention: SDPA or the ring's batched matmuls; softmax: the compiled kernels holding the matmul "
          "ring's softmax; matmuls: the linear layers'; each a share of a step's denoising under torch.profiler)")
    print(f"(bound: x one session if each session beyond the first row's added only its frame's FLOPs at the best "
          f"matmul rate, {frame_floor_ms:.2f} ms a session-frame)")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=24, help="measured frames per path (after the warm-up)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--profile-frames", type=int, default=4, help="frames per path under torch.profiler")
    p.add_argument("--prod-layers", type=int, default=2, help="layers of the production-shaped model (0: skip it)")
    p.add_argument("--original", type=Path, default=None, help="a checkout of the original (see above)")
    p.add_argument("--sessions", nargs="*", type=int, default=[1, 2, 4, 8],
                   help="batch sizes of the batched-sessions table (none: skip it)")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES),
                   help="dtypes to run every path in (the first is the reference's)")
    p.add_argument("--paths", nargs="+", default=PATHS, choices=PATHS, metavar="PATH",
                   help=f"paths to time (default: all of {' '.join(PATHS)}); the eager path always runs, as the "
                        f"reference, and {OTHER_RING} times the whole and eager paths chosen with the other ring kernel")
    p.add_argument("--guidance", type=float, default=None,
                   help="also time the model compiled whole and the eager path sampled with this control guidance "
                        "(its rest call: one more model call a frame; the frames walk with the mouse off rest)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint", type=Path, default=None, help="a world's checkpoint folder (default: the shipped world)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.paths = ["eager", *args.paths]
    require_at_least(("--frames", args.frames, 1), ("--warmup", args.warmup, 1),
                     ("--profile-frames", args.profile_frames, 1), ("--prod-layers", args.prod_layers, 0))
    if args.prod_layers > 16:
        raise SystemExit(f"error: --prod-layers {args.prod_layers}: the production model has 16 layers")
    if any(not 1 <= n <= 64 for n in args.sessions) or len(set(args.sessions)) != len(args.sessions):
        raise SystemExit(f"error: --sessions {' '.join(map(str, args.sessions))}: each must be in [1, 64], and "
                         "given once")
    from owl_wms.config import guidance_problem

    if args.guidance is not None and (problem := guidance_problem(args.guidance)):
        raise SystemExit(f"error: --guidance {args.guidance:g}: {problem}")
    classes = load_original(args.original) if args.original is not None else None
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    inductor.cpp.enable_kernel_profile = True  # compiled kernels appear in the profiler (overhead share)
    # Every path of both models in every dtype compiles in this one process: more graphs per
    # function than an app ever makes (it runs one model in one dtype).
    dynamo.recompile_limit = dynamo.accumulated_recompile_limit = 256
    from owl_wms.config import PRODUCTION, ConfigError, DecoderConfig, ModelConfig, PipelineConfig, WorldConfig
    from owl_wms.engine.build import load_parts
    from owl_wms.loading import CheckpointError
    from owl_wms.model import GameRFT

    from inference.flags import resolve_settings, with_threads

    with_threads(resolve_settings({}))  # the thread count every path runs at, so the header names it
    command = "python -m scripts.bench_frame " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command.rstrip()}\ntorch {torch.__version__}; machine: {machine()}; device {args.device}")
    try:
        world, model, decoder, _ = load_parts(args.checkpoint)  # default: the shipped world
    except (ConfigError, CheckpointError, OSError) as exc:
        raise SystemExit(f"error: --checkpoint {args.checkpoint}: {exc}") from None
    label = "shipped world" if args.checkpoint is None else f"world {world.name} ({args.checkpoint})"
    rows, attention, sessions = run_model(label, model, decoder, world, args, classes)
    if args.prod_layers:
        cfg = ModelConfig.from_mapping({**PRODUCTION, "n_layers": args.prod_layers})
        torch.manual_seed(0)
        prod = GameRFT(cfg)
        prod_world = WorldConfig(model=cfg, vae_scale=1.0, pipeline=PipelineConfig(window_frames=60),
                                 decoder=DecoderConfig(), name="production-shaped-random")
        prod_rows, prod_attention, prod_sessions = run_model(
            f"production-shaped, {args.prod_layers} of 16 layers (denoise only)", prod, None, prod_world, args, classes)
        rows, attention, sessions = rows + prod_rows, attention + prod_attention, sessions + prod_sessions
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine(), "torch": torch.__version__,
                                               "rows": rows, "attention": attention, "sessions": sessions},
                                              indent=2))


if __name__ == "__main__":
    main()
