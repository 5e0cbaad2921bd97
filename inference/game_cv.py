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

if __name__ == "__main__":  # first of all, before torch loads (seconds): say so; a Ctrl-C now ends quietly
    from inference.signals import quit_during_startup

    quit_during_startup()
    from inference.cores import same_numbers_at_any_thread_count
    from inference.heap import keep_freed_memory

    same_numbers_at_any_thread_count()
    keep_freed_memory()
    if not {"-h", "--help"} & set(sys.argv):
        print("[owl] starting ...", flush=True)

from owl_wms.clips import check_clip, is_clip_index, load_clip, world_clips  # noqa: E402
from owl_wms.config import GUIDANCE_RANGE, ConfigError, WorldConfig, guidance_problem, load_world  # noqa: E402
from owl_wms.engine import CausvidPipeline, LifecycleError  # noqa: E402
from owl_wms.loading import SHIPPED_WORLD, WEIGHT_CHOICES, CheckpointError, weights_path  # noqa: E402
from owl_wms.maze.worlds import check_simulator, load_level  # noqa: E402
from owl_wms.parallel import ParallelContext, TPError, check_heads, is_collective_error  # noqa: E402
from owl_wms.settings import Settings, SettingsError  # noqa: E402

from .actions import BUILTIN, MAX_FRAMES, is_event, load_actions  # noqa: E402
from .cli import ArgumentParser  # noqa: E402
from .cores import CoreBudget  # noqa: E402
from .flags import flag_message, resolve_settings, warnings_as_lines, with_threads  # noqa: E402
from .headless import follow, run_headless, run_sessions  # noqa: E402
from .video import OutputPathError, OutputWriteError  # noqa: E402

USER_ERRORS = (ConfigError, CheckpointError, SettingsError, OutputPathError, OutputWriteError, FileNotFoundError,
               ValueError, TPError, LifecycleError)


HEADLESS = {"out": "rollout.mp4", "actions": "walk_turn", "sheet_every": 2}  # --headless defaults


def add_world_arguments(p: argparse.ArgumentParser) -> None:
    """--checkpoint, --ckpt, --weights: which world to load, and --guidance: how it is sampled
    (every app that loads one; check_world_arguments checks them)."""
    p.add_argument("--checkpoint", default=str(SHIPPED_WORLD),
                   help="checkpoint folder with config.yaml, or a config file (default: the shipped world)")
    p.add_argument("--ckpt", default=None, help="weights file or shard index (default: model.safetensors, or its shards, beside the config)")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                   help="which weights of a trainer checkpoint ({model, ema, opt, steps}): its EMA copy or the "
                        "online model (default: EMA where the file has it, as the original loads)")
    p.add_argument("--guidance", type=float, default=None,
                   help=f"control guidance: above 1 the view follows the mouse further, at one more model call a "
                        f"frame (default: the checkpoint's pipeline.guidance; 1: none; "
                        f"{GUIDANCE_RANGE[0]:g}-{GUIDANCE_RANGE[1]:g})")


