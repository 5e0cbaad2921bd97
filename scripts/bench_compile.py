"""Eager vs ``OWL_COMPILE=1`` on the shipped world, per cache mode, side by side in one run.

    python -m scripts.bench_compile [--frames 32] [--device cpu] [--mode "int8 inplace" ...] [--json out.json]

For each mode: frames per second (denoise + decode) eagerly and compiled, each as a ratio to
the first mode's eager FPS from the same run (bf16 roll unless --mode picks others); the compiled
run's warm-up (loading, the history's prefill and the first 4 frames, where the compiles happen:
seconds and torch.compile graphs; with an empty TORCHINDUCTOR_CACHE_DIR, a first start's cost);
and the graphs made after the warm-up frames (dynamo's ``unique_graphs`` counter): 0 means
decoding does not recompile in steady state.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .common import machine, world_rows

MODES = {
    "bf16 roll": {"OWL_KV_STORAGE": "bf16", "OWL_RING_MODE": "roll"},
    "bf16 inplace": {"OWL_RING_MODE": "inplace"},
    "int8 roll": {"OWL_KV_STORAGE": "int8"},
    "int8 inplace": {"OWL_KV_STORAGE": "int8", "OWL_RING_MODE": "inplace"},
    "fp8_e4m3 inplace": {"OWL_KV_STORAGE": "fp8_e4m3", "OWL_RING_MODE": "inplace"},
    "fp8_e5m2 inplace": {"OWL_KV_STORAGE": "fp8_e5m2", "OWL_RING_MODE": "inplace"},
    "int4 inplace": {"OWL_KV_STORAGE": "int4", "OWL_RING_MODE": "inplace"},
    "fp8 V-only inplace": {"OWL_FP8_KV": "1", "OWL_K_FP8": "0", "OWL_RING_MODE": "inplace"},
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=32, help="measured frames per mode (after 4 warm-up frames)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint", default=None, help="world (default: the shipped one)")
    p.add_argument("--mode", action="append", choices=list(MODES), metavar="MODE",
                   help=f"a cache mode to measure (repeatable; default: all of {', '.join(MODES)})")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.frames < 1:
        raise SystemExit(f"error: --frames {args.frames} measures nothing; use 1 or more")
    modes = {name: MODES[name] for name in (args.mode or MODES)}
    print(f"command: python -m scripts.bench_compile {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"torch {torch.__version__}; machine: {machine()}; device {args.device}")
    rows = [*world_rows(modes, args.checkpoint, args.frames, args.device, compiled=False),
            *world_rows(modes, args.checkpoint, args.frames, args.device, compiled=True)]
    ref_name = next(iter(modes))
    ref = rows[0]["fps"]
    print(f"\n{'mode':<20} {'eager FPS':>10} {'compiled FPS':>13} {'x eager ' + ref_name:>18} "
          f"{'compiled warm-up':>17} {'recompiles':>11} {'KV MiB':>8}")
    for name in modes:
        eager, comp = (next(r for r in rows if r["mode"] == name and r["compiled"] == c) for c in (False, True))
        warm = f"{comp['warmup_s']:.1f} s, {comp['warmup_graphs']} graphs"
        print(f"{name:<20} {eager['fps']:>10.2f} {comp['fps']:>13.2f} {eager['fps'] / ref:>8.2f} / {comp['fps'] / ref:<7.2f} "
              f"{warm:>17} {eager['recompiles']:>4} / {comp['recompiles']:<4} {eager['kv_mib']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
