"""Stage 1: simulator episodes (frames + actions) for training.

    python -m scripts.generate_data --out work/data --episodes 256 --frames 256 [--seed 0] [--policy explore] [--corridor 1] [--look brick]

``--policy still+explore`` mixes styles: episode k (level seed - seed) takes style k mod their number.

One safetensors file per episode (``frames`` uint8 [n,H,W,3], ``mouse`` [n,2], ``buttons``
[n,11], ``wall_ahead`` [n]: the nearest wall ahead when each action was chosen, so training can
find the turns made in the open; metadata: level seed). Level seeds are ``seed + i``; held-out
evaluation uses seeds from ``owl_wms.maze.data.HELD_OUT_SEED`` up. ``--workers N`` renders N episodes
at once (the files are those one process writes). Resumable: finished episodes are skipped;
each file is written to a temporary name and renamed, so a stopped run leaves no half file.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from owl_wms.maze.data import (EPISODE_OPTIONS, POLICY_STYLES, episode_options, episode_style, policy_mixture, rollout_episode,
                          wall_ahead)
from owl_wms.maze.simulator import LOOKS, SimConfig
from owl_wms.maze.training import file_stage_clock


def write_episode(level: int, frames: int, cfg: SimConfig, style: str, out: str) -> None:
    """Render one level's episode into ``out``/ep_<level>.safetensors (written whole or not at all)."""
    seen = []
    images, mouse, buttons = rollout_episode(level, frames, config=cfg, style=style,
                                             watch=lambda sim, _: seen.append(wall_ahead(sim)))
    final = Path(out) / f"ep_{level:06d}.safetensors"
    tmp = final.with_suffix(".tmp")
    save_file({"frames": torch.from_numpy(images), "mouse": torch.from_numpy(mouse),
               "buttons": torch.from_numpy(buttons), "wall_ahead": torch.tensor(seen, dtype=torch.float32)},
              str(tmp), metadata={"level_seed": str(level)})
    os.replace(tmp, final)


def write_episode_job(job: tuple) -> None:
    torch.set_num_threads(1)  # each worker is one process of numpy rendering
    write_episode(*job)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="work/data")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--frames", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="first level seed")
    p.add_argument("--size", type=int, default=64, help="frame width = height")
    p.add_argument("--corridor", type=int, default=EPISODE_OPTIONS["corridor"],
                   help="floor width of the maze's corridors in grid units (owl_wms.maze.simulator.SimConfig.corridor)")
    p.add_argument("--look", default=EPISODE_OPTIONS["look"], choices=LOOKS,
                   help="how walls and floor are drawn (owl_wms.maze.simulator.LOOKS): brick texture, or flat shaded "
                        "walls and a one-unit floor checker")
    p.add_argument("--policy", default=EPISODE_OPTIONS["policy"],
                   help=f"mouse style of the exploring policy (owl_wms.maze.data): one of {sorted(POLICY_STYLES)}, or "
                        "several joined by '+' that episodes take in turn (still+explore: even episodes still, odd "
                        "explore, counted from --seed)")
    p.add_argument("--workers", type=int, default=1, help="episodes rendered at once (processes)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers}: must be >= 1")
    try:
        policy_mixture(args.policy)
    except ValueError as exc:
        p.error(f"--policy: {exc}")
    try:
        cfg = SimConfig(width=args.size, height=args.size, corridor=args.corridor, look=args.look)
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "manifest.json"
    before = json.loads(manifest.read_text()) if manifest.is_file() else {}
    if before:  # resuming: never mix episodes of two policies or sizes in one folder
        made = {**before, **episode_options(before)}
        for key, now in (("policy", args.policy), ("size", args.size), ("frames", args.frames),
                         ("corridor", args.corridor), ("look", args.look)):
            if made.get(key) != now:
                raise SystemExit(f"error: {out} holds episodes made with --{key} {made.get(key)}; this run asks "
                                 f"for {now}. Use another --out, or delete {out} to start over")
    todo = [s for s in range(args.seed, args.seed + args.episodes) if not (out / f"ep_{s:06d}.safetensors").exists()]
    stage_time = file_stage_clock(before, args.episodes, len(todo))
    jobs = [(level, args.frames, cfg, episode_style(args.policy, level - args.seed), str(out)) for level in todo]
    bar = tqdm(desc="episodes", unit="ep", initial=args.episodes - len(todo), total=args.episodes)
    if args.workers == 1:
        for job in jobs:
            write_episode(*job)
            bar.update(1)
    else:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            for _ in pool.imap_unordered(write_episode_job, jobs):
                bar.update(1)
    bar.close()
    manifest.write_text(json.dumps({
        "episodes": args.episodes, "frames": args.frames, "size": args.size, "first_seed": args.seed, "policy": args.policy,
        "corridor": args.corridor, "look": args.look, "supersample": cfg.supersample, **stage_time()}, indent=2))
    print(f"{args.episodes} episodes of {args.frames} frames in {out}")


if __name__ == "__main__":
    main()