def check_world_arguments(p: argparse.ArgumentParser, args) -> None:
    """A clear error for a --guidance out of range, before anything loads."""
    if args.guidance is not None and (problem := guidance_problem(args.guidance)):
        p.error(f"--guidance {args.guidance:g}: {problem}")


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m inference.game_cv", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_world_arguments(p)
    p.add_argument("--clip", default=None,
                   help="index of a shipped clip, or a clip .safetensors path (default: 0; not with --world-seed)")
    p.add_argument("--world-seed", type=int, default=None,
                   help="start from a fresh simulator level: render and encode a history window")
    p.add_argument("--ground-truth", action="store_true", help="replay the clip's recorded future actions")
    p.add_argument("--seed", type=int, default=None, help="noise seed (overrides OWL_SEED)")
    p.add_argument("--headless", action="store_true", help="render to an mp4 instead of opening a window")
    p.add_argument("--frames", type=int, default=None, help="frames to render (default 64, or the action file's length)")
    p.add_argument("--out", default=None, help=f"output mp4 for --headless (default: {HEADLESS['out']})")
    p.add_argument("--actions", default=None,
                   help=f"--headless: built-in script ({', '.join(BUILTIN)}; 'random:SEED') or a JSON-lines action "
                        f"file (default: {HEADLESS['actions']})")
    p.add_argument("--beside-simulator", action="store_true",
                   help="headless: put the simulator's frames under the same actions, from the same level, left "
                        "of the model's (the start must record its level: --world-seed N or an exported clip)")
    p.add_argument("--fps", type=float, default=15.0, help="frame rate written into the video (default: 15)")
    p.add_argument("--scale", type=int, default=None,
                   help="integer upscaling of the video / window (default: 4 headless; the window's from the screen, "
                        "its short side up to 768 px)")
    p.add_argument("--save-frames", default=None,
                   help="--headless: also save the raw uint8 frames [n, H, W, 3] to this .npy (exact comparisons)")
    p.add_argument("--sheet", default=None,
                   help="--headless: also save a contact sheet PNG of every --sheet-every-th frame, 16 to a row "
                        "(with --beside-simulator the simulator's row above the model's)")
    p.add_argument("--sheet-every", type=int, default=None, help=f"frame step of --sheet (default: {HEADLESS['sheet_every']})")
    p.add_argument("--sessions", type=int, default=1,
                   help="--headless: render N rollouts in one batched run (session i uses seed + i; --actions a,b,... "
                        "one script each); outputs are numbered: run.mp4 -> run_0.mp4 ...")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel ranks (heads and MLP split across processes; launch with torchrun "
                        "--nproc-per-node N)")
    p.add_argument("--pp", type=int, default=1, choices=(1, 2),
                   help="2: two pipeline stages, rank 0 owning input, decoding and output while rank 1 generates "
                        "(launch with torchrun --nproc-per-node 2); with --tp N, ranks 1..N generate with the heads "
                        "split between them (--nproc-per-node N+1)")
    play = p.add_argument_group("play (window) options")
    play.add_argument("--target-fps", type=float, default=None, help="window refresh rate (frame pacing; default: 60)")
    play.add_argument("--smooth", action="store_true", help="smooth scaling instead of integer (nearest)")
    play.add_argument("--sensitivity", type=float, default=None, help="mouse sensitivity (config controls.sensitivity)")
    play.add_argument("--no-overlay", action="store_true", help="start with the overlay hidden (F1 toggles)")
    play.add_argument("--record", default=None, help="record what is shown to this mp4 from the start (F9 toggles)")
    play.add_argument("--record-dir", default=None,
                      help="folder for F9 recordings and F12 screenshots (default: recordings/, made when first used)")
    play.add_argument("--save-actions", default=None, help="write every frame's actions (and events) as JSON lines")
    play.add_argument("--replay", default=None, help="play an action file in the window instead of live input")
    play.add_argument("--max-frames", type=int, default=None, help="quit after this many frames (automation)")
    args = p.parse_args(argv)
    for flag, value, lo, hi in (("--frames", args.frames, 1, MAX_FRAMES), ("--scale", args.scale, 1, 16),
                                ("--tp", args.tp, 1, 64), ("--sessions", args.sessions, 1, 64), ("--sheet-every", args.sheet_every, 1, 10_000),
                                ("--max-frames", args.max_frames, 1, None), ("--world-seed", args.world_seed, 0, 2**31 - 1),
                                ("--seed", args.seed, 0, 2**63 - 1)):
        if value is not None and not (lo <= value and (hi is None or value <= hi)):
            p.error(f"{flag} {value}: must be a whole number " + (f"in [{lo}, {hi}]" if hi else f">= {lo}"))
    for flag, value, lo in (("--fps", args.fps, 0.1), ("--target-fps", args.target_fps, 1), ("--sensitivity", args.sensitivity, 0)):
        if value is not None and not (lo < value <= 1000 if lo == 0 else lo <= value <= 1000):
            p.error(f"{flag} {value}: must be a number in " + (f"({lo}, 1000]" if lo == 0 else f"[{lo}, 1000]"))
    check_world_arguments(p, args)
    if args.clip is not None and args.world_seed is not None:
        p.error(f"--clip {args.clip} and --world-seed {args.world_seed} both choose where play starts; give one")
    if args.sheet_every is not None and args.sheet is None:
        p.error("--sheet-every sets the frame step of --sheet; add --sheet FILE.png or drop it")
    if not args.headless and args.sessions == 1:  # (--sessions has its own message)
        for flag, given in (("--out", args.out), ("--actions", args.actions), ("--frames", args.frames),
                            ("--save-frames", args.save_frames), ("--sheet", args.sheet)):
            if given is not None:
                p.error(f"{flag} is a --headless option (the window is played live; F9 records it): add --headless")
        args.target_fps = 60.0 if args.target_fps is None else args.target_fps
    if args.headless:
        for flag, given in (("--target-fps", args.target_fps), ("--sensitivity", args.sensitivity)):
            if given is not None:
                p.error(f"{flag} is a window option, not used with --headless: a rollout's pace is its --fps")
        for name, value in HEADLESS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        for flag, given, fix in (("--record", args.record, "the rollout's video is --out"),
                                 ("--record-dir", args.record_dir, "the rollout's video is --out"),
                                 ("--save-actions", args.save_actions, "a rollout's actions are its --actions"),
                                 ("--replay", args.replay, "give the action file as --actions FILE"),
                                 ("--max-frames", args.max_frames, "give the rollout's length as --frames N"),
                                 ("--no-overlay", args.no_overlay, "a rollout's video has no overlay"),
                                 ("--smooth", args.smooth, "a rollout's video is scaled by whole pixels")):
            if given:
                p.error(f"{flag} is a window option, not used with --headless: {fix}")
    if args.headless and args.scale is None:
        args.scale = 4
    return args


