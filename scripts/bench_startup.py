"""How soon the first frame comes and how soon the compiled frame call takes over, with the
default OWL_COMPILE=auto, from a cold compile cache and then from the warm one it left.

    python -m scripts.bench_startup [--seconds 300] [--threads N] [--max-fps F] [--json out.json]

Each start is a fresh process (as a user's): it loads the shipped world, starts the background
compile as the window does, and makes frames, timing the first one (from the weights being
loaded) and every later one, until every graph is built (the current thread count's, then the
one-thread ones the thread budget may switch to) and 20 more frames are made.
Reported per start: seconds to the first frame, seconds until the compiled call took over and
until every graph was in, the frame rate while it compiled (eager frames beside the compile
process) and with every graph in.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from scripts.common import machine, optional


def child(seconds: float, checkpoint: str | None, max_fps: float | None = None) -> dict:
    import torch

    from inference.cores import CoreBudget
    from inference.flags import resolve_settings, with_threads
    from owl_wms.config import load_world
    from owl_wms.engine import CausvidPipeline
    from owl_wms.loading import SHIPPED_WORLD

    world = load_world(checkpoint or SHIPPED_WORLD)
    settings = with_threads(resolve_settings(world.inference))
    budget = CoreBudget(settings.threads)
    pipe = CausvidPipeline.from_checkpoint(world, settings=settings.replace(compile=False, compile_background=True),
                                           verbose=False)
    loaded = time.perf_counter()
    pipe.runner.compile_in_background((1,), threads=(1,) if budget.adaptive and budget.cores > 1 else (),
                                      log=lambda text: None)
    stamps, compiled_at, all_in_at = [], None, None
    # until 20 frames were made with every graph in (the one-thread graphs compiling in the
    # background take cores from the frames), or the time is up
    while time.perf_counter() - loaded < seconds and len([t for t in stamps if all_in_at and t > all_in_at]) < 21:
        budget.check()
        pipe.decode(pipe.generate(torch.zeros(2), torch.zeros(11)))
        if max_fps and stamps:  # a capped window waits out the rest of each frame's interval
            time.sleep(max(0.0, stamps[-1] + 1 / max_fps - (time.perf_counter() - loaded)))
        stamps.append(time.perf_counter() - loaded)
        if compiled_at is None and pipe.runner.compiled == "whole":
            compiled_at = stamps[-1]
        if all_in_at is None and compiled_at is not None and pipe.runner.background.wait(0):
            all_in_at = stamps[-1]
    during = [t for t in stamps if compiled_at is None or t <= compiled_at]
    after = [t for t in stamps if all_in_at is not None and t > all_in_at]
    return {"first_frame_s": stamps[0], "compiled_after_s": compiled_at, "all_graphs_after_s": all_in_at,
            "fps_while_compiling": (len(during) - 1) / (during[-1] - during[0]) if len(during) > 1 else None,
            "fps_compiled": (len(after) - 1) / (after[-1] - after[0]) if len(after) > 1 else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0,
                   help="longest a start may take to build every graph and make 20 frames with them")
    p.add_argument("--threads", type=int, default=None,
                   help="OWL_THREADS for the starts (default: unset, as a user's: the thread budget decides, and a "
                        "one-thread graph is built too)")
    p.add_argument("--max-fps", type=float, default=None,
                   help="cap the frame rate as the window's --max-fps does (default: as fast as frames come); a "
                        "capped loop leaves the background compile the rest of its core")
    p.add_argument("--checkpoint", default=None, help="another world's checkpoint folder (default: the shipped world)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.seconds, args.checkpoint, args.max_fps)), flush=True)
        os._exit(0)  # the compile of the other thread counts may still run: abandon it, not unwind it
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k not in ("OWL_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        if args.threads is not None:
            env["OWL_THREADS"] = str(args.threads)
        for start in ("cold compile cache", "warm compile cache"):
            cmd = [sys.executable, "-m", "scripts.bench_startup", "--child", "--seconds", str(args.seconds)]
            cmd += ["--max-fps", str(args.max_fps)] if args.max_fps else []
            r = subprocess.run(cmd + (["--checkpoint", args.checkpoint] if args.checkpoint else []),
                               capture_output=True, text=True, env=env)
            if r.returncode:
                raise SystemExit(f"error: the {start} run failed (exit {r.returncode}): {r.stderr[-800:]}")
            rows.append({"start": start, **json.loads(r.stdout.strip().splitlines()[-1])})
    cap = f", at most {args.max_fps:g} FPS" if args.max_fps else ""
    print(f"# {machine()}; {args.checkpoint or 'the shipped world'}, OWL_COMPILE=auto{cap}")
    print(f"{'start':<20} {'first frame s':>14} {'compiled after s':>17} {'all graphs s':>13} {'FPS compiling':>14} "
          f"{'FPS compiled':>13}")
    for r in rows:
        print(f"{r['start']:<20} {r['first_frame_s']:>14.2f} {optional(r['compiled_after_s'], '>17.1f')} "
              f"{optional(r['all_graphs_after_s'], '>13.1f')} {optional(r['fps_while_compiling'], '>14.1f')} "
              f"{optional(r['fps_compiled'], '>13.1f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
