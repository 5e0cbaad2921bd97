"""Stage 4: train GameRFT on encoded episodes (rectified flow + diffusion forcing).

    python -m scripts.train_world --config configs/maze_world.yaml --latents work/latents --out work/world

Resumable (weights, EMA, optimizer, step and RNG every --save-every steps). Mixed precision
(bf16 autocast) by default. The EMA weights are what the export stage ships.
``--init checkpoints/maze-world`` fine-tunes a trained world instead of starting from random
weights: its weights start the model and the EMA, and its vae_scale normalises the latents
(a model only understands latents scaled the way it was trained on).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch._dynamo
from tqdm import tqdm

from owl_wms.config import load_config
from owl_wms.loading import load_weights, read_state_dict
from owl_wms.model import GameRFT
from owl_wms.maze.training import (DEFAULT_WORLD_CONFIG, WORLD_RECORD, STOPPED, RunLog, StopSignal, load_training_state,
                              save_training_state, warmup_cosine)
from owl_wms.maze.training.world import LatentEpisodes, sample_times, train_step, world_trainer


# Flags that change what is trained (not where it is read, written or run), so MODEL.md's
# recipe repeats the ones a run set away from their defaults.
RECIPE_FLAGS = ("config", "frames", "lr", "ema", "pipeline_frac", "target_frac", "self_history", "self_rollout",
                "history_noise", "distill", "seed", "init", "fp32", "compile", "open_turn_weight", "seconds")


def recipe_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    out = []
    for name in RECIPE_FLAGS:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value != parser.get_default(name):
            out.append(flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(out)


def base_record(init: str) -> dict | None:
    """The training record of the world a fine-tune starts from (export_checkpoint keeps it in
    the checkpoint), so MODEL.md can list the whole chain; None when it has none."""
    path = Path(init) / WORLD_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


class StepBudget:
    """How many steps fit a wall-clock budget: steps 1..``warm`` of the run are not timed (the
    compile happens in them), steps ``warm``..``warm + timed`` are, and the rest of the budget
    is spent at that pace."""

    def __init__(self, seconds: float, start_step: int, warm: int = 5, timed: int = 20):
        self.seconds, self.t0 = seconds, time.time()
        self.t_warm = self.t0
        self.warm, self.timed = start_step + warm, start_step + warm + timed
        self.fitted = self.per_step = None

    def fit(self, step: int, cap: int) -> int | None:
        """After ``step``: the fitted step count, once, when the timed steps are done (else None)."""
        if step == self.warm:
            self.t_warm = time.time()
        if step != self.timed or self.fitted is not None:
            return None
        self.per_step = max(1e-9, (time.time() - self.t_warm) / (self.timed - self.warm))
        left = self.seconds - (time.time() - self.t0)
        self.fitted = min(cap, step + max(0, int(left / self.per_step)))
        return self.fitted


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_WORLD_CONFIG)
    p.add_argument("--latents", default="work/latents")
    p.add_argument("--out", default="work/world")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--frames", type=int, default=None, help="clip length (default: the pipeline window)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--pipeline-frac", type=float, default=0.5, help="share of pipeline-shaped noise samples")
    p.add_argument("--target-frac", type=float, default=0.0,
                   help="in pipeline-shaped samples, chance that each earlier frame is also a next-frame target")
    p.add_argument("--self-history", type=float, default=0.0,
                   help="chance that each streaming-history frame of a pipeline-shaped sample is "
                        "replaced by the model's own sample, as the pipeline caches it (exposure bias)")
    p.add_argument("--self-rollout", type=int, default=0, metavar="K",
                   help="in every pipeline-shaped sample the last K history frames are the model's own rollout, "
                        "made one after the other with the pipeline's sampler (self-generated history, as in "
                        "Self-Forcing); they are left out of the loss (0: off)")
    p.add_argument("--history-noise", type=float, default=0.0, metavar="S",
                   help="every real history frame of a pipeline-shaped sample gets extra Gaussian noise of a std "
                        "drawn from [0, S) while its level still reads the cache level, and is left out of the "
                        "loss (noise augmentation of the context, as in GameNGen; 0: off)")
    p.add_argument("--distill", type=int, default=0, metavar="STEPS",
                   help="with --init: step distillation of the sampler's first step; its target is the "
                        "--init model's STEPS-step Euler solve to the next level (0: off)")
    p.add_argument("--open-turn-weight", type=float, default=0.0,
                   help="draw training windows in proportion to 1 + this x their share of hard turns in the open "
                        "(episodes record wall_ahead; 0: uniform)")
    p.add_argument("--seconds", type=float, default=None,
                   help="a wall-clock budget for this run's steps: after a few timed steps (compile included "
                        "before them) --steps becomes the number that fits, and the cosine schedule ends there "
                        "(--steps stays the upper bound)")
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="checkpoint folder to fine-tune (default: random weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks (a one-off compile, then faster steps)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)

    world = load_config(args.config)
    stats = json.loads((Path(args.latents) / "stats.json").read_text())
    frames = args.frames or world.pipeline.window_frames
    init = load_config(Path(args.init) / "config.yaml") if args.init else None
    if init is not None and init.model != world.model:
        raise SystemExit(f"error: --init {args.init} holds a model unlike --config {args.config}'s; "
                         f"pass that checkpoint's config.yaml as --config")
    if args.self_rollout < 0:
        raise SystemExit(f"error: --self-rollout {args.self_rollout} must be a number of history frames (> 0) or 0 "
                         "for off")
    if not 0 <= args.history_noise <= 4:
        raise SystemExit(f"error: --history-noise {args.history_noise:g} must be a noise std in [0, 4] (latents have "
                         "unit std; 0: off)")
    reshapes_history = args.self_history or args.self_rollout or args.history_noise
    if reshapes_history and world.pipeline.history_alpha != world.pipeline.schedule[-2]:
        raise SystemExit(f"error: --self-history, --self-rollout and --history-noise need the history level "
                         f"(pipeline.history_alpha {world.pipeline.history_alpha}) to be the schedule's cache-write level "
                         f"{world.pipeline.schedule[-2]}; drop them or align the config")
    if args.distill < 0:
        raise SystemExit(f"error: --distill {args.distill} must be a number of Euler steps (> 0) or 0 for off")
    if args.distill and init is None:
        raise SystemExit(f"error: --distill {args.distill} needs a teacher: pass the trained checkpoint as --init")
    vae_scale = init.vae_scale if init is not None else stats["vae_scale"]
    if args.seconds is not None and args.seconds <= 0:
        raise SystemExit(f"error: --seconds {args.seconds:g} must be > 0 (a wall-clock budget), or left out")
    try:
        data = LatentEpisodes(args.latents, vae_scale, frames, args.open_turn_weight)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: --latents {args.latents}: {exc}") from None
    # a compiler failure on a new machine costs speed, not the run: eager, with its message (only
    # for this run: the setting is process-wide)
    with torch._dynamo.config.patch(suppress_errors=bool(args.compile)):
        train(p, args, world, init, data, frames, vae_scale)


def train(p, args, world, init, data, frames: int, vae_scale: float):
    """The training loop of ``main`` on checked arguments; resumes from the state in ``--out``."""
    torch.manual_seed(args.seed)
    model, ema, opt, sched = world_trainer(world.model, args.lr, args.steps, args.device, args.compile)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "train_state.pt"
    metrics_path = out / "train_metrics.json"
    step, runs = load_training_state(state_path, gen, model=model, ema=ema, opt=opt, sched=sched)
    if runs is None:  # a state saved before it kept run records: the finished runs' metrics file
        runs = [r for r in json.loads(metrics_path.read_text()).get("runs", []) if r["to_step"] <= step] \
            if metrics_path.is_file() else []
    # Every invocation is recorded (a resumed run with a larger --steps goes on from the saved
    # step on the cosine schedule of the new length), so MODEL.md can list each command and its time.
    clock = RunLog(runs, step, args.batch, args.steps, recipe_options(p, args))
    weights = Path(args.init) / "model.safetensors" if init is not None else None
    # read once: load_weights copies it into each module (a resumed fine-tune has its weights in
    # the state; a distilling one still needs them for the teacher)
    state = read_state_dict(weights) if init is not None and (step == 0 or args.distill) else None
    if init is not None and step == 0:
        for net in (model, ema):
            load_weights(net, state, str(weights))
    teacher = None
    if args.distill:  # the --init weights, frozen
        teacher = GameRFT(world.model).to(args.device).eval().requires_grad_(False)
        load_weights(teacher, state, str(weights))
    losses = []
    bar = tqdm(total=args.steps, initial=step, desc="world", unit="step")
    budget = StepBudget(args.seconds, step) if args.seconds else None
    with StopSignal() as stop:
        while step < args.steps and not stop.requested:
            x, m, b = data.batch(args.batch, gen)
            t = sample_times(x.shape[0], x.shape[1], gen, args.pipeline_frac, world.pipeline.history_alpha,
                             world.pipeline.schedule, args.target_frac)
            loss = train_step(model, ema, opt, sched, x.to(args.device), m.to(args.device), b.to(args.device), t, gen,
                              args.ema, bf16=not args.fp32, self_history_share=args.self_history,
                              schedule=tuple(world.pipeline.schedule), teacher=teacher.core if teacher else None,
                              teacher_steps=args.distill, self_rollout=args.self_rollout,
                              history_noise=args.history_noise)
            step += 1
            losses.append(loss.item())
            if budget is not None and budget.fit(step, args.steps) is not None:
                args.steps = budget.fitted
                clock.now["target"] = args.steps
                sched.lr_lambdas[0] = warmup_cosine(args.steps, max(1, args.steps // 50))
                bar.total = args.steps
                print(f"--seconds {args.seconds:g}: {budget.per_step * 1000:.1f} ms per step -> {args.steps} steps")
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
            if step % args.save_every == 0 or step == args.steps or stop.requested:
                save_training_state(state_path, step, gen, clock.runs(step), model=model, ema=ema, opt=opt, sched=sched)
    bar.close()
    if step < args.steps:  # stopped by a signal: the state is saved at this step
        print(f"stopped at step {step} of {args.steps}; the state is saved: run the same command again to resume")
        raise SystemExit(STOPPED)
    torch.save(ema.core.state_dict(), out / "ema_core.pt")
    metrics_path.write_text(json.dumps({
        "steps": args.steps, "batch": args.batch, "frames": frames, "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        **clock.record(args.steps), "vae_scale": vae_scale, "init": args.init, "out": args.out, "config": args.config,
        **({"base": base_record(args.init)} if args.init else {})}, indent=2))
    print(f"trained {args.steps} steps; EMA weights -> {out / 'ema_core.pt'}")


if __name__ == "__main__":
    main()