def processes(args) -> int:
    """The processes torchrun starts: --tp N ranks, or with --pp 2 rank 0 beside the generating ranks."""
    return 1 + args.tp if args.pp == 2 else args.tp


def run_settings(args, free_below: float = 0.3) -> tuple[WorldConfig, Settings, CoreBudget]:
    """The checkpoint's config, read once, the settings (its ``inference:`` section under the
    OWL_* flags, then --seed) and the thread budget: threads not chosen by hand follow the cores
    other processes leave free (one process; TP ranks share the cores by count; ``free_below``:
    CoreBudget's)."""
    world = load_world(args.checkpoint)
    if args.guidance is not None:
        world = world.with_guidance(args.guidance)
    chosen = resolve_settings(world.inference)
    settings = with_threads(chosen, processes(args))
    budget = CoreBudget(settings.generator_threads, adaptive=chosen.threads == 0 and processes(args) == 1
                        and not os.environ.get("OMP_NUM_THREADS"), free_below=free_below)
    return world, settings.replace(seed=args.seed) if args.seed is not None else settings, budget


# OWL_COMPILE=auto compiles where it pays: the window and long rollouts. On a 2-core CPU the compile
# takes 10-40 s (with or without a warm compile cache), during which eager frames slow down, and then
# saves about half of each frame: a short rollout finishes sooner eagerly (docs/results.md).
COMPILE_PAYS_FRAMES = 2000


def start_clip(args) -> int | None:
    """The clip index play starts from (None: a clip file's path, or a --world-seed level)."""
    if args.world_seed is not None:
        return None
    clip = "0" if args.clip is None else args.clip
    return int(clip) if is_clip_index(clip) else None


def check_start(args, world: WorldConfig) -> None:
    """Before any weights load: the weights are there, the start (--clip) and, headless, the
    action scripts (one script's frame count becomes --frames where none was given)."""
    if args.ckpt is not None or world.path is not None:
        weights_path(args.ckpt, world.path)
    clips = len(world_clips(world))
    if args.clip is None:
        args.clip = "0"
    if args.world_seed is None:
        check_clip(world, args.clip)
    if args.headless:
        specs = args.actions.split(",")
        scripts = [load_actions(spec, args.frames, clips=clips) for spec in specs]
        if args.frames is None and len(scripts) == 1:  # (several scripts: each session runs its own length)
            args.frames = sum(not is_event(x) for x in scripts[0])


