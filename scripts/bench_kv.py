"""What each KV cache mode costs and saves, measured side by side in one run.

    python -m scripts.bench_kv [--frames 12] [--device cpu] [--cuda-graph] [--skip-matrix] [--decode]
                               [--decode-only] [--json out.json]

1. Cache cost per frame at production shapes (16 layers with 4 global, 24 heads, head dim 64,
   60-frame window, 64 tokens/frame, local window 16): the cache work of one generated frame,
   i.e. the read-only step 1 and the writing step 2 over every layer (encode, write, read,
   dequantize), on synthetic K/V, for every layout x codec, with eager code and, for the rolled
   slab, with the compiled encode/decode kernels that OWL_COMPILE=1 uses (the ring's compiled form
   is part of a frame's one graph, which bench_frame times). Reported as ratios to bf16 roll,
   each the median over frames that alternate with a live bf16 roll cache. With ``--cuda-graph``
   (CUDA only), each mode's frame is also captured as a CUDA graph and timed by replay against
   the captured bf16 roll: what the kernels cost without Python or launch overhead.
2. Memory at the same shapes from ``cache.nbytes()`` (data + scales), as ratios to bf16 roll.
3. The v0-v4 matrix of the original KV-cache notes on the shipped world (real pipeline,
   denoise + decode): no cache, bf16 cache, int8 cache, cross-layer sharing, int8 + sharing.
4. With ``--decode``: one layer's 60-frame window decoded by each quantized codec, eagerly,
   with its compiled kernel, and by the casts it replaces (fp8: torch's own float8 cast; int8:
   Inductor's cast, which the compiled kernel leaves to ATen on CPUs without AVX512), in
   alternation.
   ``--decode-only`` measures this table alone.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from inference.flags import resolve_settings
from owl_wms.config import PRODUCTION, ModelConfig
from owl_wms.quant import Fused
from owl_wms.ring import build_cache
from owl_wms.settings import Settings

from .common import machine, synchronizer, world_rows

WINDOW = 60
LAYOUTS = ("roll", "pointer", "inplace")
CODECS = {  # name -> flags (K+V unless said)
    "bf16": {},
    "int8": {"OWL_KV_STORAGE": "int8"},
    "fp8_e4m3": {"OWL_KV_STORAGE": "fp8_e4m3"},
    "fp8_e5m2": {"OWL_KV_STORAGE": "fp8_e5m2"},
    "int4": {"OWL_KV_STORAGE": "int4"},
    "fp8 V-only": {"OWL_FP8_KV": "1", "OWL_K_FP8": "0"},
}
MATRIX = {  # the original notes' v0..v4
    "v0 no cache": {"OWL_KV_CACHE": "none"},
    "v1 bf16 cache": {},
    "v2 int8 cache": {"OWL_KV_STORAGE": "int8"},
    "v3 sharing (2 layers)": {"OWL_KV_SHARE": "2"},
    "v4 int8 + sharing": {"OWL_KV_STORAGE": "int8", "OWL_KV_SHARE": "2"},
}


def kv_settings(env: dict) -> Settings:
    return resolve_settings({}, env)


def make_cache(cfg: ModelConfig, layout: str, env: dict, device, dtype, compiled: bool = False):
    settings = kv_settings({**env, "OWL_RING_MODE": layout}).replace(device=device, dtype=dtype, compile=compiled)
    return build_cache(cfg, settings, WINDOW)


def held_tensors(obj, seen: set | None = None) -> list[torch.Tensor]:
    """Every tensor an owl_wms object holds, through its attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif type(obj).__module__.startswith("owl_wms") and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return []
    return [t for x in list(items) for t in held_tensors(x, seen)]


