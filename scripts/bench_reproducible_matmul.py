"""What MKL's strict reproducibility mode costs a frame: the README's headless command with the
apps' default (``MKL_CBWR=AUTO,STRICT``: float32 matmuls give the same bits at any thread count)
and with MKL's own default (``MKL_CBWR=AUTO``), in turns, in float32 and bf16.

    python -m scripts.bench_reproducible_matmul [--frames 64] [--rounds 3] [--json out.json]

Prints each mode's median pipeline FPS after the first frame (eager, ``OWL_COMPILE=0``) and the
ratio strict / default per dtype. bf16 matmuls do not go through MKL, so its ratio is the noise.
"""
from __future__ import annotations

import argparse
import json
import statistics

from scripts.common import headless_fps, machine


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=64, help="frames of each run (at least 2)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode, in turns (at least 1)")
    p.add_argument("--out", default="/tmp/owl_bench_reproducible_matmul.mp4", help="where the rollouts' video goes")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if args.frames < 2 or args.rounds < 1:
        raise SystemExit(f"error: --frames {args.frames} (at least 2) or --rounds {args.rounds} (at least 1) too small")
    print(f"# {machine()}; {args.frames} frames of the shipped world, {args.rounds} rounds, eager")
    rows = []
    for dtype in ("fp32", "bf16"):
        fps = {"strict": [], "default": []}
        for _ in range(args.rounds):
            for mode, cbwr in (("strict", "AUTO,STRICT"), ("default", "AUTO")):
                env = {"MKL_CBWR": cbwr, "OWL_DTYPE": dtype, "OWL_COMPILE": "0"}
                fps[mode].append(headless_fps(args.frames, args.out, env))
        row = {"dtype": dtype, **{f"{m}_fps": statistics.median(v) for m, v in fps.items()}, "runs": fps}
        row["ratio"] = row["strict_fps"] / row["default_fps"]
        rows.append(row)
        print(f"{dtype}: strict {row['strict_fps']:.2f} FPS, default {row['default_fps']:.2f} FPS, "
              f"strict / default {row['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "frames": args.frames, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