def compile_pays(args) -> bool:
    if args.headless:
        return args.frames is not None and args.frames * max(1, args.sessions) >= COMPILE_PAYS_FRAMES
    return args.max_frames is None or args.max_frames >= COMPILE_PAYS_FRAMES


def compile_in_background(runner, settings: Settings, budget: CoreBudget | None, rows=(1,), log=print):
    """OWL_COMPILE=auto: the frame call compiles in a child process while frames run eagerly (or
    loads the graphs an earlier start kept), for each thread count the budget may switch between
    (a graph is built per count)."""
    if settings.compile_background:
        adaptive = budget is not None and budget.adaptive and budget.cores > 1
        if runner.compile_in_background(rows, threads=(1,) if adaptive else (), log=log):
            log("[owl] compile: after the first frame the frame call compiles in a background process (a minute "
                "or two on a CPU; a later start loads the graphs it keeps); frames run eagerly meanwhile")


def build_pipeline(args, world: WorldConfig, settings: Settings, tp: ParallelContext | None = None,
                   budget: CoreBudget | None = None) -> CausvidPipeline:
    """The pipeline with its first history; TP ranks other than 0 get theirs from rank 0."""
    if tp is None or tp.is_leader:  # start-up takes seconds: say so at once
        print(f"[owl] loading {args.checkpoint} on {settings.device} ({settings.threads} threads) ...", flush=True)
    clip = start_clip(args)
    stages = args.pp == 2
    if stages and args.tp > 1:
        check_heads(world.model, args.tp)  # on every rank: rank 0 would not hear of a refusal inside the mesh
    mesh = tp.split(1) if stages and args.tp > 1 else None  # --pp 2 --tp N: the generating ranks' own group
    pipe = CausvidPipeline.from_checkpoint(world, args.ckpt, settings=settings, clip=clip, ground_truth=args.ground_truth,
                                           tp=mesh if stages else tp, pp=tp if stages else None, weights=args.weights)
    check_simulator(pipe.world)
    if tp is not None and not tp.is_leader:
        if stages and compile_pays(args):  # --pp 2: the generating rank compiles, rank 0 never calls the model
            compile_in_background(pipe.runner, settings, budget)
        return pipe
    if args.world_seed is not None:
        load_level(pipe, args.world_seed)
    elif clip is None:
        pipe.load_clip(load_clip(args.clip, pipe.cfg.channels, pipe.cfg.sample_size))
    if compile_pays(args) and not stages:
        compile_in_background(pipe.runner, settings, budget, log=lambda text: pipe.log(text))
    return pipe


def build_sessions(args, world: WorldConfig, settings: Settings, budget: CoreBudget | None = None):
    """``args.sessions`` sessions of one model, session i from the same start with seed + i."""
    from owl_wms.engine.sessions import Sessions, batch_rows

    print(f"[owl] loading {args.checkpoint} on {settings.device} ({settings.threads} threads) for "
          f"{args.sessions} sessions ...", flush=True)
    sessions = Sessions.from_checkpoint(world, args.ckpt, settings=settings, capacity=args.sessions, weights=args.weights)
    clip = start_clip(args)
    pipes = []
    for i in range(args.sessions):
        pipe = sessions.open(seed=settings.seed + i, clip=clip, ground_truth=args.ground_truth)
        if args.world_seed is not None:
            load_level(pipe, args.world_seed)
        elif clip is None:
            pipe.load_clip(load_clip(args.clip, pipe.cfg.channels, pipe.cfg.sample_size))
        pipes.append(pipe)
    rows = sorted({batch_rows(n) for n in range(1, args.sessions + 1)})
    if compile_pays(args):
        compile_in_background(sessions.runner, settings, budget, rows, log=lambda text: pipes[0].log(text))
    return sessions, pipes


