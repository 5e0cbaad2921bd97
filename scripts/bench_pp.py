"""End-to-end frames a second and per-frame latency of the synchronous loop (generate, then
decode) against the decoder on a thread beside the generator (owl_wms/engine/decode_stage.py),
with the same total cores, side by side in one process.

    python -m scripts.bench_pp [--frames 48] [--rounds 3] [--threads 2] [--compile 1] [--prod-layers 2] [--json out.json]

Per model (the shipped world; a production-shaped GameRFT, d_model 1536, 24 heads, 64 tokens a
frame, ``--prod-layers`` of its 16 layers, random weights, with a random AutoencoderTiny decoder
of 128 latent channels whose width ``--prod-decoder-width`` sets the decoder's cost), the two
loops take turns, ``--rounds`` times ``--frames`` frames each from the same history; each frame is
a walking step, decoded to uint8 and taken as numpy (what an app shows or writes). Reported:
frames a second over the whole run (first frame to last frame out), the median latency from a
frame's controls to its decoded frame, the decode's share of the synchronous frame, how much of
the decode the overlap hid (1 - (async frame time - generate time) / decode time), and whether
the two loops gave the same frames bit for bit.
Synchronous: torch runs ``--threads`` threads. Asynchronous: the generator ``--threads`` - 1 and
the decoding thread 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from .common import SHIPPED, machine, optional, require_at_least

WALK = ([1.0, 0.0], [1] + [0] * 10)


def production_world(layers: int, width: int):
    """A production-shaped model with random weights and a random decoder of ``width`` channels."""
    from diffusers import AutoencoderTiny

    from owl_wms.config import PRODUCTION, DecoderConfig, ModelConfig, PipelineConfig, WorldConfig
    from owl_wms.model import GameRFT
    from owl_wms.vae import FrameDecoder

    torch.manual_seed(0)
    cfg = ModelConfig.from_mapping({**PRODUCTION, "n_layers": layers})
    world = WorldConfig(model=cfg, vae_scale=1.0, pipeline=PipelineConfig(window_frames=60), decoder=DecoderConfig(),
                        name="production-shaped-random")
    vae = AutoencoderTiny(latent_channels=cfg.channels, encoder_block_out_channels=(8, 8, 8, 8),
                          decoder_block_out_channels=(width,) * 4)
    return world, GameRFT(cfg).eval(), FrameDecoder(vae.eval(), cfg.channels)


def shipped_world():
    from owl_wms.config import load_world
    from owl_wms.engine.build import load_parts

    world, model, decoder, _ = load_parts(load_world(SHIPPED))
    return world, model, decoder


LOOPS = {  # name -> (generator threads, decoding thread's threads or None: decoded in line), of --threads T
    "synchronous, T threads": lambda t: (t, None),
    "synchronous, 1 thread": lambda t: (1, None),
    "asynchronous decode, T-1 + 1 threads": lambda t: (max(1, t - 1), 1),
    "asynchronous decode, T + 1 threads": lambda t: (t, 1),
    "two stages: rank 1 generates (T-1), rank 0 decodes (1)": lambda t: (max(1, t - 1), 1),  # rank 1 generates, rank 0 decodes
}
TWO_STAGES = "two stages: rank 1 generates (T-1), rank 0 decodes (1)"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(model_name: str, args):
    """(world, model, decoder) of --child-model."""
    return shipped_world() if model_name == "shipped" else production_world(args.prod_layers, args.prod_decoder_width)


def child(args) -> None:
    """One loop on one model in this process: a line "run" on stdin makes --frames frames from
    the history and prints a JSON line of timings; the parent starts one child per loop and
    has them take turns, so each keeps its own thread setup for the whole run."""
    import hashlib

    from owl_wms.controls import no_controls
    from owl_wms.engine import CausvidPipeline
    from owl_wms.engine.decode_stage import DecodeStage
    from owl_wms.settings import Settings

    gen_threads, dec_threads = LOOPS[args.child_loop](args.threads)
    ctx = None
    if args.child_loop == TWO_STAGES:  # rank 0 (this process, answering the parent) decodes; rank 1 generates
        import datetime

        import torch.distributed as dist

        from owl_wms.parallel import ParallelContext

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.child_port}", rank=args.child_rank,
                                world_size=2, timeout=datetime.timedelta(hours=1))
        ctx = ParallelContext(args.child_rank, 2, timeout_s=3600, check_every=16)
        gen_threads = gen_threads if args.child_rank == 1 else dec_threads
    torch.set_num_threads(gen_threads)
    world, model, decoder = load(args.child_model, args)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    settings = Settings.from_config(world.inference).replace(device="cpu", dtype=dtype, compile=bool(args.compile),
                                                             compile_background=False, threads=gen_threads)
    pipe = CausvidPipeline(model, decoder, world, settings, verbose=False, pp=ctx)
    if ctx is not None and ctx.rank == 1:
        pipe.stages.follow()
        dist.destroy_process_group()
        return
    g = torch.Generator().manual_seed(0)
    cfg, window = world.model, world.pipeline.window_frames
    history = (torch.randn(window, cfg.channels, cfg.sample_size, cfg.sample_size, generator=g), *no_controls(window))
    # what an app shows or writes, and when it was ready (a window's UI thread shows it then)
    show = lambda latent: (pipe.decode(latent).numpy(), time.perf_counter())  # noqa: E731
    stage = DecodeStage(show, threads=dec_threads) if dec_threads else None
    stages = pipe.stages
    print(json.dumps({"ready": True}), flush=True)
    for line in iter(sys.stdin.readline, ""):
        frames = int(line.split()[1])
        pipe.hard_cut(*history)
        digest, latency, gen, dec, asked = hashlib.sha256(), [], [], [], {}

        def out(tag, shown):
            frame, ready_at = shown
            latency.append(ready_at - asked[tag])
            digest.update(frame.tobytes())

        start = time.perf_counter()
        for i in range(frames):
            t0 = asked[i] = time.perf_counter()
            if stages is not None:  # sent to rank 1; the frames that came back go to the decoding thread
                for tag, latent in stages.request(*WALK, tag=i):
                    stage.submit(latent, tag=tag)
                gen.append(time.perf_counter() - t0)
                for tag, frame in stage.ready():
                    out(tag, frame)
                continue
            latent = pipe.generate(*WALK)
            t1 = time.perf_counter()
            gen.append(t1 - t0)
            if stage is None:
                out(i, show(latent))
                dec.append(time.perf_counter() - t1)
                continue
            stage.submit(latent, tag=i)
            for tag, frame in stage.ready():
                out(tag, frame)
        for tag, latent in stages.drain() if stages is not None else ():
            stage.submit(latent, tag=tag)
        for tag, frame in stage.drain() if stage is not None else ():
            out(tag, frame)
        print(json.dumps({"seconds": time.perf_counter() - start, "latency": latency, "generate": gen,
                          "decode": dec, "digest": digest.hexdigest()}), flush=True)
    if stage is not None:
        stage.close()
    pipe.close()  # two stages: rank 1 stops
    if ctx is not None:
        dist.destroy_process_group()


def bench_model(model_name: str, args) -> dict:
    label = "the shipped world" if model_name == "shipped" else \
        f"production-shaped, {args.prod_layers} of 16 layers, decoder width {args.prod_decoder_width}"
    print(f"\n{label}: starting one process per loop (each compiles) ...", flush=True)
    children, followers = {}, []
    for name in LOOPS:
        cmd = [sys.executable, "-m", "scripts.bench_pp", "--child-model", model_name, "--child-loop", name,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("threads", "compile", "dtype", "prod_layers", "prod_decoder_width"))]
        env = {**os.environ, "OMP_NUM_THREADS": str(LOOPS[name](args.threads)[0])}
        if name == TWO_STAGES:
            cmd += ["--child-port", str(free_port())]
            followers.append(subprocess.Popen(cmd + ["--child-rank", "1"], stdin=subprocess.DEVNULL, env=env))
            cmd += ["--child-rank", "0"]
        children[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    runs = {name: [] for name in LOOPS}
    try:
        for name, proc in children.items():
            if not json.loads(proc.stdout.readline() or "{}").get("ready"):
                raise SystemExit(f"error: the {name!r} process failed to start (its error is above)")
        for r in range(args.warmup_rounds + args.rounds):  # the loops take turns, round by round
            for name, proc in children.items():
                proc.stdin.write(f"run {args.frames}\n")
                proc.stdin.flush()
                result = json.loads(proc.stdout.readline() or "null")
                if result is None:
                    raise SystemExit(f"error: the {name!r} process stopped (its error is above)")
                if r >= args.warmup_rounds:
                    runs[name].append(result)
    finally:
        for proc in children.values():
            proc.stdin.close()
            proc.wait(timeout=60)
        for proc in followers:
            proc.wait(timeout=60)
    digests = {name: {r["digest"] for r in rs} for name, rs in runs.items()}
    same = len(set().union(*digests.values())) == 1
    rows = []
    for name, rs in runs.items():
        fps = statistics.median(args.frames / r["seconds"] for r in rs)
        decode = [t for r in rs for t in r["decode"]]
        gen_threads, dec_threads = LOOPS[name](args.threads)
        rows.append({"model": label, "loop": name.replace("T-1", str(args.threads - 1)).replace("T", str(args.threads)),
                     "generator_threads": gen_threads, "decode_threads": dec_threads, "fps": fps,
                     "frame_ms": 1000 / fps,
                     "generate_ms": 1000 * statistics.median(t for r in rs for t in r["generate"]),
                     "decode_ms": 1000 * statistics.median(decode) if decode else None,
                     "latency_ms": 1000 * statistics.median(t for r in rs for t in r["latency"])})
    sync_default, sync_best = rows[0], max(rows[:2], key=lambda r: r["fps"])
    for r in rows:
        r["x_sync_default"] = r["fps"] / sync_default["fps"]
        r["x_sync_best"] = r["fps"] / sync_best["fps"]
        if r["decode_ms"] is not None:
            r["decode_share"] = r["decode_ms"] / r["frame_ms"]
    for r, name in zip(rows, runs):
        if name == TWO_STAGES:
            r["generate_ms"] = None  # rank 0 only waits; rank 1's time is not seen from here
        if r["decode_ms"] is not None:
            continue
        # the decode work the overlap hid: what a frame took beyond generating (the synchronous
        # loop's generate time at this generator's thread count), against the best synchronous decode
        same = [q for q in rows[:2] if q["generator_threads"] == r["generator_threads"]]
        generate_ms = same[0]["generate_ms"] if same else r["generate_ms"]
        r["decode_hidden"] = 1 - max(0.0, r["frame_ms"] - generate_ms) / sync_best["decode_ms"]
    print(f"{'loop':<44} {'FPS':>7} {'frame ms':>9} {'generate ms':>12} {'decode ms':>10} {'latency ms':>11} "
          f"{'decode share':>13} {'x sync':>7} {'x best sync':>12} {'decode hidden':>14}")
    for r in rows:
        print(f"{r['loop']:<44} {r['fps']:>7.1f} {r['frame_ms']:>9.2f} {optional(r['generate_ms'], '>12.2f')} "
              f"{optional(r['decode_ms'], '>10.2f')} {r['latency_ms']:>11.2f} "
              f"{optional(r.get('decode_share') and 100 * r['decode_share'], '>12.0f')}{'%' if 'decode_share' in r else ' '} "
              f"{r['x_sync_default']:>7.2f} {r['x_sync_best']:>12.2f} "
              f"{optional(r.get('decode_hidden') and 100 * r['decode_hidden'], '>13.0f')}{'%' if 'decode_hidden' in r else ' '}")
    print(f"every loop gave the same frames bit for bit: {'yes' if same else 'NO'}")
    return {"label": label, "rows": rows, "same_frames": same}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=48, help="frames per loop and round")
    p.add_argument("--rounds", type=int, default=3, help="turns each loop takes")
    p.add_argument("--threads", type=int, default=2, help="total CPU threads (the async loop: threads - 1 + 1)")
    p.add_argument("--compile", type=int, choices=(0, 1), default=1, help="compile the frame call and the decoder")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--prod-layers", type=int, default=2, help="layers of the production-shaped model (0: skip it)")
    p.add_argument("--prod-decoder-width", type=int, default=160,
                   help="channels of its random decoder's blocks (160: about a third of the synchronous frame here)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and not counted")
    p.add_argument("--json", default=None)
    p.add_argument("--child-model", choices=("shipped", "production"), help=argparse.SUPPRESS)
    p.add_argument("--child-loop", choices=tuple(LOOPS), help=argparse.SUPPRESS)
    p.add_argument("--child-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_loop:
        return child(args)
    require_at_least(("--frames", args.frames, 2), ("--rounds", args.rounds, 1), ("--threads", args.threads, 2),
                     ("--prod-layers", args.prod_layers, 0), ("--prod-decoder-width", args.prod_decoder_width, 1))
    if args.prod_layers > 16:
        raise SystemExit(f"error: --prod-layers {args.prod_layers}: the production model has 16 layers")
    torch.set_num_threads(args.threads)
    print(f"# {machine()}; {args.dtype}, compile={args.compile}, {args.frames} frames x {args.rounds} rounds per loop")
    report = {"machine": machine(), "args": vars(args), "models": [bench_model("shipped", args)]}
    if args.prod_layers:
        report["models"].append(bench_model("production", args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
