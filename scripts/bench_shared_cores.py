"""The README's headless command alone and beside one busy torch process, side by side.

    python -m scripts.bench_shared_cores [--frames 64] [--json out.json]

Runs ``python -m inference.game_cv --headless`` (i) on a free machine, (ii) while another
process runs torch matmuls on every core, with the default thread budget (threads follow the
free cores, inference/cores.py), and (iii) the same with the threads fixed at the physical cores
by hand (``OWL_THREADS``: the behaviour before the budget). Prints each run's pipeline FPS after
the first frame and the ratio to the free machine's.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from inference.flags import physical_cores
from scripts.common import headless_fps
from scripts.common import machine

NEIGHBOUR = """
import time, torch
a = torch.randn(512, 512)
end = time.time() + {seconds}
while time.time() < end:
    a = torch.tanh(a @ a * 0.01)
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=64, help="frames of each run (at least 2)")
    p.add_argument("--out", default="/tmp/owl_bench_shared_cores.mp4", help="where the rollouts' video goes")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    if args.frames < 2:
        raise SystemExit(f"error: --frames {args.frames}: at least 2 (the rate is taken after the first frame)")
    cores = physical_cores()
    print(f"# {machine()}; {cores} physical cores; {args.frames} frames of the shipped world")
    rows = [{"run": "free machine", "fps": headless_fps(args.frames, args.out, {})}]
    for name, env in (("busy neighbour, threads follow free cores", {}),
                      (f"busy neighbour, OWL_THREADS={cores} (fixed)", {"OWL_THREADS": str(cores)})):
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR.format(seconds=600)])
        try:
            time.sleep(2)  # the neighbour is busy before the game starts
            rows.append({"run": name, "fps": headless_fps(args.frames, args.out, env)})
        finally:
            neighbour.kill()
            neighbour.wait()
    for r in rows:
        r["ratio"] = r["fps"] / rows[0]["fps"]
        print(f"{r['run']:<45} {r['fps']:7.2f} FPS  {r['ratio']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "frames": args.frames, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
