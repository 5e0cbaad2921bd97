"""The headless renderer: a scripted rollout to an mp4 (and optionally the raw frames and a
contact sheet), with the simulator's view beside the model's where asked."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from owl_wms.engine import CausvidPipeline
from owl_wms.engine.decode_stage import DecodeStage
from owl_wms.parallel import ParallelContext

from .actions import apply_event, is_event, load_actions
from .cues import event_cue, first_frame_cue
from .cores import CoreBudget
from .signals import StopOnSigint, end_startup
from .video import Mp4Writer, check_output_path, flat_frame_warning, mp4_bytes, require_space, write_atomically

SHEET_PER_ROW = 16  # frames in a row of --sheet


def save_frames(path: Path, frames: list):
    """Raw frames as one .npy, written atomically."""
    import numpy as np

    write_atomically(path, lambda tmp: np.save(tmp, np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)))


def save_sheet(path: Path, shown: list, every: int, per_row: int = SHEET_PER_ROW):
    """A contact sheet of the video's frames (each a tuple of views: (simulator, model) or
    (model,)), ``per_row`` picked frames to a row, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from owl_wms.maze.evaluation import rollout_sheet

    views = [np.stack(v) for v in zip(*shown)]
    span = per_row * every
    sheet = rollout_sheet([tuple(v[i:i + span] for v in views) for i in range(0, len(shown), span)], every)
    write_atomically(path, lambda tmp: plt.imsave(tmp, sheet, format="png"))


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
        from owl_wms.maze.evaluation import replay_clip  # the simulator loads only when asked for

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


