"""Per-frame time at tensor-parallel size 1 and 2, the communication share, and TP-vs-single frames.

    python -m scripts.bench_tp [--frames 48] [--warmup 8] [--prod-frames 6] [--exact-frames 16] [--out eval/tp]

Rows, each in its own process(es), measured in one run on the machine named:
  * the shipped world (denoise + rank-0 decode), bf16: TP 1 with all threads, TP 1 with one
    thread, TP 2 under torchrun (one thread per rank, gloo on CPU / NCCL on GPU), with each
    tp_reduce (exact: all-gathers; sum: all-reduce of partial sums);
  * the production-size GameRFT (random weights, window --prod-window), denoise only;
  * frames of the shipped world (its int8 cache) in fp32, TP 2 vs TP 1, each tp_reduce: max abs
    difference on decoded uint8 frames.
Communication = the collectives inside the model plus the per-step envelope broadcast, vote and
lifecycle check, timed on rank 0 by wrapping the live ParallelContext's methods (outside the model).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from inference.causvid_pipeline import CausvidPipeline
from inference.flags import resolve_settings
from owl_wms.config import PRODUCTION, DecoderConfig, ModelConfig, PipelineConfig, WorldConfig
from owl_wms.controls import no_controls
from owl_wms.model import GameRFT
from owl_wms.parallel import ParallelContext
from owl_wms.settings import Settings
from scripts.common import machine, require_at_least, synchronizer

WALK = ([0.0, 0.0], [1] + [0] * 10)


def timed_methods(obj, names, totals: dict):
    """Wrap obj's methods so their wall time accumulates in totals['comm'] (seconds)."""
    for name in names:
        inner = getattr(obj, name)

        def wrapper(*a, _inner=inner, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                totals["comm"] += time.perf_counter() - t0

        setattr(obj, name, wrapper)


def production_pipeline(settings: Settings, window: int, tp) -> CausvidPipeline:
    cfg = ModelConfig.from_mapping(PRODUCTION)
    torch.manual_seed(0)  # every rank builds the same random weights (the start-up digest checks)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = GameRFT(cfg)
    finally:
        torch.set_default_dtype(prev)
    world = WorldConfig(model=cfg, vae_scale=1.0, pipeline=PipelineConfig(window_frames=window),
                        decoder=DecoderConfig(), name="production-size-random")
    pipe = CausvidPipeline(model, None, world, settings, verbose=False, tp=tp)
    if tp is None or tp.is_leader:
        c, s = cfg.channels, cfg.sample_size
        g = torch.Generator().manual_seed(0)
        pipe.prefill(torch.randn(window, c, s, s, generator=g), *no_controls(window))
    return pipe


def worker(args) -> None:
    """One measurement (all ranks run this; rank 0 writes the result)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    tp = ParallelContext.launch(args.tp, "cpu", 120.0, 16, args.reduce) if args.tp > 1 else None
    base = resolve_settings(None, {"OWL_DEVICE": args.device})
    if args.model == "production":
        settings = base.replace(dtype=dtype)
        pipe = production_pipeline(settings, args.prod_window, tp)
        step = lambda: pipe.generate(*WALK)  # noqa: E731
    else:
        ckpt = Path(__file__).resolve().parent.parent / "checkpoints" / "maze-world"
        from owl_wms.config import load_world

        world = load_world(ckpt)
        settings = resolve_settings(world.inference, {"OWL_DEVICE": args.device}).replace(dtype=dtype)
        pipe = CausvidPipeline.from_checkpoint(world, settings=settings, verbose=False, tp=tp)
        step = lambda: pipe.decode(pipe.generate(*WALK))  # noqa: E731
    if tp is not None and not tp.is_leader:
        pipe.tp.follow()
        tp.shutdown()
        return
    totals = {"comm": 0.0}
    if tp is not None:
        timed_methods(tp, ("all_reduce", "all_gather", "exchange", "vote", "check_scalars"), totals)
    sync = synchronizer(args.device)
    for _ in range(args.warmup):
        step()
    frames, times, comm = [], [], []
    for _ in range(args.frames):
        totals["comm"] = 0.0
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
        comm.append(totals["comm"])
        if args.model == "shipped":
            frames.append(out.numpy())
    pipe.close()
    if tp is not None:
        tp.shutdown()
    med = statistics.median(times)
    result = {"median_ms": med * 1000, "fps": len(times) / sum(times), "comm_ms": statistics.median(comm) * 1000,
              "comm_share": sum(comm) / sum(times), "threads_per_rank": torch.get_num_threads(),
              "machine": machine()}
    Path(args.result).write_text(json.dumps(result))
    if frames:
        np.save(args.result.replace(".json", ".npy"), np.stack(frames))


def launch(tp: int, out: Path, name: str, extra: list[str], threads: int | None = None) -> dict:
    result = out / f"{name}.json"
    cmd = ["-m", "scripts.bench_tp", "--worker", "--tp", str(tp), "--result", str(result), *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    if tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWL_")}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return json.loads(result.read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--prod-frames", type=int, default=6)
    p.add_argument("--prod-window", type=int, default=8)
    p.add_argument("--skip-prod", action="store_true")
    p.add_argument("--exact-frames", type=int, default=16, help="fp32 frames compared between TP 2 and TP 1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="eval/tp")
    # worker-only options
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="shipped", choices=["shipped", "production"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reduce", default="exact", choices=["exact", "sum"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    require_at_least(("--frames", args.frames, 1), ("--warmup", args.warmup, 0), ("--prod-frames", args.prod_frames, 1),
                     ("--prod-window", args.prod_window, 1), ("--exact-frames", args.exact_frames, 1))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count()
    shipped = ["--frames", str(args.frames), "--warmup", str(args.warmup), "--device", args.device]
    prod = ["--model", "production", "--frames", str(args.prod_frames), "--warmup", "1",
            "--prod-window", str(args.prod_window), "--device", args.device]
    runs = [("shipped, TP 1, all threads", 1, "ship_tp1", shipped, None),
            ("shipped, TP 1, 1 thread", 1, "ship_tp1_1t", shipped, 1),
            ("shipped, TP 2 exact (1 thread per rank)", 2, "ship_tp2", shipped, None),
            ("shipped, TP 2 sum (1 thread per rank)", 2, "ship_tp2_sum", [*shipped, "--reduce", "sum"], None)]
    if not args.skip_prod:
        runs += [("production-size, TP 1, all threads", 1, "prod_tp1", prod, None),
                 ("production-size, TP 2 exact (1 thread per rank)", 2, "prod_tp2", prod, None),
                 ("production-size, TP 2 sum (1 thread per rank)", 2, "prod_tp2_sum", [*prod, "--reduce", "sum"], None)]
    rows = []
    for label, tp, name, extra, threads in runs:
        print(f"running {label} ...", flush=True)
        rows.append({"config": label, "tp": tp, **launch(tp, out, name, extra, threads)})
    # exactness: fp32 frames, TP 2 vs TP 1
    fp32 = ["--frames", str(args.exact_frames), "--warmup", "0", "--dtype", "fp32", "--device", args.device]
    launch(1, out, "exact_tp1", fp32)
    a = np.load(out / "exact_tp1.npy").astype(int)
    exact = {}
    for reduce in ("exact", "sum"):
        launch(2, out, f"exact_tp2_{reduce}", [*fp32, "--reduce", reduce])
        b = np.load(out / f"exact_tp2_{reduce}.npy").astype(int)
        exact[reduce] = {"max_abs_diff_uint8": int(np.abs(a - b).max()), "values_differing": float((a != b).mean())}
    report = {"command": "python -m scripts.bench_tp " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "machine": rows[0]["machine"], "cpu_count": cores, "rows": rows,
              "fp32_frames": int(a.shape[0]), "fp32_tp2_vs_tp1": exact}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Tensor parallel timings\n", f"`{report['command']}` on {report['machine']} "
             f"({cores} cores), torch {torch.__version__}. Median per frame after warm-up.\n",
             "| config | ms / frame | FPS | comm ms / frame | comm share | threads per rank |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['median_ms']:.1f} | {r['fps']:.2f} | {r['comm_ms']:.1f} | "
                     f"{100 * r['comm_share']:.0f}% | {r['threads_per_rank']} |")
    for reduce, d in exact.items():
        lines.append(f"\nfp32, {a.shape[0]} frames of the shipped world, tp_reduce={reduce}: TP 2 vs TP 1 max |diff| = "
                     f"{d['max_abs_diff_uint8']}/255 ({100 * d['values_differing']:.2f}% of values differ).")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
