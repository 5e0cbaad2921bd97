"""Frames per second of the streaming pipeline.

    python -m scripts.bench_pipeline [--frames 32] [--prod-window 8] [--device cpu] [--skip-prod] [--checkpoint C ...]
                                     [--compare-backends]

Rows measured in one run: the shipped default world (or each ``--checkpoint``; denoise + decode), and the
production-size GameRFT (16 layers, d_model 1536, 24 heads, 64 tokens/frame, random
weights, bf16) with a reduced window (denoise only: no production decoder ships here).
Then each one's prefill (a window of history in one model call), with SDPA in query chunks
(the default) and as one masked call per layer, alternating. ``--compare-backends`` adds each
world's frame with SDPA and with FlexAttention (eager unless ``--compile``), alternating frame by
frame, and FlexAttention's median time over SDPA's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from inference.causvid_pipeline import CausvidPipeline
from owl_wms import attention
from owl_wms.attention import query_chunk_tokens
from owl_wms.config import PRODUCTION, DecoderConfig, ModelConfig, PipelineConfig, WorldConfig
from owl_wms.controls import no_controls
from owl_wms.model import GameRFT
from owl_wms.settings import Settings
from scripts.common import machine, synchronizer


def timed(fn, frames: int, warmup: int, sync) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(frames):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def row(name: str, times: list[float], **extra) -> dict:
    med = statistics.median(times)
    r = {"config": name, "fps": len(times) / sum(times), "median_ms": med * 1000,
         "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))] * 1000, **extra}
    print(f"  measured {name}: {r['fps']:.2f} FPS, median {r['median_ms']:.1f} ms", flush=True)  # a cut-short run keeps it
    return r


def alternating(calls: dict, rounds: int, warmup: int, sync) -> dict[str, list[float]]:
    """Each call's times over ``rounds`` rounds that run every call once, in turn (after
    ``warmup`` such rounds), so a machine's drift falls on all of them alike."""
    times = {label: [] for label in calls}
    for i in range(warmup + rounds):
        for label, call in calls.items():
            t0 = time.perf_counter()
            call()
            sync()
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
    return times


def prefill_rows(name: str, prefill, rounds: int, sync) -> list[dict]:
    """Prefill time with SDPA in query chunks and as one masked call, alternating (after one
    warm-up call of each), and the second's median ratio to the first."""
    def with_chunks(tokens):
        def call():
            with query_chunk_tokens(tokens):
                prefill()
        return call

    times = alternating({"query chunks": with_chunks(attention.QUERY_CHUNK_TOKENS),
                         "one masked call": with_chunks(0)}, rounds, 1, sync)
    ratio = statistics.median(b / a for a, b in zip(times["query chunks"], times["one masked call"]))
    return [row(f"{name} prefill, {label}", t, **({"one_call_over_chunks": ratio} if label != "query chunks" else {}))
            for label, t in times.items()]


def backend_rows(name: str, build, walk, frames: int, warmup: int, sync) -> list[dict]:
    """A frame's time with SDPA and with FlexAttention, alternating frame by frame (after
    ``warmup`` frames of each), and the second's median over the first's."""
    pipes = {backend: build(backend) for backend in ("sdpa", "flex")}
    times = alternating({backend: (lambda pipe=pipe: pipe.generate(*walk)) for backend, pipe in pipes.items()},
                        frames, warmup, sync)
    ratio = statistics.median(times["flex"]) / statistics.median(times["sdpa"])
    return [row(f"{name} denoise only, {backend} (alternating)", t, **({"flex_over_sdpa": ratio} if backend == "flex"
                                                                         else {}))
            for backend, t in times.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prod-window", type=int, default=8, help="window (frames) of the production-size run")
    p.add_argument("--prod-frames", type=int, default=8)
    p.add_argument("--prefill-rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="sdpa", choices=["sdpa", "flex"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compare-backends", action="store_true",
                   help="also time each world's frame with SDPA and FlexAttention, alternating")
    p.add_argument("--skip-prod", action="store_true")
    p.add_argument("--checkpoint", action="append", default=None,
                   help="a world checkpoint folder to measure (repeat to compare worlds in one run; default: the shipped one)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)

    print(f"command: {' '.join([sys.executable.split('/')[-1], '-m', 'scripts.bench_pipeline', *(sys.argv[1:] if argv is None else argv)])}")
    print(f"torch {torch.__version__}; machine: {machine()}")
    settings = Settings(device=args.device, dtype=torch.bfloat16, attn_backend=args.backend,
                        attn_backend_decode=args.backend, compile=args.compile)
    sync = synchronizer(args.device)
    rows = []

    walk = ([0.0, 0.0], [1] + [0] * 10)
    for checkpoint in args.checkpoint or [None]:
        pipe = CausvidPipeline.from_checkpoint(checkpoint, settings=settings, verbose=False)
        name = f"{checkpoint or 'default'} ({pipe.world.name}, d_model {pipe.world.model.d_model}, window {pipe.window})"
        rows.append(row(f"{name} denoise+decode", timed(lambda: pipe(*walk), args.frames, args.warmup, sync)))
        rows.append(row(f"{name} denoise only", timed(lambda: pipe.generate(*walk), args.frames, args.warmup, sync)))
        rows += prefill_rows(name, lambda: pipe.load_clip(0), args.prefill_rounds, sync)
        if args.compare_backends:
            rows += backend_rows(name, lambda backend: CausvidPipeline.from_checkpoint(
                checkpoint, settings=settings.replace(attn_backend=backend, attn_backend_decode=backend), verbose=False),
                walk, args.frames, args.warmup, sync)

    if not args.skip_prod:
        cfg = ModelConfig.from_mapping(PRODUCTION)
        with torch.device(args.device):
            torch.manual_seed(0)
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = GameRFT(cfg)
            finally:
                torch.set_default_dtype(prev)
        params = sum(p.numel() for p in model.parameters())
        world = WorldConfig(model=cfg, vae_scale=1.0, pipeline=PipelineConfig(window_frames=args.prod_window),
                            decoder=DecoderConfig(), name="production-size-random")
        prod = CausvidPipeline(model, None, world, settings, verbose=False)
        c, s = cfg.channels, cfg.sample_size
        w = args.prod_window
        history = (torch.randn(w, c, s, s), *no_controls(w))
        prod.prefill(*history)
        rows.append(row(f"production-size ({params / 1e6:.0f}M params, window {w}) denoise only",
                        timed(lambda: prod.generate(*walk), args.prod_frames, 1, sync)))
        rows += prefill_rows(f"production-size (window {w})", lambda: prod.prefill(*history), args.prefill_rounds,
                             sync)

    print(f"\n{'config':<100} {'FPS':>8} {'median ms':>10} {'p95 ms':>8}")
    for r in rows:
        ratio = f"  (one call / chunks: {r['one_call_over_chunks']:.2f}x)" if "one_call_over_chunks" in r else ""
        ratio += f"  (FlexAttention / SDPA: {r['flex_over_sdpa']:.2f}x)" if "flex_over_sdpa" in r else ""
        print(f"{r['config']:<100} {r['fps']:>8.2f} {r['median_ms']:>10.1f} {r['p95_ms']:>8.1f}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