def launch_tp(args, settings: Settings) -> ParallelContext | None:
    if args.pp == 2:
        flag = "--pp 2" + (f" --tp {args.tp}" if args.tp > 1 else "")
        return ParallelContext.launch(processes(args), settings.device, settings.tp_timeout_s, settings.tp_check_every,
                                      settings.tp_reduce, flag=flag,
                                      app="inference.game_cv" + (" --headless" if args.headless else ""))
    if args.tp == 1:
        return None
    return ParallelContext.launch(args.tp, settings.device, settings.tp_timeout_s, settings.tp_check_every,
                                   settings.tp_reduce, app="inference.game_cv --headless")


def has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("SDL_VIDEODRIVER"))


def run_play(args, world: WorldConfig, settings: Settings, budget: CoreBudget | None = None,
             stages: ParallelContext | None = None) -> int:
    """The window (``stages``: rank 0 of --pp 2, the frames made by rank 1)."""
    from .play import Game, PlayOptions, no_display_message  # pygame loads only for the window

    if not has_display():
        print(no_display_message(), file=sys.stderr)
        return 2
    options = PlayOptions.from_args(args)  # output paths are checked here, before the model loads
    return Game(lambda: build_pipeline(args, world, settings, stages, budget=budget), options, budget=budget).run()


def keep_graphs_between_starts() -> None:
    """Compiled graphs persist between starts (a second start reuses them)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "owl-wms", "inductor"))


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings_as_lines()
    keep_graphs_between_starts()
    tp = None
    try:
        world, settings, budget = run_settings(args)  # once: the config is read and the threads set here
        check_start(args, world)
        if args.sessions > 1:
            for flag, clash in (("--headless", not args.headless), ("--tp", args.tp > 1), ("--pp", args.pp > 1),
                                ("--beside-simulator", args.beside_simulator)):
                if clash:
                    raise ValueError(f"--sessions {args.sessions} renders headless rollouts of one process without "
                                     f"the simulator; " + ("add --headless" if flag == "--headless" else f"drop {flag}"))
            return run_sessions(args, lambda args: build_sessions(args, world, settings, budget), budget)
        if args.pp > 1 and not args.headless and not has_display():  # every rank stops, none waits for another
            return run_play(args, world, settings, budget)
        tp = launch_tp(args, settings)
        if tp is not None and not args.headless and args.pp == 1:
            raise TPError("--tp runs headless only (the window belongs to one process); add --headless")
        if args.beside_simulator and not args.headless:
            raise ValueError("--beside-simulator renders to the video only; add --headless")
        if not args.headless:
            if tp is not None and not tp.is_leader:  # --pp 2: rank 1 makes the window's frames
                return follow(lambda: build_pipeline(args, world, settings, tp, budget))
            return run_play(args, world, settings, budget, tp)
        return run_headless(args, lambda args, tp: build_pipeline(args, world, settings, tp, budget), tp, budget)
    except USER_ERRORS as exc:
        if tp is not None:
            tp.fail(exc, flag_message(exc))
        prefix = f"rank {tp.rank}: " if tp is not None and not isinstance(exc, TPError) else ""
        print(f"error: {prefix}{flag_message(exc)}", file=sys.stderr)
        return 2
    except BaseException as exc:
        if tp is not None and is_collective_error(exc):  # a peer failed first: report its error
            print(f"error: rank {tp.rank}: {flag_message(tp.explain(exc))}", file=sys.stderr)
            return 2
        if tp is not None:
            tp.fail(exc, flag_message(exc))  # peers stop waiting and report this error
        raise
    finally:
        if tp is not None:
            tp.shutdown()


def exit_now(code: int):
    """Exit with ``code``; the compile process is ended first, and the thread loading compiled
    graphs, if still at work (outputs are all closed by now), is abandoned rather than unwound,
    which could abort the process."""
    import threading

    from owl_wms.engine.precompile import end_compile_processes

    end_compile_processes()
    if any(t.name == "owl-compile-loader" and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_now(main())
