"""Play the world model (pygame window) or render a scripted rollout (--headless) to mp4.

    python -m inference.game_cv                                   # play the default world
    python -m inference.game_cv --headless --frames 64 --out x.mp4 --actions walk_turn
    python -m inference.game_cv --headless --beside-simulator      # the simulator (left) beside the model
    torchrun --nproc-per-node 2 -m inference.game_cv --headless --tp 2 --out x.mp4   # heads on 2 ranks
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from owl_wms.clips import load_clip
from owl_wms.config import ConfigError, load_config
from owl_wms.loading import WEIGHT_CHOICES, CheckpointError
from owl_wms.parallel import ParallelContext, TPError, is_collective_error
from owl_wms.settings import Settings, SettingsError

from .actions import BUILTIN, apply_event, is_event, load_actions
from .causvid_pipeline import DEFAULT_CHECKPOINT, TP_FAULTS, CausvidPipeline
from .lifecycle import LifecycleError
from .video import Mp4Writer, OutputPathError, StopOnSigint, check_output_path

USER_ERRORS = (ConfigError, CheckpointError, SettingsError, OutputPathError, FileNotFoundError, ValueError, TPError,
               LifecycleError)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m inference.game_cv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                   help="checkpoint folder with config.yaml, or a config file (default: the shipped world)")
    p.add_argument("--ckpt", default=None, help="weights file or shard index (default: model.safetensors, or its shards, beside the config)")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                   help="which weights of a trainer checkpoint ({model, ema, opt, steps}): its EMA copy or the "
                        "online model (default: EMA where the file has it, as the original loads)")
    p.add_argument("--clip", default="0", help="index of a shipped clip, or a clip .safetensors path")
    p.add_argument("--world-seed", type=int, default=None,
                   help="start from a fresh simulator level: render and encode a history window")
    p.add_argument("--ground-truth", action="store_true", help="replay the clip's recorded future actions")
    p.add_argument("--seed", type=int, default=None, help="noise seed (overrides OWL_SEED)")
    p.add_argument("--headless", action="store_true", help="render to an mp4 instead of opening a window")
    p.add_argument("--frames", type=int, default=None, help="frames to render (default 64, or the action file's length)")
    p.add_argument("--out", default="rollout.mp4", help="output mp4 for --headless")
    p.add_argument("--actions", default="walk_turn",
                   help=f"built-in script ({', '.join(BUILTIN)}; 'random:SEED') or a JSON-lines action file")
    p.add_argument("--beside-simulator", action="store_true",
                   help="headless: put the simulator's frames under the same actions, from the same level, left "
                        "of the model's (the start must record its level: --world-seed N or an exported clip)")
    p.add_argument("--fps", type=float, default=15.0, help="frame rate written into the video")
    p.add_argument("--scale", type=int, default=4, help="integer upscaling of the video / window")
    p.add_argument("--save-frames", default=None,
                   help="--headless: also save the raw uint8 frames [n, H, W, 3] to this .npy (exact comparisons)")
    p.add_argument("--sheet", default=None,
                   help="--headless: also save a contact sheet PNG of every --sheet-every-th frame, 16 to a row "
                        "(with --beside-simulator the simulator's row above the model's)")
    p.add_argument("--sheet-every", type=int, default=2, help="frame step of --sheet")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel ranks (heads and MLP split across processes; launch with torchrun "
                        "--nproc-per-node N)")
    p.add_argument("--tp-fault", choices=TP_FAULTS, default=None, help=argparse.SUPPRESS)  # tests: rank 1 misbehaves
    play = p.add_argument_group("play (window) options")
    play.add_argument("--target-fps", type=float, default=60.0, help="window refresh rate (frame pacing)")
    play.add_argument("--smooth", action="store_true", help="smooth scaling instead of integer (nearest)")
    play.add_argument("--sensitivity", type=float, default=None, help="mouse sensitivity (config controls.sensitivity)")
    play.add_argument("--no-overlay", action="store_true", help="start with the overlay hidden (F1 toggles)")
    play.add_argument("--record", default=None, help="record what is shown to this mp4 from the start (F9 toggles)")
    play.add_argument("--record-dir", default=".", help="folder for F9 recordings and F12 screenshots")
    play.add_argument("--save-actions", default=None, help="write every frame's actions (and events) as JSON lines")
    play.add_argument("--replay", default=None, help="play an action file in the window instead of live input")
    play.add_argument("--max-frames", type=int, default=None, help="quit after this many frames (automation)")
    args = p.parse_args(argv)
    if args.frames is not None and args.frames < 1:
        p.error(f"--frames {args.frames}: must be >= 1")
    if args.scale < 1:
        p.error(f"--scale {args.scale}: must be >= 1")
    if args.tp < 1:
        p.error(f"--tp {args.tp}: must be >= 1")
    if args.sheet_every < 1:
        p.error(f"--sheet-every {args.sheet_every}: must be >= 1")
    return args


def resolve_settings(args) -> Settings:
    checkpoint = Path(args.checkpoint)
    cfg_path = checkpoint / "config.yaml" if checkpoint.is_dir() else checkpoint
    settings = Settings.resolve(load_config(cfg_path).inference)
    return settings.replace(seed=args.seed) if args.seed is not None else settings


def build_pipeline(args, tp: ParallelContext | None = None) -> CausvidPipeline:
    """The pipeline with its first history; TP ranks other than 0 get theirs from rank 0."""
    settings = resolve_settings(args)
    clip = int(args.clip) if args.clip.isdigit() and args.world_seed is None else None
    pipe = CausvidPipeline.from_checkpoint(Path(args.checkpoint), args.ckpt, settings=settings, clip=clip,
                                           ground_truth=args.ground_truth, tp=tp, tp_fault=args.tp_fault,
                                           weights=args.weights)
    if tp is not None and not tp.is_leader:
        return pipe
    if args.world_seed is not None:
        pipe.load_world(args.world_seed)
    elif clip is None:
        pipe.load_clip(load_clip(args.clip, pipe.cfg.channels, pipe.cfg.sample_size))
    return pipe


def launch_tp(args) -> ParallelContext | None:
    if args.tp == 1:
        return None
    settings = resolve_settings(args)
    return ParallelContext.launch(args.tp, settings.device, settings.tp_timeout_s, settings.tp_check_every)


def save_frames(path: Path, frames: list):
    """Raw frames as one .npy, written atomically."""
    import numpy as np

    tmp = path.with_name(f".{path.name}.partial.npy")
    np.save(tmp, np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8))
    tmp.replace(path)


def save_sheet(path: Path, shown: list, every: int, per_row: int = 16):
    """A contact sheet of the video's frames (each a tuple of views: (simulator, model) or
    (model,)), ``per_row`` picked frames to a row, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from owl_wms.evaluation import rollout_sheet

    views = [np.stack(v) for v in zip(*shown)]
    span = per_row * every
    tmp = path.with_name(f".{path.name}.partial.png")
    plt.imsave(tmp, rollout_sheet([tuple(v[i:i + span] for v in views) for i in range(0, len(shown), span)], every))
    tmp.replace(path)


