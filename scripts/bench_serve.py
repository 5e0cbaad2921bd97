"""What players of ``python -m inference.serve`` feel, batched against the same sessions stepped
one by one, in one run on the shipped world.

    python -m scripts.bench_serve [--players 1 2 4 8] [--seconds 10] [--rounds 2] [--compile auto|0] [--decode-thread]
                                  [--two-stages] [--guidance G] [--json out.json]

The batched server runs first, then one started with ``--one-by-one`` (each session its own
model calls, one after another), and with ``--decode-thread`` a batched one with
``OWL_DECODE=async`` (each step's frames decoded and encoded on a thread beside the model's), the
same players against each; with ``--two-stages`` a batched one under torchrun with ``--pp 2``
(rank 0 serves and decodes while rank 1 makes the next step, a thread each). In a round N websocket players
on loopback play for --seconds (after a warm-up counted from the last one's first frame): each sends
controls 20 times a second (a new seq each) and reads every frame.
Reported per players and server: aggregate frames a second, each player's frames a second and
frame interval p50/p95, and key-to-frame latency p50/p95: from sending a controls message to
the first frame that used it (its header's seq), measured at the player. With ``--compile
auto`` (the servers' default) the rounds start once both servers' frame calls are compiled (and
their step times measured again).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

from owl_wms.config import guidance_problem
from scripts.common import SEND_HZ, ServerProcess, machine, round_of, summary


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--players", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds a round (after --warmup)")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2, help="measured rounds of each players count on each server")
    p.add_argument("--compile", choices=["auto", "0"], default="auto", help="the servers' OWL_COMPILE")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--guidance", type=float, default=None, help="every server's --guidance (control guidance)")
    p.add_argument("--decode-thread", action="store_true",
                   help="also a batched server with OWL_DECODE=async (frames decode beside the model thread)")
    p.add_argument("--two-stages", action="store_true",
                   help="also a batched server with --pp 2 under torchrun: rank 0 serves and decodes, rank 1 makes "
                        "the frames, one thread each (the same cores); needs --compile 0 (rank 0 cannot see rank 1's "
                        "compile)")
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=None, help="folder for the servers' output (default: a temporary one, printed)")
    args = p.parse_args(argv)
    if min(args.players) < 1 or args.seconds <= 0 or args.rounds < 1:
        p.error("--players, --seconds and --rounds must be positive")
    if args.guidance is not None and (problem := guidance_problem(args.guidance)):
        p.error(f"--guidance {args.guidance:g}: {problem}")
    if args.two_stages and args.compile != "0":
        p.error("--two-stages needs --compile 0: rank 0's /healthz cannot say when rank 1's frame call has compiled")
    env = {**os.environ, "OWL_COMPILE": args.compile}
    common = ["--max-sessions", str(max(args.players)), "--idle-timeout", "3600"]
    common += ["--checkpoint", args.checkpoint] if args.checkpoint else []
    common += ["--guidance", str(args.guidance)] if args.guidance is not None else []
    logs = args.logs or tempfile.mkdtemp(prefix="bench-serve-")
    os.makedirs(logs, exist_ok=True)
    servers = [("batched", [], {}), ("one_by_one", ["--one-by-one"], {})]
    servers += [("batched_decode_thread", [], {"OWL_DECODE": "async"})] if args.decode_thread else []
    # torchrun gives each rank OMP_NUM_THREADS=1: one core to serve and decode, one to generate
    servers += [("two_stages", ["--pp", "2"], {"OWL_THREADS": "1"})] if args.two_stages else []
    runs = {(n, mode): [] for n in args.players for mode, _, _ in servers}
    # One server at a time: two servers' thread pools on the same cores measured stalls of seconds.
    for mode, flags, flag_env in servers:
        server = ServerProcess(common + flags, {**env, **flag_env}, os.path.join(logs, f"{mode}.log"),
                               TORCHRUN if mode == "two_stages" else None)
        try:
            server.wait_ready()
            if args.compile == "auto":  # the frame call compiles in the background: measure what follows
                deadline = time.monotonic() + 1800
                while server.health()["measured_with"] != "compiled":
                    if time.monotonic() > deadline:
                        raise SystemExit("error: the server's compile did not finish in 30 minutes")
                    time.sleep(2)
            for n in args.players:  # joins and each batch size's first calls, unmeasured
                server.wait_empty()
                asyncio.run(round_of(server.url, n, 0.5, 1.0))
            for r in range(args.rounds):
                for n in args.players:
                    server.wait_empty()
                    results = asyncio.run(round_of(server.url, n, args.seconds, args.warmup))
                    if not all(x["arrivals"] for x in results):
                        print(f"warning: a player got no frames in round {r + 1}, {n} players; the {mode} server's "
                              f"output: {server.log}", flush=True)
                    out = {**summary(results, args.seconds), "threads": server.health()["threads"]}
                    runs[(n, mode)].append(out)
                    print(f"round {r + 1} players {n} {mode}: " + " ".join(f"{k} {v:.1f}" for k, v in out.items()),
                          flush=True)
        finally:
            server.stop()
    rows = []
    for (n, mode), outs in runs.items():
        row = {"players": n, "server": mode, **{k: float(np.median([o[k] for o in outs])) for k in outs[0]}}
        one = np.median([o["aggregate_fps"] for o in runs[(args.players[0], mode)]])
        row["x_one_player"] = row["aggregate_fps"] / one if args.players[0] == 1 and one > 0 else None
        row["latency_p95_intervals"] = row["latency_ms_p95"] / row["interval_ms_p50"]
        rows.append(row)
    print(f"\nthe servers' output: {logs}")
    guided = f"; --guidance {args.guidance:g}" if args.guidance is not None else ""
    print(f"\n{machine()}; OWL_COMPILE={args.compile}{guided}; {args.seconds:g} s x {args.rounds} rounds (medians)")
    print("| players | server | aggregate FPS | x one player | each player FPS (min) | interval ms p50 / p95 "
          "| key-to-frame ms p50 / p95 | p95 in intervals |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["players"], r["server"])):
        x = f"{row['x_one_player']:.2f}" if row["x_one_player"] is not None else "-"
        print(f"| {row['players']} | {row['server'].replace('_', ' ')} | {row['aggregate_fps']:.1f} | {x} "
              f"| {row['player_fps_min']:.1f} | {row['interval_ms_p50']:.0f} / {row['interval_ms_p95']:.0f} "
              f"| {row['latency_ms_p50']:.0f} / {row['latency_ms_p95']:.0f} | {row['latency_p95_intervals']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "compile": args.compile, "guidance": args.guidance, "seconds": args.seconds,
                       "rounds": args.rounds, "send_hz": SEND_HZ, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