class CacheFrames:
    """A cache holding a full window of synthetic K/V; ``frame()`` times the cache work of one
    generated frame: the read-only step 1 and the writing step 2 over every layer."""

    def __init__(self, cfg, layout, env, device, dtype, sync, compiled=False):
        self.cfg, self.sync = cfg, sync
        self.cache = make_cache(cfg, layout, env, device, dtype, compiled)
        g = torch.Generator(device=device).manual_seed(0)
        shape = (1, cfg.n_heads, cfg.tokens_per_frame, cfg.head_dim)
        hist = torch.randn((1, cfg.n_heads, WINDOW * cfg.tokens_per_frame, cfg.head_dim), generator=g,
                           device=device, dtype=dtype)
        self.cache.enable_cache_updates()
        for layer in range(cfg.n_layers):
            self.cache.attend_window(layer, hist, hist)  # prefill: a full window
        self.advance(WINDOW)
        self.new = [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(4)]
        self.count = 0

    def work(self):
        f, cache, layers = self.count, self.cache, range(self.cfg.n_layers)
        self.count += 1
        k1, k2 = self.new[f % 4], self.new[(f + 1) % 4]
        cache.disable_cache_updates()
        for layer in layers:
            cache.attend_window(layer, k1, k1)
        self.advance(1)
        cache.enable_cache_updates()
        for layer in layers:
            cache.attend_window(layer, k2, k2)
        self.advance(1)

    def advance(self, frames: int):
        """A ring's positions are tensors the model advances after each call (model.py)."""
        if self.cache.on_device:
            self.cache.advance(frames)

    def frame(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.work()
        self.sync()
        return time.perf_counter() - t0

    def capture(self):
        """One steady-state frame's cache work as a CUDA graph, so that its replay costs what
        the kernels cost, without Python or launch overhead. First a full ring of frames
        (every write slot and gather index exists, every kernel is compiled), then a warm-up on
        a side stream, as torch.cuda.graph asks. A replay redoes the captured frame (the same
        slot, the same bytes): bookkeeping on the host does not advance, the work does not change."""
        for _ in range(self.cache.max_frames + 1):
            self.work()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.work()
        torch.cuda.current_stream().wait_stream(side)
        fused_before = Fused.unavailable
        # Every tensor the cache holds now stays alive with the graph, which reads their addresses on
        # each replay: the capture rebinds some (a roll's buffers, a quantizer's tally) to new ones.
        self.inputs = held_tensors(self.cache)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.work()
        if Fused.unavailable != fused_before:  # a compiled kernel failed under capture and fell back to eager
            reason, Fused.unavailable = Fused.unavailable, fused_before  # the later modes keep their kernels
            raise RuntimeError(f"a compiled KV kernel failed under capture: {reason}")
        self.graph.replay()

    def replay(self, reps: int) -> float:
        """Seconds per replay of the captured frame, over ``reps`` replays back to back."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            self.graph.replay()
        self.sync()
        return (time.perf_counter() - t0) / reps


def cache_cost(mode: CacheFrames, base: CacheFrames, frames: int) -> tuple[float, float]:
    """(median ms, median ratio to ``base``): frames alternate between the mode and the bf16
    roll baseline, so drift in the machine's speed (this VM's memory bandwidth varies by tens
    of percent over minutes) touches both sides of every ratio alike."""
    for _ in range(2):  # warm-up (and the first compile)
        mode.frame(), base.frame()
    times, ratios = [], []
    for _ in range(frames):
        b, m = base.frame(), mode.frame()
        times.append(m)
        ratios.append(m / b)
    return statistics.median(times) * 1000, statistics.median(ratios)


def graph_cost(mode: CacheFrames, base: CacheFrames, frames: int, reps: int = 20) -> tuple[float, float]:
    """As ``cache_cost``, for the captured frames (``CacheFrames.capture``): each sample is the
    mean of ``reps`` replays, alternating with as many replays of the captured bf16 roll."""
    mode.capture()
    times, ratios = [], []
    for i in range(frames + 2):
        b, m = base.replay(reps), mode.replay(reps)
        if i >= 2:
            times.append(m)
            ratios.append(m / b)
    del mode.graph
    return statistics.median(times) * 1000, statistics.median(ratios)


def decode_rows(cfg: ModelConfig, device, dtype, sync, reps: int) -> list[dict]:
    """Median ms to decode one layer's whole window (per-token scales) into a ``dtype`` buffer:
    each quantized codec's eager decode and compiled kernel, the casts they replace,
    the methods of a codec taking turns so drift touches them alike."""
    from owl_wms.quant import _DECODE_FP8, FUSED, Quantizer, ScalePolicy, cast_decode, make_codec

    torch._dynamo.reset()  # the cache modes above used up compile-cache entries of these kernels

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((1, cfg.n_heads, WINDOW, cfg.tokens_per_frame, cfg.head_dim), generator=g, device=device)
    out = torch.empty(x.shape, device=device, dtype=dtype)
    rows = []
    for name in ("int8", "fp8_e4m3", "fp8_e5m2", "int4"):
        codec = make_codec(name)
        q, scale = Quantizer(codec, ScalePolicy("token")).encode(x, commit=False, scale_dtype=dtype)
        methods = {"eager": lambda: codec.decode(q, scale, dtype, out=out)}
        fused = FUSED[name][1]
        methods["compiled"] = lambda: fused(q, scale, out)  # the kernel OWL_COMPILE=1 decodes with
        if name == "int8":  # what OWL_COMPILE=1 decodes int8 with on CUDA and AVX512 CPUs (elsewhere ATen's kernels)
            cast = torch.compile(cast_decode, dynamic=True)
            methods["Inductor's cast"] = lambda: cast(q, scale, out)
        if name.startswith("fp8"):
            methods["torch cast"] = lambda: torch.mul(q.to(dtype), scale.to(dtype), out=out)
            if fused is not _DECODE_FP8:
                methods["compiled cast"] = lambda: _DECODE_FP8(q, scale, out)
        times = {m: [] for m in methods}
        for i in range(reps + 2):
            for m, f in methods.items():
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                if i >= 2:  # warm-up (and the first compile)
                    times[m].append(time.perf_counter() - t0)
        rows += [{"codec": name, "method": m, "ms": statistics.median(t) * 1000} for m, t in times.items()]
    return rows


def cache_rows(cfg: ModelConfig, args, dtype, sync) -> list[dict]:
    """Parts 1 and 2: every layout x codec's cache cost per frame and memory, printed as tables."""
    base = CacheFrames(cfg, "roll", CODECS["bf16"], args.device, dtype, sync)
    if args.cuda_graph:
        graph_base = CacheFrames(cfg, "roll", CODECS["bf16"], args.device, dtype, sync)
        graph_base.capture()
    results = []
    for codec, env in CODECS.items():
        for layout in LAYOUTS:
            # bf16 has nothing to convert; the ring compiles only as part of the frame's graph
            for compiled in (False, True) if codec != "bf16" and layout == "roll" else (False,):
                if compiled:  # each mode compiles afresh: modes share kernels, and dynamo's recompile limit is 8
                    torch._dynamo.reset()
                mode = CacheFrames(cfg, layout, env, args.device, dtype, sync, compiled)
                ms, ratio = cache_cost(mode, base, args.frames)
                row = {"codec": codec, "layout": layout, "compiled": compiled, "ms": ms, "ratio": ratio,
                       "bytes": mode.cache.nbytes()}
                graph = ""
                if args.cuda_graph:
                    try:
                        row["graph_ms"], row["graph_ratio"] = graph_cost(mode, graph_base, args.frames)
                        graph = f"; CUDA graph {row['graph_ms']:.3f} ms ({row['graph_ratio']:.3f}x)"
                    except Exception as e:  # noqa: BLE001 - one mode that cannot be captured spoils no other row
                        row["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                        graph = f"; CUDA graph failed: {row['graph_error']}"
                results.append(row)
                print(f"  measured {codec:<11} {layout:<8} {'compiled' if compiled else 'eager':<8} {ms:8.2f} ms/frame "
                      f"({ratio:.3f}x bf16 roll)  {row['bytes'] / 2**20:8.1f} MiB{graph}", flush=True)
                del mode
                gc.collect()
    ref = next(r for r in results if r["codec"] == "bf16" and r["layout"] == "roll")
    print(f"\nPer-frame cache cost (both steps, all layers) as the median ratio to bf16 roll over frames "
          f"alternating with it ({ref['ms']:.2f} ms); lower is cheaper. Eager / compiled encode+decode "
          "(the kernels OWL_COMPILE=1 uses)")
    ratio_table(results, "ratio")
    if args.cuda_graph:
        print(f"\nThe same frames captured as CUDA graphs (kernels only: no Python or launch cost), as the "
              f"median ratio to the captured bf16 roll ({ref['graph_ms']:.3f} ms); eager / compiled")
        ratio_table(results, "graph_ratio")
    print(f"\nMemory (nbytes: data + scales), ratio to bf16 roll = {ref['bytes'] / 2**20:.1f} MiB")
    print(f"{'codec':<12}" + "".join(f"{lay:>12}" for lay in ("roll", "pointer", "inplace")))
    for codec in CODECS:
        cells = [r for r in results if r["codec"] == codec and not r["compiled"]]
        print(f"{codec:<12}" + "".join(f"{r['bytes'] / ref['bytes']:>12.3f}" for r in cells))
    return results


def ratio_table(results: list[dict], key: str):
    """Codec rows x layout columns of ``key``, eager / compiled in a cell."""
    print(f"{'codec':<12}" + "".join(f"{lay:>16}" for lay in LAYOUTS))
    for codec in CODECS:
        cells = [" / ".join(f"{r[key]:.3f}" if key in r else "-" for r in results if r["codec"] == codec and r["layout"] == lay)
                 for lay in LAYOUTS]
        print(f"{codec:<12}" + "".join(f"{c:>16}" for c in cells))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=12, help="measured frames per cache mode")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--skip-matrix", action="store_true", help="skip the v0-v4 matrix on the shipped world")
    p.add_argument("--checkpoint", default=None, help="world for the v0-v4 matrix (default: the shipped one)")
    p.add_argument("--matrix-frames", type=int, default=48)
    p.add_argument("--decode", action="store_true", help="also time each codec's decode of one layer's window")
    p.add_argument("--decode-only", action="store_true", help="time only the decodes (--decode's table)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time each mode's frame captured as a CUDA graph (kernels only: no Python or launch cost)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.cuda_graph and not args.device.startswith("cuda"):
        p.error(f"--cuda-graph captures CUDA graphs; --device {args.device} has none (use --device cuda)")
    sync = synchronizer(args.device)
    cfg = ModelConfig.from_mapping({**PRODUCTION, "n_frames": WINDOW})
    print(f"command: python -m scripts.bench_kv {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"torch {torch.__version__}; machine: {machine()}; device {args.device}, {args.dtype}")
    if args.device == "cpu" and not args.decode_only:
        print(f"(on a 2-core CPU this takes minutes: about 3 with --skip-matrix at the default --frames; "
              f"--frames 2 --skip-matrix for a quick look)", flush=True)
    print(f"production cache shapes: {cfg.n_layers} layers ({cfg.n_layers // cfg.local_idx} global), "
          f"{cfg.n_heads} heads x {cfg.head_dim}, window {WINDOW} frames x {cfg.tokens_per_frame} tokens, "
          f"local window {cfg.local_window}")

    out = {"machine": machine(), "torch": torch.__version__}
    if not args.decode_only:
        out["cache"] = cache_rows(cfg, args, dtype, sync)
    if args.decode or args.decode_only:
        rows = decode_rows(cfg, args.device, dtype, sync, max(args.frames, 10))
        print(f"\nDecode of one layer's window ({cfg.n_heads} heads x {WINDOW} frames x {cfg.tokens_per_frame} "
              f"tokens x {cfg.head_dim}, per-token scales), median ms")
        for r in rows:
            print(f"{r['codec']:<12} {r['method']:<16} {r['ms']:8.3f}")
        out["decode"] = rows
    if not (args.skip_matrix or args.decode_only):
        rows = world_rows(MATRIX, args.checkpoint, args.matrix_frames, args.device)
        print(f"\nv0-v4 on the shipped world ({args.matrix_frames} frames, denoise + decode, walk_turn actions)")
        print(f"{'mode':<24} {'FPS':>7} {'median ms':>10} {'KV MiB':>8}  flags")
        for r in rows:
            print(f"{r['mode']:<24} {r['fps']:>7.2f} {r['median_ms']:>10.1f} {r['kv_mib']:>8.2f} "
                  f"{r['flags']}")
        out["matrix"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