class SimulatorBeside:
    """The simulator's view of the level the model's history came from, stepped with the controls
    each generated frame used (``pipe.last_controls``: the clip's recorded ones in ground-truth mode), so the video shows
    the truth beside the dream: ``frame(controls, model_frame)`` -> [simulator | gap | model]."""

    GAP = 2  # black columns between the two views

    def __init__(self, pipe: CausvidPipeline):
        self.pipe, self.bookmark = pipe, None
        self.start()

    def start(self):
        """Back to the end of the current clip's history (a new clip, a restart)."""
        from owl_wms.evaluation import replay_clip

        self.sim = replay_clip(self.pipe.clip, *self.pipe.frame_shape)

    def handle(self, event: dict):
        """Follow a pipeline event that moves the history (called after the pipeline's)."""
        import copy

        name = event["event"]
        if name in ("restart", "clip", "world_seed"):
            self.start()
        elif name == "snapshot":
            self.bookmark = copy.deepcopy(self.sim)
        elif name == "restore":
            self.sim = copy.deepcopy(self.bookmark)

    def step(self, controls):
        """The simulator's next frame under the controls the model's frame used."""
        mouse, buttons = controls
        return self.sim.step(mouse.tolist(), buttons.tolist())

    def frame(self, real, model_frame):
        import numpy as np

        gap = np.zeros((real.shape[0], self.GAP, 3), np.uint8)
        return np.concatenate([real, gap, model_frame], axis=1)