def output_estimates(args, frame_shape: tuple[int, int], frames: int, beside: bool) -> list[tuple[str, Path, int]]:
    """(flag, path, estimated bytes) of each output of a rollout of ``frames`` frames."""
    h, w = frame_shape
    views = 2 if beside else 1
    width = views * w + (SimulatorBeside.GAP if beside else 0)
    out = [("--out", Path(args.out), mp4_bytes(frames, h * args.scale, width * args.scale))]
    if args.save_frames:
        out.append(("--save-frames", Path(args.save_frames), frames * h * w * 3 + 128))
    if args.sheet:  # a PNG is at most its raw pixels: rows of 16 picked frames, a view above the other
        rows = -(-frames // (args.sheet_every * SHEET_PER_ROW))
        out.append(("--sheet", Path(args.sheet), rows * (views * h + 2) * SHEET_PER_ROW * w * 3 + 4096))
    return out


def pipeline_rate(seconds: list[float]) -> str:
    """The pipeline's frame rate over each frame's denoise + decode ``seconds``, and from the second
    frame on: the first carries one-time work (with OWL_COMPILE=1 the graphs compile there)."""
    text = f"pipeline {len(seconds) / sum(seconds):.2f} FPS"
    if len(seconds) > 1:
        text += f" ({(len(seconds) - 1) / sum(seconds[1:]):.2f} after the first frame)"
    return text


def keep_decoded(stage, show) -> None:
    """On the way out (Ctrl-C, an error): the frames already made still go into the outputs."""
    try:
        for real, frame in stage.drain():
            show(frame, real)
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a broken decode: the frames before it stand
        pass
    finally:
        stage.close()


def follow(build) -> int:
    """A rank other than 0 (TP or the generating stage): rank 0 owns input, decoding and output,
    this rank runs its steps until it stops."""
    import signal

    pipe = build()
    end_startup()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops everyone
    (pipe.stages or pipe.tp).follow()
    return 0


def check_ground_truth(pipe, items: list) -> None:
    """Refuse, before any frame, a --ground-truth script longer than the clip's recorded actions
    (a script with events may restart the clip, so it is left to run)."""
    recorded = pipe.clip.future_frames if pipe.ground_truth and pipe.clip is not None else None
    frames = sum(not is_event(x) for x in items)
    if recorded is not None and frames > recorded and not any(is_event(x) for x in items):
        raise ValueError(f"--ground-truth: the clip records {recorded} future actions; ask for at most "
                         f"--frames {recorded}")


def run_headless(args, build, tp: ParallelContext | None = None, budget: CoreBudget | None = None) -> int:
    """Render ``args.actions`` to ``args.out`` with the pipeline ``build(args, tp)`` makes; returns
    the exit code (when a stop signal ended it, the shell's status for that signal: 130 for Ctrl-C). The
    video of the frames so far is always finalised.
    ``budget``: torch's threads, re-checked between frames."""
    from tqdm import tqdm

    if tp is not None and not tp.is_leader:
        return follow(lambda: build(args, tp))
    items = load_actions(args.actions, args.frames, seed=args.seed or 0)
    frames_path = check_output_path(args.save_frames, suffix=".npy", flag="--save-frames") \
        if args.save_frames is not None else None
    sheet_path = check_output_path(args.sheet, suffix=".png", flag="--sheet") if args.sheet is not None else None
    writer = Mp4Writer(args.out, fps=args.fps, scale=args.scale)  # checked before the model loads
    interrupted, error, stop = False, None, None
    frame_seconds: list[float] = []  # each frame's denoise + decode (decoding beside: since the frame before)
    shown = []  # the views of each frame, (simulator, model) or (model,): --save-frames and --sheet
    bar = stage = last_out = None

    def show(frame, real):
        """Frame after frame in order: into the video (beside the simulator's ``real`` view)."""
        if writer.frames == 0 and (warning := flat_frame_warning(frame)):
            tqdm.write(warning, file=sys.stderr)
        views = (frame,) if real is None else (real, frame)
        writer.write(frame if real is None else beside.frame(*views))
        if frames_path is not None or sheet_path is not None:
            shown.append(views)
        if bar is not None:
            bar.update(1)

    try:
        pipe = build(args, tp)  # a Ctrl-C while it loads ends the run at once: nothing is written yet
        pipe.log = tqdm.write  # diagnostics above the progress bar, never on its line
        beside = SimulatorBeside(pipe) if args.beside_simulator else None
        stages = pipe.stages  # two stages: rank 1 makes the frames, this rank decodes them beside its waiting
        if pipe.settings.decode == "async" or stages is not None:
            stage = DecodeStage(lambda latent: pipe.decode(latent).numpy(),
                                threads=pipe.settings.threads if stages is not None else pipe.settings.decode_threads)
        sims, requested = {}, 0  # frame number -> the simulator's view beside it, until the frame is decoded
        frames = sum(not is_event(x) for x in items)
        check_ground_truth(pipe, items)
        require_space(output_estimates(args, pipe.frame_shape, frames, beside is not None))
        with StopOnSigint() as stop:
            if pipe.settings.compile:
                tqdm.write(f"[owl] {first_frame_cue(pipe.settings)} ...")
            start = time.perf_counter()
            bar = tqdm(total=frames, desc="rollout", unit="frame")
            for item in items:
                if stop.requested:
                    interrupted = True
                    break
                if is_event(item):
                    if (cue := event_cue(item)) is not None:
                        bar.set_postfix_str(cue)  # on the bar while it runs
                    if stages is not None:  # the script asked for the frames in flight: they come first
                        for n, latent in stages.drain():
                            stage.submit(latent, tag=sims.pop(n))
                    apply_event(pipe, item)
                    bar.set_postfix_str("")
                    if beside is not None:
                        beside.handle(item)
                    continue
                if budget is not None:
                    budget.check()
                if stage is None:
                    frame, secs = pipe(*item)
                    frame_seconds.append(secs)
                    show(frame.numpy(), beside.step(pipe.last_controls) if beside is not None else None)
                    continue
                # OWL_DECODE=async: this frame decodes while the next one is made
                last_out = last_out or time.perf_counter()
                if stages is None:
                    latent = pipe.generate(*item)
                    stage.submit(latent, tag=beside.step(pipe.last_controls) if beside is not None else None)
                else:
                    n = requested = requested + 1
                    back = stages.request(*item, tag=n)  # frame n stays in flight: it was just sent
                    sims[n] = beside.step(pipe.last_controls) if beside is not None else None
                    for k, latent in back:
                        stage.submit(latent, tag=sims.pop(k))
                for real, frame in stage.ready():
                    frame_seconds.append(time.perf_counter() - last_out)  # from the frame before
                    last_out = time.perf_counter()
                    show(frame, real)
            for n, latent in stages.drain() if stages is not None else ():
                stage.submit(latent, tag=sims.pop(n))
            for real, frame in stage.drain() if stage is not None else ():
                frame_seconds.append(time.perf_counter() - last_out)
                last_out = time.perf_counter()
                show(frame, real)
            pipe.close()  # TP: the other ranks stop after a last vote and lifecycle check
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # the video of the frames so far is still finalised and reported
        error = exc
    finally:
        if stage is not None:
            keep_decoded(stage, show)
        if bar is not None:
            bar.close()  # messages after it start on a line of their own
        path, also = writer.close(), []
        if frames_path is not None and shown:
            save_frames(frames_path, [views[-1] for views in shown])
            also.append(frames_path)
        if sheet_path is not None and shown:
            save_sheet(sheet_path, shown, args.sheet_every)
            also.append(sheet_path)
    n = writer.frames
    if path is not None:
        total = time.perf_counter() - start
        stopped = " - interrupted" if interrupted else " - stopped by an error" if error else ""
        print(f"wrote {path} ({n} frames){''.join(f', {p}' for p in also)}{stopped}; {pipeline_rate(frame_seconds)}, "
              f"total {n / total:.2f} FPS")
        if budget is not None and budget.describe():
            print(f"[owl] {budget.describe()}")
    elif interrupted or error:
        print("stopped before the first frame; no video written" if n == 0 else "no video written")
    if error is not None:
        raise error
    return (stop.exit_code if stop is not None else 130) if interrupted else 0


def numbered(path: str | None, i: int) -> str | None:
    """``run.mp4`` -> ``run_3.mp4``: session i's output of a batched run."""
    if not path:  # none given, or an empty name that the output check refuses as such
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}_{i}{p.suffix}"))


