"""Fidelity of a world model on held-out simulator levels (JSON + PNG curve).

    python -m scripts.eval_world [--checkpoint checkpoints/<world>] [--episodes 8] [--out eval/]

Writes eval.json, psnr_curve.png, rollouts.png (the first --sheet-episodes levels, every
--sheet-every frames: the simulator's frames, the model's teacher-forced predictions from the
real frames so far, and its autoregressive rollout, one row each) and turns.png (the same rows
for those levels walked forward under the turn diagnostic's held turns, right then left). A
sharp teacher-forced row over a blurred rollout says the model knows the next frame but drifts
on its own frames. walk_and_turn.png and turn_in_place.png show the same levels playing the
walk_turn and turn scripts (--script-frames), the simulator above the model.

What a player would see is scored per rollout frame: the layout score (PSNR of 4x4-block means,
so blur does not count against it) and the sharpness ratio (the model frame's high-frequency
energy over the simulator's; a smooth band of colour scores near 0), for the held-out rollouts
and for the two scripts.

Teacher-forced next-frame PSNR/SSIM, autoregressive PSNR/SSIM per frame index, the action
sensitivity gap (true actions minus another episode's, over --gap-range), and optionally
the teacher-forced PSNR of an N-step Euler sampler for comparison (--euler-steps), and
diagnostics: copy-previous PSNR (repeat the last real frame) and action response (PSNR between
teacher-forced predictions under true and foreign actions with the same noise), walking forward
with the mouse at rest against barely moving (--rest-frames), and the
simulator's own answers to the same questions (``owl_wms.maze.evaluation.simulator_responses``).
The target figures are also kept level by level (``per_level``) with the standard error of
their means (``standard_error``): levels differ far more than frames do, so judge a target
with it, and use more --episodes for a tighter figure.
Level seeds start at owl_wms.maze.data.HELD_OUT_SEED (+ --seed-offset): never used in training. A
negative offset that reaches below it scores levels training draws from (--seed-offset -1000000:
levels 0-7, a check for over-fitting); the report then says they are not held out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from inference.actions import load_actions
from inference.causvid_pipeline import DEFAULT_CHECKPOINT, CausvidPipeline
from inference.flags import resolve_settings, with_threads
from owl_wms.config import guidance_problem, load_world
from owl_wms.maze.data import HELD_OUT_SEED, POLICY_STYLES
from owl_wms.maze.evaluation import (Episode, action_response, autoregressive, copy_previous, held_controls_psnr, rollout_sheet,
                                 scripted_rollout, simulator_responses, standard_error, teacher_forced, turn_following,
                                 turn_following_summary)
from scripts.common import machine

# scripted rollouts scored frame by frame beside the simulator (inference.actions' built-in scripts)
SCRIPTS = {"walk_turn": "walk_and_turn", "turn": "turn_in_place"}
SHARP_ENOUGH = 0.5  # a frame below this sharpness ratio is a smooth smear, not the simulator's view


def fmt(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.2f}"


def mean_curve(runs: list[list[tuple[float, float]]], i: int) -> list[float]:
    return [float(np.mean([r[k][i] for r in runs])) for k in range(len(runs[0]))]


def script_summary(runs: list[list[tuple[float, ...]]]) -> dict:
    """A scripted rollout's figures over levels: per-frame means, the least sharp frame, and how
    many frames (over all levels) fall below ``SHARP_ENOUGH``."""
    return {"psnr": mean_curve(runs, 0), "layout_psnr": mean_curve(runs, 2), "sharpness_ratio": mean_curve(runs, 3),
            "sharpness_ratio_min": float(min(x[3] for r in runs for x in r)),
            "sharpness_ratio_min_per_level": [float(min(x[3] for x in r)) for r in runs],
            "frames_below_sharp_enough": int(sum(x[3] < SHARP_ENOUGH for r in runs for x in r)),
            "frames": len(runs[0])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    p.add_argument("--weights", default=None,
                   help="other weights for the checkpoint's model, e.g. a training run's work/world/ema_core.pt")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--policy", default="explore", choices=sorted(POLICY_STYLES),
                   help="policy style that drives the held-out episodes (owl_wms.maze.data)")
    p.add_argument("--seed-offset", type=int, default=0,
                   help=f"first level {HELD_OUT_SEED} + this; below {HELD_OUT_SEED} the levels are not held out")
    p.add_argument("--frames", type=int, default=64, help="autoregressive frames per episode")
    p.add_argument("--tf-frames", type=int, default=32, help="teacher-forced frames per episode")
    p.add_argument("--start", type=int, default=None,
                   help="score each level from this frame on (default: the world's window; a later one scores "
                        "worlds with different windows on the same frames)")
    p.add_argument("--gap-range", type=int, nargs=2, default=(5, 32), help="frame indices (1-based) of the gap")
    p.add_argument("--turn-dx", type=float, default=6.0,
                   help="mouse x of the held turns (each way) in the turn-following diagnostic")
    p.add_argument("--turn-frames", type=int, default=16)
    p.add_argument("--rest-frames", type=int, default=4,
                   help="frames of the at-rest diagnostic: walking forward with the mouse exactly at rest, (0, 0), "
                        "and barely moving, (0.3, 0.1)")
    p.add_argument("--sheet-episodes", type=int, default=4,
                   help="episodes shown in rollouts.png and turns.png (simulator, teacher-forced, autoregressive)")
    p.add_argument("--sheet-every", type=int, default=4, help="frame step between rollouts.png columns")
    p.add_argument("--script-frames", type=int, default=64,
                   help="frames of the walk_turn and turn scripts played from each level's history beside the "
                        "simulator (sharpness ratio and layout per frame; walk_and_turn.png, turn_in_place.png)")
    p.add_argument("--euler-steps", type=int, default=0, help="also score an N-step Euler sampler (0: skip)")
    p.add_argument("--schedule", type=float, nargs="+", default=None,
                   help="sampler noise levels from 1 to 0 (default: the checkpoint's; the cache is written "
                        "at the last step), e.g. many Euler steps to the cache-write level to score a teacher")
    p.add_argument("--guidance", type=float, default=None,
                   help="control guidance at the first step (default: the checkpoint's pipeline.guidance; 1: none), "
                        "e.g. 1.5 for a view that follows the mouse further")
    p.add_argument("--out", default="eval")
    args = p.parse_args(argv)
    if args.episodes < 1:
        p.error(f"--episodes {args.episodes}: must be >= 1 (levels to score; 8 by default)")
    if HELD_OUT_SEED + args.seed_offset < 0:
        p.error(f"--seed-offset {args.seed_offset}: the first level would be {HELD_OUT_SEED + args.seed_offset}; "
                f"level seeds start at 0 (--seed-offset {-HELD_OUT_SEED} scores levels 0-{args.episodes - 1})")
    if args.script_frames < 1:
        p.error(f"--script-frames {args.script_frames}: must be >= 1")
    if args.rest_frames < 0:
        p.error(f"--rest-frames {args.rest_frames}: must be >= 0 (0 skips the at-rest diagnostic)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = load_world(args.checkpoint)
    pipe = CausvidPipeline.from_checkpoint(world, ckpt_path=args.weights, clip=None,
                                           settings=with_threads(resolve_settings(world.inference)))
    if args.schedule:
        pipe.schedule = tuple(args.schedule)
    if args.guidance is not None:
        if problem := guidance_problem(args.guidance):
            p.error(f"--guidance {args.guidance:g}: {problem}")
        pipe.guidance = args.guidance
    pipe.verbose = False  # the start-up lines are printed; every episode's hard cut would be noise
    seeds = [HELD_OUT_SEED + args.seed_offset + i for i in range(args.episodes)]
    held_out = seeds[0] >= HELD_OUT_SEED
    lo, hi = args.gap_range
    n_ar = max(args.frames, hi)
    if args.start is not None and args.start < pipe.window:
        p.error(f"--start {args.start}: must be at least the world's window, {pipe.window} frames (the history "
                f"the pipeline loads)")
    eps = [Episode(pipe, s, max(n_ar, args.tf_frames), args.policy, args.start)
           for s in tqdm(seeds, desc="episodes", unit="ep")]
    ar, tf, other, response, euler, sim, turns, sheet, turn_sheet = [], [], [], [], [], [], [], [], []
    rest, nudged = [], []
    scripted = {name: [] for name in SCRIPTS}
    script_sheets = {name: [] for name in SCRIPTS}
    actions = {name: load_actions(name, args.script_frames) for name in SCRIPTS}
    for i, ep in enumerate(tqdm(eps, desc="evaluate", unit="ep")):
        foreign = eps[(i + 1) % len(eps)]
        predicted = []
        ar.append(autoregressive(pipe, ep, n_ar, frames=predicted))
        if i < args.sheet_episodes:  # the sheet's teacher-forced row spans the rollout's frames
            forced = []
            tf.append(teacher_forced(pipe, ep, max(n_ar, args.tf_frames), frames=forced)[:args.tf_frames])
            sheet.append((ep.frames[ep.start:ep.start + n_ar], np.stack(forced[:n_ar]), np.stack(predicted)))
        else:
            tf.append(teacher_forced(pipe, ep, args.tf_frames))
        other.append(autoregressive(pipe, ep, hi, actions=foreign))
        response.append(action_response(pipe, ep, foreign, args.tf_frames))
        sim.append(simulator_responses(ep, foreign, args.tf_frames, (lo, hi)))
        shown = turn_sheet if i < args.sheet_episodes else None
        turns.append([turn_following(pipe, ep, d * args.turn_dx, args.turn_frames, shown) for d in (1, -1)])
        for name in SCRIPTS:
            shown = script_sheets[name] if i < args.sheet_episodes else None
            scripted[name].append(scripted_rollout(pipe, ep, actions[name], shown))
        if args.rest_frames:
            walk = [1.0] + [0.0] * 10
            rest.append(held_controls_psnr(pipe, ep, [0.0, 0.0], walk, args.rest_frames))
            nudged.append(held_controls_psnr(pipe, ep, [0.3, 0.1], walk, args.rest_frames))
    if args.euler_steps:
        two_step = pipe.schedule
        pipe.schedule = tuple(float(t) for t in torch.linspace(1, 0, args.euler_steps + 1))
        euler = [teacher_forced(pipe, ep, args.tf_frames) for ep in tqdm(eps, desc="euler", unit="ep")]
        pipe.schedule = two_step
    ar_psnr, ar_ssim = mean_curve(ar, 0), mean_curve(ar, 1)
    true_gap = float(np.mean([x[0] for r in ar for x in r[lo - 1:hi]]))
    other_gap = float(np.mean([x[0] for r in other for x in r[lo - 1:hi]]))
    # the target figures level by level (their means are the figures: every level has as many
    # frames), and their standard errors: how far the means could move on other levels
    per_level = {"teacher_forced_psnr": [float(np.mean([x[0] for x in r])) for r in tf],
                 "action_gap_db": [float(np.mean([x[0] for x in a[lo - 1:hi]]) - np.mean([x[0] for x in o[lo - 1:hi]]))
                                   for a, o in zip(ar, other)]}
    if len(ar_psnr) >= 16:
        per_level["ar_psnr_at_16"] = [r[15][0] for r in ar]
    if len(ar_psnr) >= 64:
        per_level["layout_psnr_at_64"] = [r[63][2] for r in ar]
    summaries = {SCRIPTS[name]: script_summary(runs) for name, runs in scripted.items()}
    per_level_turns = [turn_following_summary(level) for level in turns]
    report = {
        "command": " ".join(["python -m scripts.eval_world", *sys.argv[1:]]),
        # the figures move a little with the dtype (bf16 or fp32) and the CPU's kernels
        "settings": pipe.settings.describe(), "machine": machine(),
        "checkpoint": args.checkpoint, "weights": args.weights, "world": pipe.world.name, "seeds": seeds,
        "held_out": held_out,
        "policy": args.policy, "schedule": list(pipe.schedule), "guidance": pipe.guidance,
        "teacher_forced_psnr": float(np.mean([x[0] for r in tf for x in r])),
        "teacher_forced_ssim": float(np.mean([x[1] for r in tf for x in r])),
        "ar_psnr": ar_psnr, "ar_ssim": ar_ssim,
        "ar_psnr_at_16": ar_psnr[15] if len(ar_psnr) >= 16 else None,
        # what a player sees: where things are (PSNR of 4x4-block means, blur not counted) and how
        # sharp the frame is against the simulator's (high-frequency energy ratio), frame by frame
        "ar_layout_psnr": mean_curve(ar, 2), "ar_sharpness_ratio": mean_curve(ar, 3),
        "layout_psnr_at_64": mean_curve(ar, 2)[63] if len(ar_psnr) >= 64 else None,
        **summaries,
        "walk_and_turn_sharpness_min": summaries["walk_and_turn"]["sharpness_ratio_min"],
        "sharp_enough": SHARP_ENOUGH,
        "action_gap_db": true_gap - other_gap, "gap_range": [lo, hi],
        "ar_psnr_gap_range": true_gap, "ar_psnr_foreign_actions_gap_range": other_gap,
        "per_level": per_level, "standard_error": {k: standard_error(v) for k, v in per_level.items()},
        # diagnostics: the no-model baseline, and how much foreign actions change a prediction
        "copy_previous_psnr": float(np.mean([x[0] for ep in eps for x in copy_previous(ep, args.tf_frames)])),
        "action_response_psnr": float(np.mean([x for r in response for x in r])),
        # the simulator's own: next frame under the previous / a foreign action (same state), and
        # a perfect world following foreign actions against the real frames over the gap range
        "sim_previous_action_psnr": float(np.median([x for r in sim for x in r["previous_action"]])),
        "sim_foreign_action_psnr": float(np.median([x for r in sim for x in r["foreign_action"]])),
        "sim_foreign_rollout_psnr_gap_range": float(np.mean([r["foreign_rollout"] for r in sim])),
        # turning: columns per frame the view slides under a held mouse x: the model's rollout,
        # the simulator, and the model's one step from the simulator's frames (teacher-forced), over
        # all frames and split by whether the turn was made in the open or facing a near wall
        **turn_following_summary([run for level in turns for run in level]),
        # the same level by level (each level's right and left turn): the shares, and the slides they
        # are made of, which scripts.compare_worlds pairs (a share's mean over levels is not the share
        # over all levels, and a level where the simulator's view barely slides makes a noisy share)
        "turn_following_per_level": {key: [level[key] for level in per_level_turns]
                                     for key in ("turn_following", "turn_following_teacher_forced")},
        "turn_shift_per_level": {key: [level[f"turn_shift_{key}"] for level in per_level_turns]
                                 for key in ("model", "teacher_forced", "sim")},
        "turn_dx": args.turn_dx, "turn_frames": args.turn_frames, "start": eps[0].start,
        "frames": args.frames, "tf_frames": args.tf_frames,
        # walking forward from the real history with the mouse at rest, exactly (0, 0), as scripts and a
        # resting player send it, and barely moving: a world that never saw a mouse at rest does worse
        **({"rest_walk_psnr": float(np.mean(rest)), "nudged_walk_psnr": float(np.mean(nudged)),
            "rest_frames": args.rest_frames} if args.rest_frames else {}),
        "sheet_every": args.sheet_every, "turn_sheet_every": max(1, args.sheet_every // 2),
        "sheet_rows": ["simulator", "teacher-forced", "autoregressive"],
    }
    if euler:
        report[f"teacher_forced_psnr_euler{args.euler_steps}"] = float(np.mean([x[0] for r in euler for x in r]))
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(ar_psnr) + 1), ar_psnr, label="autoregressive")
    ax.axhline(report["teacher_forced_psnr"], color="gray", ls="--", label="teacher-forced (mean)")
    ax.set_xlabel("frame index")
    ax.set_ylabel("PSNR vs simulator (dB)")
    ax.set_title(f"{pipe.world.name}: {len(seeds)} {'held-out' if held_out else 'not held-out'} levels")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "psnr_curve.png", dpi=100)
    if sheet:
        plt.imsave(out / "rollouts.png", rollout_sheet(sheet, args.sheet_every))
        plt.imsave(out / "turns.png", rollout_sheet(turn_sheet, report["turn_sheet_every"]))
        for name, rows in script_sheets.items():
            plt.imsave(out / f"{SCRIPTS[name]}.png", rollout_sheet(rows, args.sheet_every))
    se = report["standard_error"]
    print(f"teacher-forced PSNR {report['teacher_forced_psnr']:.2f} ± {se['teacher_forced_psnr']:.2f} dB, "
          f"SSIM {report['teacher_forced_ssim']:.3f}; AR PSNR@16 {report['ar_psnr_at_16'] or float('nan'):.2f} ± "
          f"{se.get('ar_psnr_at_16', float('nan')):.2f}; action gap {report['action_gap_db']:.2f} ± "
          f"{se['action_gap_db']:.2f} dB (± one standard error over the {len(seeds)} levels); "
          f"copy-previous {report['copy_previous_psnr']:.2f} dB; action response {report['action_response_psnr']:.2f} dB; "
          f"simulator: previous action {report['sim_previous_action_psnr']:.2f} dB, foreign action "
          f"{report['sim_foreign_action_psnr']:.2f} dB, foreign rollout {report['sim_foreign_rollout_psnr_gap_range']:.2f} dB "
          f"(model, true actions: {true_gap:.2f} dB); turn following {report['turn_following']:.2f} "
          f"({report['turn_shift_model']:.2f} of the simulator's {report['turn_shift_sim']:.2f} columns/frame), "
          f"teacher-forced {report['turn_following_teacher_forced']:.2f} (in the open "
          f"{fmt(report['turn_following_teacher_forced_open'])}, at a near wall "
          f"{fmt(report['turn_following_teacher_forced_near_wall'])}); "
          f"layout@64 {fmt(report['layout_psnr_at_64'])} dB; walk and turn: sharpness ratio min "
          f"{report['walk_and_turn_sharpness_min']:.2f}, {report['walk_and_turn']['frames_below_sharp_enough']} frames "
          f"below {SHARP_ENOUGH:g}; "
          + (f"walking with the mouse at rest {report['rest_walk_psnr']:.2f} dB, barely moving "
             f"{report['nudged_walk_psnr']:.2f} dB" if args.rest_frames else "at-rest diagnostic skipped (--rest-frames 0)")
          + f" -> {out}" + ("" if held_out else f" (levels {seeds[0]}-{seeds[-1]}: not held out)"))


if __name__ == "__main__":
    main()