def run_headless(args, tp: ParallelContext | None = None) -> int:
    from tqdm import tqdm

    if tp is not None and not tp.is_leader:  # a follower: rank 0 owns input, decoding and output
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops everyone
        build_pipeline(args, tp).follow()
        return 0
    items = load_actions(args.actions, args.frames, seed=args.seed or 0)
    frames_path = check_output_path(args.save_frames, suffix=".npy", flag="--save-frames") if args.save_frames else None
    sheet_path = check_output_path(args.sheet, suffix=".png", flag="--sheet") if args.sheet else None
    writer = Mp4Writer(args.out, fps=args.fps, scale=args.scale)  # checked before the model loads
    interrupted, error = False, None
    pipe_seconds = 0.0
    shown = []  # the views of each frame, (simulator, model) or (model,): --save-frames and --sheet
    try:
        with StopOnSigint() as stop:
            pipe = build_pipeline(args, tp)
            beside = SimulatorBeside(pipe) if args.beside_simulator else None
            start = time.perf_counter()
            bar = tqdm(total=sum(not is_event(x) for x in items), desc="rollout", unit="frame")
            for item in items:
                if stop.requested:
                    interrupted = True
                    break
                if is_event(item):
                    apply_event(pipe, item)
                    if beside is not None:
                        beside.handle(item)
                    continue
                frame, secs = pipe(*item)
                pipe_seconds += secs
                views = (frame.numpy(),) if beside is None else (beside.step(pipe.last_controls), frame.numpy())
                writer.write(views[0] if beside is None else beside.frame(*views))
                if frames_path is not None or sheet_path is not None:
                    shown.append(views)
                bar.update(1)
            bar.close()
            pipe.close()  # TP: the other ranks stop after a last vote and lifecycle check
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # the video of the frames so far is still finalised and reported
        error = exc
    finally:
        path = writer.close()
        if frames_path is not None and shown:
            save_frames(frames_path, [views[-1] for views in shown])
        if sheet_path is not None and shown:
            save_sheet(sheet_path, shown, args.sheet_every)
    n = writer.frames
    if n:
        total = time.perf_counter() - start
        stopped = " - interrupted" if interrupted else " - stopped by an error" if error else ""
        print(f"wrote {path} ({n} frames){stopped}; pipeline {n / pipe_seconds:.2f} FPS, total {n / total:.2f} FPS")
    elif interrupted or error:
        print("stopped before the first frame; no video written")
    if error is not None:
        raise error
    return 130 if interrupted else 0


def no_display_message() -> str:
    return ("error: no display is available for the game window.\n"
            "  Render to a video instead:  python -m inference.game_cv --headless --frames 64 --out rollout.mp4\n"
            "  or point SDL at a display (DISPLAY=:0, or run under Xvfb), or set SDL_VIDEODRIVER "
            "(e.g. SDL_VIDEODRIVER=dummy for a window-less test run).")


def run_play(args) -> int:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("SDL_VIDEODRIVER")):
        print(no_display_message(), file=sys.stderr)
        return 2
    from .play import Game, PlayOptions

    options = PlayOptions.from_args(args)  # output paths are checked here, before the model loads
    return Game(lambda: build_pipeline(args), options).run()


def main(argv=None) -> int:
    args = parse_args(argv)
    tp = None
    try:
        tp = launch_tp(args)
        if tp is not None and not args.headless:
            raise TPError("--tp runs headless only (the window belongs to one process); add --headless")
        if args.beside_simulator and not args.headless:
            raise ValueError("--beside-simulator renders to the video only; add --headless")
        return run_headless(args, tp) if args.headless else run_play(args)
    except USER_ERRORS as exc:
        if tp is not None:
            tp.fail(exc)
        prefix = f"rank {tp.rank}: " if tp is not None and not isinstance(exc, TPError) else ""
        print(f"error: {prefix}{exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if tp is not None and is_collective_error(exc):  # a peer failed first: report its error
            print(f"error: rank {tp.rank}: {tp.explain(exc)}", file=sys.stderr)
            return 2
        if tp is not None:
            tp.fail(exc)  # peers stop waiting and report this error
        raise
    finally:
        if tp is not None:
            tp.shutdown()


if __name__ == "__main__":
    sys.exit(main())
