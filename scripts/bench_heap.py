"""Batched steps with the heap the apps keep (inference/heap.py) beside glibc's default heap.

    python -m scripts.bench_heap [--sessions 1 4 8] [--steps 30] [--rounds 2] [--compile 1|0] [--json out.json]

Each heap and session count runs in a fresh process of its own (the heap's thresholds are the
process's, and what it allocated before decides when glibc unmaps), the two heaps taking turns
``--rounds`` times: the shipped world, B sessions in one batched call, compiled whole (``--compile 0``: eager), bf16, int8 in-place, denoise only. Reported per process: ms per step
(median), and the minor page faults a step took (mean): the pages glibc unmapped when a step
freed its large temporaries and the next step faulted in again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from scripts.common import HEAP_KEPT, machine, minor_faults, path_settings, require_at_least

# In the environment, any glibc.malloc tunable makes inference/heap.py stand aside (this one
# changes nothing else): glibc's default heap.
GLIBC_DEFAULT = {"GLIBC_TUNABLES": "glibc.malloc.check=0"}


def child(sessions: int, steps: int, compile_flag: str) -> dict:
    import torch

    from owl_wms.controls import no_controls
    from owl_wms.engine.build import load_parts
    from owl_wms.engine.sessions import Sessions
    from owl_wms.settings import without_kv

    world, model, _, _ = load_parts(decoder=False)  # the shipped world
    cfg, window = model.config, world.pipeline.window_frames
    g = torch.Generator().manual_seed(0)
    history = (torch.randn(window, cfg.channels, cfg.sample_size, cfg.sample_size, generator=g),
               *no_controls(window))
    flags = {"OWL_KV_STORAGE": "int8", "OWL_RING_MODE": "inplace", "OWL_COMPILE": compile_flag, "OWL_DEVICE": "cpu"}
    settings = path_settings(without_kv(world.inference), flags).replace(dtype=torch.bfloat16)
    batch = Sessions(model, None, world, settings, capacity=sessions, verbose=False)
    pipes = [batch.open(seed=i, clip=None) for i in range(sessions)]
    for pipe in pipes:
        pipe.prefill(*history)
    controls = {pipe: ([1.0, 0.0], [1] + [0] * 10) for pipe in pipes}
    for _ in range(4):  # warm-up (compiles)
        batch.step(controls)
    times, faults = [], []
    for _ in range(steps):
        f0, t0 = minor_faults(), time.perf_counter()
        batch.step(controls)
        times.append(time.perf_counter() - t0)
        faults.append(minor_faults() - f0)
    return {"heap": "kept" if HEAP_KEPT else "glibc default", "sessions": sessions,
            "step_ms": 1000 * statistics.median(times), "page_faults_per_step": statistics.mean(faults)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compile", choices=["1", "0"], default="1", help="the frame call compiled whole, or eager")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    require_at_least(*(("--sessions", n, 1) for n in args.sessions), ("--steps", args.steps, 1),
                     ("--rounds", args.rounds, 1))
    if args.child:
        print(json.dumps(child(args.sessions[0], args.steps, args.compile)))
        return
    command = "python -m scripts.bench_heap " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command.rstrip()}\nmachine: {machine()}", flush=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    rows = []
    for r in range(args.rounds):
        for n, env in ((n, env) for n in args.sessions for env in ({}, GLIBC_DEFAULT)):
            out = subprocess.run([sys.executable, "-m", "scripts.bench_heap", "--child", "--sessions", str(n),
                                  "--steps", str(args.steps), "--compile", args.compile], env={**base, **env},
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"error: the {'glibc default' if env else 'kept'} heap's process failed:\n"
                                 f"{out.stderr[-2000:]}")
            row = dict(json.loads(out.stdout.strip().splitlines()[-1]), round=r + 1)
            rows.append(row)
            print(f"round {row['round']}: {row['heap']:>13} heap, {row['sessions']} sessions: "
                  f"{row['step_ms']:.2f} ms a step, {row['page_faults_per_step']:.0f} page faults a step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