def session_actions(args, n: int) -> list[list]:
    """Each session's items: ``--actions a,b,...`` gives one script per session, one script is shared."""
    specs = args.actions.split(",")
    if len(specs) not in (1, n):
        raise ValueError(f"--actions gives {len(specs)} scripts for --sessions {n}; give one script for all "
                         f"or one per session, comma-separated")
    return [load_actions(specs[i % len(specs)], args.frames, seed=(args.seed or 0) + i) for i in range(n)]


def run_sessions(args, build, budget: CoreBudget | None = None) -> int:
    """Render ``args.sessions`` rollouts in one batched run (``build(args)`` -> (Sessions, [session
    pipelines])): session i writes ``--out`` numbered i (and its --save-frames / --sheet). Each
    step makes the next frame of every session that still has one, one model call a denoising
    step. Every video of the frames so far is finalised on Ctrl-C or an error."""
    from tqdm import tqdm

    n = args.sessions
    scripts = session_actions(args, n)
    frames_paths = [check_output_path(numbered(args.save_frames, i), suffix=".npy", flag="--save-frames")
                    for i in range(n)] if args.save_frames is not None else None
    sheet_paths = [check_output_path(numbered(args.sheet, i), suffix=".png", flag="--sheet")
                   for i in range(n)] if args.sheet is not None else None
    writers = [Mp4Writer(numbered(args.out, i), fps=args.fps, scale=args.scale) for i in range(n)]
    interrupted, error, bar, stop, shown = False, None, None, None, [[] for _ in range(n)]
    step_seconds, start = [], time.perf_counter()
    try:
        sessions, pipes = build(args)
        for pipe, items in zip(pipes, scripts):
            check_ground_truth(pipe, items)
        total = sum(sum(not is_event(x) for x in items) for items in scripts)
        require_space([est for i, items in enumerate(scripts) for est in output_estimates(
            session_args(args, i), pipes[i].frame_shape, sum(not is_event(x) for x in items), False)])
        queues = [iter(items) for items in scripts]
        with StopOnSigint() as stop:
            if sessions.runner.settings.compile:
                tqdm.write(f"[owl] {first_frame_cue(sessions.runner.settings)} ...")
            start = time.perf_counter()
            bar = tqdm(total=total, desc=f"rollouts x{n}", unit="frame")
            while not stop.requested:
                controls = {}
                for pipe, queue in zip(pipes, queues):
                    for item in queue:
                        if not is_event(item):
                            controls[pipe] = item
                            break
                        apply_event(pipe, item)
                if not controls:
                    break
                if budget is not None:
                    budget.check()
                t0 = time.perf_counter()
                latents = sessions.step(controls)
                order = [p for p in pipes if p in latents]
                frames = sessions.decode([latents[p] for p in order])
                step_seconds.append(time.perf_counter() - t0)
                for pipe, frame in zip(order, frames):
                    i = pipes.index(pipe)
                    writers[i].write(frame.numpy())
                    if frames_paths is not None or sheet_paths is not None:
                        shown[i].append((frame.numpy(),))
                bar.update(len(order))
            interrupted = stop.requested
    except KeyboardInterrupt:
        interrupted = True
    except Exception as exc:  # every video of the frames so far is still finalised and reported
        error = exc
    finally:
        if bar is not None:
            bar.close()
        paths = [w.close() for w in writers]
        for i in range(n):
            if frames_paths is not None and shown[i]:
                save_frames(frames_paths[i], [views[-1] for views in shown[i]])
                paths.append(frames_paths[i])
            if sheet_paths is not None and shown[i]:
                save_sheet(sheet_paths[i], shown[i], args.sheet_every)
                paths.append(sheet_paths[i])
    made = sum(w.frames for w in writers)
    if any(p is not None for p in paths):
        elapsed = time.perf_counter() - start
        stopped = " - interrupted" if interrupted else " - stopped by an error" if error else ""
        print(f"wrote {', '.join(str(p) for p in paths if p is not None)} ({made} frames in {len(step_seconds)} "
              f"batched steps){stopped}; {made / max(sum(step_seconds), 1e-9):.2f} session-frames/s in the steps, "
              f"total {made / elapsed:.2f} FPS")
        if budget is not None and budget.describe():
            print(f"[owl] {budget.describe()}")
    elif interrupted or error:
        print("stopped before the first frame; no video written")
    if error is not None:
        raise error
    return (stop.exit_code if stop is not None else 130) if interrupted else 0


def session_args(args, i: int):
    """``args`` with session i's output paths (what output_estimates reads)."""
    import copy

    one = copy.copy(args)
    one.out, one.save_frames, one.sheet = numbered(args.out, i), numbered(args.save_frames, i), numbered(args.sheet, i)
    return one
