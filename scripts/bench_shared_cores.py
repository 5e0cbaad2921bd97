"""The README's headless command alone and beside one busy torch process, side by side.

    python -m scripts.bench_shared_cores [--frames 64] [--json out.json]
    python -m scripts.bench_shared_cores --serve 10 [--json out.json]

Runs ``python -m inference.game_cv --headless`` (i) on a free machine, (ii) while another
process runs torch matmuls on every core, with the default thread budget (threads follow the
free cores, inference/cores.py), and (iii) the same with the threads fixed at the physical cores
by hand (``OWL_THREADS``: the behaviour before the budget). Prints each run's pipeline FPS after
the first frame and the ratio to the free machine's.

``--serve S``: the same three runs of ``python -m inference.serve`` (its frame call compiled in
the background first, then the neighbour started), one websocket player on loopback for S
seconds each (the benchmarks' player in scripts/common.py): the frames a second it received.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from inference.flags import physical_cores
from scripts.common import ServerProcess, headless_fps, machine, round_of, summary

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
    p.add_argument("--serve", type=float, default=None, metavar="S",
                   help="time the server instead, one player for S seconds a run")
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve_rows(args)
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
    report(rows, args.json, {"frames": args.frames})


def serve_rows(args) -> None:
    import asyncio
    import os
    import tempfile

    if not 1 <= args.serve <= 600:
        raise SystemExit(f"error: --serve {args.serve:g}: give 1 to 600 seconds")
    cores = physical_cores()
    print(f"# {machine()}; {cores} physical cores; inference.serve, one player for {args.serve:g} s a run")
    base = {k: v for k, v in os.environ.items() if k not in ("OWL_THREADS", "OMP_NUM_THREADS")}
    rows, logs = [], tempfile.mkdtemp(prefix="owl-bench-shared-")
    for name, env, busy in (("free machine", {}, False), ("busy neighbour, threads follow free cores", {}, True),
                            (f"busy neighbour, OWL_THREADS={cores} (fixed)", {"OWL_THREADS": str(cores)}, True)):
        server = ServerProcess(["--max-sessions", "1"], {**base, **env}, os.path.join(logs, f"{len(rows)}.log"))
        neighbour = None
        try:
            server.wait_ready()
            deadline = time.monotonic() + 1800
            while server.health()["measured_with"] != "compiled":  # every graph in before the neighbour starts
                if time.monotonic() > deadline:
                    raise SystemExit("error: the server's compile did not finish in 30 minutes")
                time.sleep(2)
            if busy:
                neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR.format(seconds=900)])
                time.sleep(3)  # the neighbour is busy and the server has seen it
            asyncio.run(round_of(server.url, 1, 0.5, 1.0))  # the join, unmeasured
            server.wait_empty()
            out = summary(asyncio.run(round_of(server.url, 1, args.serve, 2.0)), args.serve)
            rows.append({"run": name, "fps": out["aggregate_fps"], "threads": server.health()["threads"]})
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
            server.stop()
    report(rows, args.json, {"serve_seconds": args.serve})


def report(rows: list[dict], path: str | None, run: dict) -> None:
    """Each row's rate as a ratio to the first's (the free machine), printed and, with a path, kept."""
    for r in rows:
        r["ratio"] = r["fps"] / rows[0]["fps"]
        threads = f"  (threads at the end: {r['threads']})" if "threads" in r else ""
        print(f"{r['run']:<45} {r['fps']:7.2f} FPS  {r['ratio']:.3f}x{threads}")
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine(), **run, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
