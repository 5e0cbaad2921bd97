"""A world's own next-frame latents beside the simulator's frames, for a decoder fine-tune.

    python -m scripts.world_latents --checkpoint checkpoints/maze-world --policy still+explore \\
        --levels 48 --out work/world_latents
    python -m scripts.train_vae --init checkpoints/maze-world/vae --decoder-only \\
        --world-latents work/world_latents ...

The autoencoder's decoder is trained on the encoder's latents, but in play it decodes what the
world predicts: latents from another distribution, blurrier and off in ways that repeat. Here
the world plays training levels (level seeds from --first-seed, never the held-out ones) from
their real history, teacher-forced as ``eval_world`` scores it: each next frame is predicted
from the simulator's frames so far, with the checkpoint's own pipeline settings. Every
prediction's latent, as the decoder receives it, is kept with the simulator's frame it should
show, so ``train_vae --world-latents`` can teach the decoder to show it.

One file per level, ep_<seed>.safetensors (``latents`` float32 [n, c, h, w], ``frames`` uint8
[n, H, W, 3]), each written whole or not at all; a rerun makes only the missing ones, and
Ctrl-C stops between levels.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from inference.causvid_pipeline import DEFAULT_CHECKPOINT, CausvidPipeline
from inference.flags import resolve_settings, with_threads
from owl_wms.config import ConfigError, load_world
from owl_wms.maze.data import HELD_OUT_SEED, episode_style, policy_mixture
from owl_wms.maze.evaluation import Episode, teacher_forced
from owl_wms.maze.training import file_stage_clock

OPTIONS = ("checkpoint", "policy", "first_seed", "frames", "start")  # a folder holds one run's levels only


def write_level(pipe, seed: int, style: str, frames: int, start: int | None, out: Path) -> float:
    """Write one level's predicted latents and real frames; returns their mean teacher-forced PSNR."""
    ep = Episode(pipe, seed, frames, style, start)
    latents = []
    scores = teacher_forced(pipe, ep, frames, latents=latents)
    real = np.stack([ep.future(k)[0] for k in range(frames)])
    final = out / f"ep_{seed:06d}.safetensors"
    tmp = final.with_suffix(".tmp")
    save_file({"latents": torch.cat([pipe.decoder_latent(z) for z in latents]).contiguous(),
               "frames": torch.from_numpy(real).contiguous()}, str(tmp),
              metadata={"level_seed": str(seed), "style": style})
    os.replace(tmp, final)
    return float(np.mean([s[0] for s in scores]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    p.add_argument("--policy", default="still+explore",
                   help="the policy of the world's training episodes (generate_data --policy): level i plays its style i")
    p.add_argument("--levels", type=int, default=48)
    p.add_argument("--first-seed", type=int, default=0, help="first level seed (training levels: below "
                                                               f"{HELD_OUT_SEED})")
    p.add_argument("--frames", type=int, default=192, help="predicted frames per level")
    p.add_argument("--start", type=int, default=None,
                   help="the level frame the predictions start at (default: the world's window)")
    p.add_argument("--out", default="work/world_latents")
    args = p.parse_args(argv)
    try:
        policy_mixture(args.policy)
    except ValueError as exc:
        p.error(f"--policy: {exc}")
    if args.levels < 1 or args.frames < 1:
        p.error(f"--levels {args.levels} and --frames {args.frames} must be >= 1")
    if args.first_seed < 0 or args.first_seed + args.levels > HELD_OUT_SEED:
        p.error(f"--first-seed {args.first_seed} with --levels {args.levels} reaches the held-out levels "
                f"(seeds from {HELD_OUT_SEED}), which score the world; use training levels below them")
    try:
        world = load_world(args.checkpoint)
    except ConfigError as exc:
        raise SystemExit(f"error: --checkpoint: {exc}") from None
    pipe = CausvidPipeline.from_checkpoint(world, clip=None, settings=with_threads(resolve_settings(world.inference)))
    pipe.verbose = False
    if args.start is not None and args.start < pipe.window:
        p.error(f"--start {args.start}: must be at least the world's window, {pipe.window} frames")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "manifest.json"
    before = json.loads(manifest.read_text()) if manifest.is_file() else {}
    asked = {"checkpoint": str(Path(args.checkpoint).resolve()), "policy": args.policy, "first_seed": args.first_seed,
             "frames": args.frames, "start": args.start}
    clash = [k for k in OPTIONS if before and before.get(k) != asked[k]]
    if clash:
        raise SystemExit(f"error: {out} holds levels made with {', '.join(f'{k} {before.get(k)}' for k in clash)}; "
                         f"this run asks for {', '.join(f'{k} {asked[k]}' for k in clash)}. Use another --out, or "
                         f"delete {out} to start over")
    seeds = range(args.first_seed, args.first_seed + args.levels)
    todo = [s for s in seeds if not (out / f"ep_{s:06d}.safetensors").exists()]
    stage_time = file_stage_clock(before, args.levels, len(todo))
    psnr = dict(before.get("teacher_forced_psnr", {}))
    try:
        for seed in tqdm(todo, desc="levels", unit="level"):
            psnr[str(seed)] = write_level(pipe, seed, episode_style(args.policy, seed - args.first_seed),
                                          args.frames, args.start, out)
    except KeyboardInterrupt:  # the levels written so far are whole; the manifest says which
        print(f"stopped: {len(psnr)} of {args.levels} levels in {out}; run the same command again to go on")
        raise SystemExit(130) from None
    finally:
        manifest.write_text(json.dumps({**asked, "levels": args.levels, "window": pipe.window,
                                        "teacher_forced_psnr": psnr, **stage_time()}, indent=2))
    print(f"{args.levels} levels of {args.frames} predicted frames in {out} "
          f"(teacher-forced PSNR {np.mean(list(psnr.values())):.2f} dB)")


if __name__ == "__main__":
    main()
