"""Play the world model in a pygame window.

Generation runs on a worker thread, so the window keeps handling input and drawing while a
frame is dreamt; the worker reads the controls held at the moment each frame starts and
carries out control-key commands only between frames. F-keys never collide with the 11
game buttons:

  Esc quit   F1 overlay   F2 pause   F3 step one frame (paused)   F4 ground-truth replay
  F5 restart clip   F6 next clip   F7 new simulator level   F8 mouse grab
  F9 record   F10 / F11 mouse sensitivity down / up   F12 screenshot
  Insert snapshot (branch point)   Home restore the snapshot   PageDown / PageUp history bias -/+ 0.5
"""
from __future__ import annotations

import collections
import dataclasses
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # keep the start-up output to our own line
import pygame  # noqa: E402

from owl_wms.controls import BUTTONS  # noqa: E402
from owl_wms.engine import CausvidPipeline  # noqa: E402
from owl_wms.engine.decode_stage import DecodeStage  # noqa: E402

from .actions import action_line, apply_event, is_event, read_action_file  # noqa: E402
from .bindings import binding_tables  # noqa: E402
from .cues import event_cue, first_frame_cue  # noqa: E402
from .headless import pipeline_rate  # noqa: E402
from .signals import StopOnSigint  # noqa: E402
from .video import MIN_FREE, Mp4Writer, OutputPathError, check_output_path, flat_frame_warning  # noqa: E402

CONTROL_KEYS = {pygame.K_ESCAPE: "quit", pygame.K_F1: "overlay", pygame.K_F2: "pause", pygame.K_F3: "step",
                pygame.K_F4: "ground_truth", pygame.K_F5: "restart", pygame.K_F6: "next_clip",
                pygame.K_F7: "new_level", pygame.K_F8: "grab", pygame.K_F9: "record",
                pygame.K_F10: "sensitivity_down", pygame.K_F11: "sensitivity_up", pygame.K_F12: "screenshot",
                pygame.K_INSERT: "snapshot", pygame.K_HOME: "restore",
                pygame.K_PAGEDOWN: "bias_down", pygame.K_PAGEUP: "bias_up"}


def no_display_message() -> str:
    return ("error: no display is available for the game window.\n"
            "  Render to a video instead:  python -m inference.game_cv --headless --frames 64 --out rollout.mp4\n"
            "  or point SDL at a display (DISPLAY=:0, or run under Xvfb), or set SDL_VIDEODRIVER "
            "(e.g. SDL_VIDEODRIVER=dummy for a window-less test run).")


def parse_bindings(bindings: dict | None) -> tuple[dict[int, int], dict[int, int]]:
    """Config ``controls.bindings`` (button name -> pygame key name or ``mouseN``) over the
    defaults -> (key code -> button index, mouse button -> button index)."""
    pygame.display.init()  # key names resolve only once pygame's video is initialised (idempotent)

    def key_code(button, name):
        try:
            code = pygame.key.key_code(name)
        except ValueError:
            raise ValueError(f"controls.bindings.{button}={name!r} is not a pygame key name "
                             "(examples: 'w', 'left shift', 'space', 'mouse1')") from None
        if code in CONTROL_KEYS:
            raise ValueError(f"controls.bindings.{button}={name!r} collides with the control key "
                             f"for {CONTROL_KEYS[code]!r}; F-keys and Esc are reserved")
        return code

    return binding_tables(bindings, key_code)


class Controls:
    """What the player holds, shared between the event loop and the worker thread."""

    def __init__(self, keys: dict[int, int], mouse: dict[int, int], sensitivity: float = 1.0):
        self.keys, self.mouse_buttons, self.sensitivity = keys, mouse, sensitivity
        self.buttons = [0] * len(BUTTONS)
        self.dx = self.dy = 0.0
        self.grabbed = False
        self._lock = threading.Lock()

    def handle(self, event) -> None:
        with self._lock:
            if event.type in (pygame.KEYDOWN, pygame.KEYUP) and event.key in self.keys:
                self.buttons[self.keys[event.key]] = int(event.type == pygame.KEYDOWN)
            elif event.type in (pygame.MOUSEBUTTONDOWN, pygame.MOUSEBUTTONUP) and event.button in self.mouse_buttons:
                self.buttons[self.mouse_buttons[event.button]] = int(event.type == pygame.MOUSEBUTTONDOWN)
            elif event.type == pygame.MOUSEMOTION and self.grabbed:
                # Scaled as it arrives: motion made before a sensitivity change keeps its scale
                # even when the worker takes it a few frames later.
                self.dx += event.rel[0] * self.sensitivity
                self.dy += event.rel[1] * self.sensitivity

    def release_all(self):
        with self._lock:
            self.buttons = [0] * len(BUTTONS)
            self.dx = self.dy = 0.0

    def held(self) -> list[int]:
        with self._lock:
            return list(self.buttons)

    def take(self) -> tuple[list[float], list[int]]:
        """The controls for the frame that starts now; mouse motion (already scaled) is consumed."""
        with self._lock:
            mouse = [round(self.dx, 4), round(self.dy, 4)]
            self.dx = self.dy = 0.0
            return mouse, list(self.buttons)


@dataclass
class FrameResult:
    frame: np.ndarray
    index: int
    denoise_ms: float
    decode_ms: float
    mouse: list
    buttons: list
    epoch: int = 0  # the cache epoch the frame was made in (a hard cut starts a new one)
    # the session as the frame left it, read on the worker's thread (the UI never reads the pipeline)
    bias: float = 0.0
    ground_truth: bool = False
    kv_bytes: int = 0
    compile_state: str = ""  # "eager", "compiled", or the background compile's progress


class Worker(threading.Thread):
    """Generates frames and applies commands between frames, emitting both in order."""

    def __init__(self, source, controls: Controls, replay: list | None = None, max_frames: int | None = None,
                 budget=None):
        """``budget``: a ``CoreBudget`` re-checked before each frame, on this thread (its threads). ``source``: a pipeline, or a function that builds one. Building it here, on the
        thread that generates, matters on CPU: torch's OpenMP pool belongs to the thread that
        first ran ops, and generating from another thread measured ~2x slower."""
        super().__init__(daemon=True, name="owl-generate")
        self.pipe = source if isinstance(source, CausvidPipeline) else None
        self._factory = None if self.pipe is not None else source
        self.ready = threading.Event()
        self.controls, self.max_frames = controls, max_frames
        self.replay = iter(replay) if replay is not None else None
        self.commands: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue(maxsize=2)
        self.paused, self.finished = False, False
        self.clip_count = 0  # the world's clips, counted on the worker's thread at start
        self._step = threading.Event()
        self._halt = threading.Event()
        self.error: BaseException | None = None
        self.frames = 0
        self.budget = budget
        self.busy: tuple[str, float] | None = None  # what a slow step between frames is doing, and since when
        self.stage = self.stages = None  # the decoding thread and --pp 2's link, made on this thread

    def stop(self):
        self._halt.set()

    @property
    def dropped(self) -> int:
        """Frames made but never shown: in flight at a live hard cut under --pp 2."""
        return (self.stage.discarded if self.stage is not None else 0) + \
            (self.stages.dropped if self.stages is not None else 0)

    def step_once(self):
        self._step.set()

    def _emit(self, item):
        """Hand a frame or an applied event to the UI thread, in order; the UI logs what it
        consumes, so saved actions match the frames shown even when a session is cut short."""
        while not self._halt.is_set():
            try:
                self.results.put(item, timeout=0.05)
                return
            except queue.Full:
                pass

    def _event(self, event: dict):
        if self.stages is not None and event.get("event") in HARD_CUTS:
            self.stage.discard()  # a live cut: the old world's frames in flight are never shown (rank 1's too)
        elif self.stage is not None:
            self._emit_decoded(self._drained())  # the frames made before the event show before it
        cue = event_cue(event)
        self.busy = (cue, time.perf_counter()) if cue is not None else None
        try:
            apply_event(self.pipe, event)
        finally:
            self.busy = None
        self._emit(dict(event))

    def _next_controls(self):
        if self.replay is None:
            return self.controls.take()
        for item in self.replay:
            if not is_event(item):
                return item
            self._event(item)
        return None

    def run(self):
        stage = stages = None  # this thread's: a decoding thread; --pp 2's link to rank 1
        try:
            if self.pipe is None:
                self.pipe = self._factory()
            self.pipe.frame_shape  # decoded once here, so the UI thread never runs torch
            self.clip_count = len(self.pipe.replay.paths)
            stages = self.pipe.stages  # --pp 2: rank 1 makes the frames, this thread sends and takes them
            if self.pipe.settings.decode == "async" or stages is not None:  # frames decode on a thread of their own
                threads = self.pipe.settings.threads if stages is not None else self.pipe.settings.decode_threads
                stage = DecodeStage(self._decode, threads=threads)
            self.stage, self.stages = stage, stages
            self.ready.set()
            while not self._halt.is_set():
                commands = []
                while not self.commands.empty():
                    commands.append(self.commands.get())
                for event in commands:
                    self._event(event)
                done = self.finished or (self.max_frames is not None and self.frames >= self.max_frames)
                if done or (self.paused and not self._step.is_set()):
                    if stage is not None:
                        self._emit_decoded(self._drained())
                    time.sleep(0.005)
                    continue
                self._step.clear()
                controls = self._next_controls()
                if controls is None:
                    self.finished = True
                    continue
                if self.budget is not None:
                    self.budget.check()
                t0 = time.perf_counter()
                if self.frames == 0:
                    self.busy = (first_frame_cue(self.pipe.settings), t0)
                self.frames += 1
                made = FrameResult(None, self.frames, 0.0, 0.0, *controls, epoch=self.pipe.cache_epoch,
                                   bias=self.pipe.kv_cache_attention_bias, ground_truth=self.pipe.ground_truth,
                                   kv_bytes=self.pipe.kv_bytes, compile_state=self.pipe.runner.compile_state())
                if stages is not None:
                    back = stages.request(*controls, tag=made)
                    made.denoise_ms = (time.perf_counter() - t0) * 1000  # rank 1's frame, as this rank waits for it
                    for tag, latent in back:
                        stage.submit(latent, tag=tag)
                    self._emit_decoded(stage.ready())
                    continue
                latent = self.pipe.generate(*controls)
                made.denoise_ms = (time.perf_counter() - t0) * 1000
                if stage is None:
                    self._emit_decoded([(made, self._decode(latent))])
                else:
                    stage.submit(latent, tag=made)
                    self._emit_decoded(stage.ready())
        except BaseException as exc:  # surfaced by the event loop
            self.error = exc
        finally:
            if stage is not None:
                stage.close()
            if stages is not None and self.error is None:
                self.pipe.close()  # rank 1 stops

    def _drained(self) -> list:
        """Every frame in flight (rank 1's too), decoded, in order."""
        for tag, latent in self.stages.drain() if self.stages is not None else ():
            self.stage.submit(latent, tag=tag)
        return list(self.stage.drain())

    def _decode(self, latent) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        frame = self.pipe.decode(latent).numpy()
        return frame, (time.perf_counter() - t0) * 1000

    def _emit_decoded(self, decoded) -> None:
        """Hand each decoded frame to the UI thread, in order."""
        for made, (frame, decode_ms) in decoded:
            if made.index == 1 and (warning := flat_frame_warning(frame)):
                print(warning, file=sys.stderr, flush=True)
            self.busy = None
            self._emit(dataclasses.replace(made, frame=frame, decode_ms=decode_ms))


HARD_CUTS = ("restart", "clip", "world_seed")  # events that start the session from a new history
RECORDINGS = Path("recordings")  # F9 and F12 outputs unless --record-dir says otherwise (git-ignored)


def window_scale(frame_hw: tuple[int, int], screen_wh: tuple[int, int]) -> int:
    """The integer upscaling a window opens at without --scale: the largest that fits 90% of
    the screen, with the frame's short side at most 768 px (and --scale's limit, 16)."""
    (h, w), (sw, sh) = frame_hw, screen_wh
    fit = int(min(0.9 * sh / h, 0.9 * sw / w))
    return max(1, min(fit, 768 // min(h, w), 16))


OVERLAYS = ("compact", "full", "off")  # F1 goes to the next


@dataclass
class PlayOptions:
    scale: int | None = None  # None: from the screen (window_scale)
    smooth: bool = False
    target_fps: float = 60.0
    video_fps: float = 15.0
    sensitivity: float | None = None
    overlay: bool = True
    record: Path | None = None
    record_dir: Path = RECORDINGS  # made at the first recording or screenshot
    save_actions: Path | None = None
    replay: list | None = None
    max_frames: int | None = None
    world_seed: int | None = None

    @classmethod
    def from_args(cls, args) -> "PlayOptions":
        record_dir = RECORDINGS if args.record_dir is None else Path(args.record_dir)
        if args.record_dir is not None and not record_dir.is_dir():
            raise OutputPathError(f"--record-dir {str(record_dir)!r} does not exist; create it or choose another")
        if record_dir.exists() and not record_dir.is_dir():
            raise OutputPathError(f"{str(record_dir)!r} is a file, not a folder for recordings; move it or pass "
                                  "--record-dir")
        if args.record:
            check_output_path(args.record, flag="--record", need=MIN_FREE)
        if args.save_actions:
            check_output_path(args.save_actions, suffix=Path(args.save_actions).suffix or ".jsonl", flag="--save-actions")
        if args.replay and not Path(args.replay).is_file():
            raise ValueError(f"--replay {args.replay!r} is not an action file; give a JSON-lines file "
                             "(--save-actions writes one)")
        return cls(scale=args.scale, smooth=args.smooth, target_fps=args.target_fps, video_fps=args.fps,
                   sensitivity=args.sensitivity, overlay=not args.no_overlay,
                   record=Path(args.record) if args.record else None, record_dir=record_dir,
                   save_actions=Path(args.save_actions) if args.save_actions else None,
                   replay=read_action_file(args.replay) if args.replay else None,
                   max_frames=args.max_frames, world_seed=args.world_seed)


class Game:
    def __init__(self, source, options: PlayOptions | None = None, budget=None):
        """``source``: a ``CausvidPipeline`` or a function building one on the worker thread;
        ``budget``: the worker's ``CoreBudget`` (None: threads stay as set)."""
        self.source, self.opt, self.budget = source, options or PlayOptions(), budget
        self.pipe: CausvidPipeline | None = None
        self.controls = Controls(*parse_bindings(None))
        self.overlay = "compact" if self.opt.overlay else "off"
        self.scale = self.opt.scale or 4  # the window's, once it is open
        self.mouse_moved = False  # a motion reached the game while grabbed (until then a hint shows)
        self.hud: dict[str, pygame.Rect] = {}  # what the last draw put over the view: overlay, cue, hint
        self.writer: Mp4Writer | None = None
        self.recordings: list[tuple[Path, Path | None]] = []  # (asked, written: None when empty)
        self.screenshots: list[Path] = []
        self.frame: np.ndarray | None = None
        self.last: FrameResult | None = None
        self.bias_asked: float | None = None  # a bias change sent to the worker, not yet in a frame
        self.frames_shown = 0
        self.draw_ms = collections.deque(maxlen=30)
        self.pipe_ms = collections.deque(maxlen=30)
        self.pipe_ms_total: list[float] = []
        self.clip_index = 0
        self.world_seed = self.opt.world_seed
        self._screenshot = False
        self.actions_file = None

    # -- input ---------------------------------------------------------------------------------
    def set_grab(self, on: bool):
        self.controls.grabbed = on
        pygame.event.set_grab(on)
        pygame.mouse.set_visible(not on)
        if on:
            pygame.mouse.get_rel()  # drop the jump accumulated while released

    def handle(self, event) -> bool:
        """Returns False when the game should quit."""
        if event.type == pygame.QUIT:
            return False
        if event.type in (pygame.WINDOWFOCUSLOST,):
            self.set_grab(False)
            self.controls.release_all()  # no key stays stuck while the window is away
            return True
        if event.type == pygame.MOUSEBUTTONDOWN and not self.controls.grabbed and self.opt.replay is None:
            self.set_grab(True)
        if event.type == pygame.MOUSEMOTION and self.controls.grabbed:
            self.mouse_moved = True
        if event.type == pygame.KEYDOWN and event.key in CONTROL_KEYS:
            return self.command(CONTROL_KEYS[event.key])
        if self.opt.replay is None:
            self.controls.handle(event)
        return True

    def command(self, name: str) -> bool:
        w = self.worker
        if name == "quit":
            return False
        if name == "overlay":
            self.overlay = OVERLAYS[(OVERLAYS.index(self.overlay) + 1) % len(OVERLAYS)]
        elif name == "pause":
            w.paused = not w.paused
        elif name == "step":
            w.step_once()
        elif name == "ground_truth":
            w.commands.put({"event": "ground_truth", "on": not (self.last is not None and self.last.ground_truth)})
        elif name in ("restart", "snapshot", "restore"):
            w.commands.put({"event": name})
        elif name in ("bias_down", "bias_up"):
            # from the last value asked for until a frame shows it (several presses between two frames add up)
            now = self.bias_asked if self.bias_asked is not None else (
                self.last.bias if self.last is not None else self.pipe.settings.kv_cache_attention_bias)
            bias = self.bias_asked = max(-100.0, min(100.0, now + (0.5 if name == "bias_up" else -0.5)))
            w.commands.put({"event": "bias", "value": bias})
        elif name == "next_clip":
            n = max(1, w.clip_count)
            self.clip_index = (self.clip_index + 1) % n
            w.commands.put({"event": "clip", "clip": self.clip_index})
        elif name == "new_level":
            self.world_seed = ((self.world_seed if self.world_seed is not None else -1) + 1) % 2**31
            w.commands.put({"event": "world_seed", "seed": self.world_seed})
        elif name == "grab":
            self.set_grab(not self.controls.grabbed)
        elif name == "record":
            self.toggle_recording()
        elif name in ("sensitivity_down", "sensitivity_up"):
            factor = 1.25 if name == "sensitivity_up" else 0.8
            self.controls.sensitivity = round(self.controls.sensitivity * factor, 4)
        elif name == "screenshot":
            self._screenshot = True
        return True

    # -- output --------------------------------------------------------------------------------
    def toggle_recording(self, path: Path | None = None):
        if self.writer is not None:
            writer, self.writer = self.writer, None  # cleared first: a failed close is not retried
            self.recordings.append((writer.path, writer.close()))
            return
        path = path or self.output_dir() / time.strftime("recording_%Y%m%d_%H%M%S.mp4")
        self.writer = Mp4Writer(path, fps=self.opt.video_fps, scale=self.scale, flag="--record", need=MIN_FREE)
        print(f"[owl] recording to {path} (F9 ends it)", flush=True)

    def output_dir(self) -> Path:
        """Where F9 recordings and F12 screenshots go (the default folder is made when first used)."""
        self.opt.record_dir.mkdir(exist_ok=True)
        return self.opt.record_dir

    def log(self, item):
        if self.actions_file is not None:
            self.actions_file.write(action_line(item))
            self.actions_file.flush()  # a killed session still leaves every finished line

    def consume(self, item):
        if isinstance(item, FrameResult):
            self.log((item.mouse, item.buttons))
            self.on_frame(item)
        else:
            self.log(item)

    def on_frame(self, r: FrameResult):
        self.frame, self.last = r.frame, r
        if self.bias_asked == r.bias:
            self.bias_asked = None
        self.frames_shown += 1
        self.pipe_ms.append(r.denoise_ms + r.decode_ms)
        self.pipe_ms_total.append(r.denoise_ms + r.decode_ms)
        if self.writer is not None:
            self.writer.write(r.frame)  # the game view as shown, at --scale, without the HUD

    def draw(self):
        t0 = time.perf_counter()
        size = self.screen.get_size()
        if self.frame is not None:
            surf = pygame.surfarray.make_surface(np.ascontiguousarray(self.frame.swapaxes(0, 1)))
            scale = pygame.transform.smoothscale if self.opt.smooth else pygame.transform.scale
            self.screen.blit(scale(surf, size), (0, 0))
        self.hud = {}
        if self.overlay != "off":
            self.hud["overlay"] = self.draw_box(self.overlay_lines() if self.overlay == "full" else [self.compact_line()],
                                                "top")
        busy = self.worker.busy
        if busy is not None and time.perf_counter() - busy[1] > 0.3:
            self.hud["cue"] = self.draw_box([f"{busy[0]} ...  {time.perf_counter() - busy[1]:.0f} s"], "middle")
        if (hint := self.mouse_hint()) is not None:
            self.hud["hint"] = self.draw_box([hint], "bottom")
        if self.writer is not None:
            pygame.draw.circle(self.screen, (230, 30, 30), (size[0] - 14, 14), 7)
        pygame.display.flip()
        if self._screenshot:
            self._screenshot = False
            path = self.output_dir() / f"screenshot_{self.frames_shown:06d}.png"
            pygame.image.save(self.screen, str(path))
            self.screenshots.append(path)
            print(f"[owl] screenshot {path}", flush=True)
        self.draw_ms.append((time.perf_counter() - t0) * 1000)

    def state(self) -> str:
        r = self.last
        return "PAUSED" if self.worker.paused else ("GT replay" if r is not None and r.ground_truth else "live")

    def pipeline_fps(self) -> float:
        """Frames a second the pipeline makes, over the last frames (0 before the first)."""
        return len(self.pipe_ms) * 1000 / sum(self.pipe_ms) if self.pipe_ms else 0.0

    def compact_line(self) -> str:
        r = self.last
        return (f"{self.pipeline_fps():4.1f} FPS  frame {r.index if r else 0}  "
                f"kv {self.pipe.settings.kv_cache}  "
                f"{self.state()}  {r.compile_state if r else ''}  F1 more")

    def mouse_hint(self) -> str | None:
        """Until the mouse steers: how to make it (none when replaying actions)."""
        if self.opt.replay is not None:
            return None
        if not self.controls.grabbed:
            return "mouse free: click the window or press F8 to steer"
        if not self.mouse_moved:
            return "move the mouse to look around  (click the window if it does not respond;  F8 frees it)"
        return None

    def overlay_lines(self) -> list[str]:
        mean = lambda d: sum(d) / len(d) if d else 0.0  # noqa: E731
        r = self.last
        held = [b for b, on in zip(BUTTONS, self.controls.held()) if on]
        return [
            f"FPS {self.clock.get_fps():5.1f}  pipeline {self.pipeline_fps():5.1f}",
            f"denoise {r.denoise_ms if r else 0:5.1f} ms  decode {r.decode_ms if r else 0:4.1f} ms  "
            f"draw {mean(self.draw_ms):4.1f} ms",
            f"kv {self.pipe.settings.kv_cache} {(r.kv_bytes if r else 0) / 2**20:.1f} MiB  frame {r.index if r else 0}  "
            f"epoch {r.epoch if r else 0}  bias {r.bias if r else self.pipe.settings.kv_cache_attention_bias:g}  "
            f"{self.state()}  {r.compile_state if r else ''}",
            f"mouse {r.mouse if r else [0, 0]} sens {self.controls.sensitivity:g}"
            + (f"  threads {self.budget.threads}/{self.budget.cores} (busy machine)"
               if self.budget is not None and self.budget.limited else ""),
            "held " + (" ".join(held) or "-") + ("  mouse grabbed (F8 frees it)" if self.controls.grabbed
                                                 else "  mouse free (click or F8)"),
        ]

    def fit_lines(self, texts: list[str], width: int) -> list[str]:
        """Wrap each line at its double-space field breaks so no line is wider than ``width``."""
        out = []
        for text in texts:
            line = ""
            for field in text.split("  "):
                wider = f"{line}  {field}" if line else field
                if line and self.font.size(wider)[0] > width:
                    out.append(line)
                    line = field
                else:
                    line = wider
            out.append(line)
        return out

    def draw_box(self, texts: list[str], where: str) -> pygame.Rect:
        """Lines on a translucent box at the top-left corner, the middle or the bottom of the
        view; returns the box."""
        lines = [self.font.render(t, True, (240, 240, 240)) for t in self.fit_lines(texts, self.screen.get_width() - 16)]
        h = sum(s.get_height() for s in lines) + 8
        w = max(s.get_width() for s in lines) + 12
        sw, sh = self.screen.get_size()
        x, y = (4, 4) if where == "top" else ((sw - w) // 2, (sh - h) // 2 if where == "middle" else sh - h - 4)
        box = pygame.Surface((w, h), pygame.SRCALPHA)
        box.fill((0, 0, 0, 150))
        self.screen.blit(box, (x, y))
        rect = pygame.Rect(x, y, w, h)
        for s in lines:
            self.screen.blit(s, (x + 6, y + 4))
            y += s.get_height()
        return rect

    # -- main loop -----------------------------------------------------------------------------
    def open_window(self) -> bool:
        pygame.display.init()  # video and fonts only: no audio device is needed (or probed)
        pygame.font.init()
        h, w = self.pipe.frame_shape
        # The title is set before the window exists, so it never appears untitled.
        pygame.display.set_caption(f"{self.pipe.world.name} | kv {self.pipe.settings.kv_cache} | "
                                   f"{self.pipe.settings.attn_backend} | Esc quits, F1 overlay")
        screens = pygame.display.get_desktop_sizes()
        self.scale = self.opt.scale or (window_scale((h, w), screens[0]) if screens else 4)
        try:
            self.screen = pygame.display.set_mode((w * self.scale, h * self.scale))
        except pygame.error as exc:
            print(no_display_message() + f"\n  (SDL said: {exc})")
            return False
        print(f"[owl] window {w * self.scale}x{h * self.scale} (--scale {self.scale}); F1 overlay, F8 mouse, Esc quits",
              flush=True)
        self.font = pygame.font.Font(None, 18)
        self.clock = pygame.time.Clock()
        return True

    def _wait_for_pipeline(self):
        self.worker.start()
        while not self.worker.ready.wait(0.05):
            if self.worker.error is not None:
                raise self.worker.error
        self.pipe = self.worker.pipe
        cfg = self.pipe.world.controls
        self.controls.keys, self.controls.mouse_buttons = parse_bindings(cfg.get("bindings"))
        self.controls.sensitivity = (self.opt.sensitivity if self.opt.sensitivity is not None
                                     else float(cfg.get("sensitivity", 1.0)))

    def run(self) -> int:
        self.worker = Worker(self.source, self.controls, self.opt.replay, self.opt.max_frames, self.budget)
        self.worker.paused = True  # nothing is generated before the window and outputs exist
        self._wait_for_pipeline()
        if not self.open_window():
            self.worker.stop()
            pygame.quit()
            return 2
        start, code, actions_file = time.perf_counter(), 0, None
        with StopOnSigint() as stop:  # from here on a Ctrl-C finishes the outputs it opens
            try:
                actions_file = self.actions_file = open(self.opt.save_actions, "w") if self.opt.save_actions else None
                if self.opt.record is not None:
                    self.toggle_recording(self.opt.record)
                if self.opt.replay is None:
                    self.set_grab(True)
                self.worker.paused = False
                running, last_draw = True, 0.0
                while running:
                    if stop.requested:
                        code = stop.exit_code
                        break
                    dirty = False
                    for event in pygame.event.get():
                        running = self.handle(event) and running
                        dirty = True
                    if self.worker.error is not None:
                        raise self.worker.error
                    while True:
                        try:
                            self.consume(self.worker.results.get_nowait())
                            dirty = True
                        except queue.Empty:
                            break
                    limit = self.opt.max_frames
                    if (limit is not None and self.frames_shown >= limit) or (
                            self.worker.finished and self.worker.results.empty()
                            and self.frames_shown + self.worker.dropped == self.worker.frames):
                        running = False
                    # Redraw on news (or 4x a second for the overlay): idle redraws would take CPU
                    # and the GIL from the generating thread.
                    if dirty or self._screenshot or time.perf_counter() - last_draw > 0.25:
                        self.draw()
                        last_draw = time.perf_counter()
                    self.clock.tick(self.opt.target_fps)
            except KeyboardInterrupt:
                code = stop.exit_code
            finally:
                self.worker.stop()
                self.worker.join(timeout=30)
                if self.writer is not None:
                    self.toggle_recording()
                if actions_file is not None:
                    actions_file.close()
                pygame.quit()
        wall = time.perf_counter() - start
        if self.frames_shown:
            print(f"played {self.frames_shown} frames in {wall:.1f} s: total {self.frames_shown / wall:.2f} FPS, "
                  f"{pipeline_rate([ms / 1000 for ms in self.pipe_ms_total])}, overlay {self.overlay}")
        for path, written in self.recordings:
            print(f"recorded {written}" if written is not None else f"recorded nothing to {path} (no frame was shown)")
        if actions_file is not None:
            print(f"saved actions to {self.opt.save_actions}")
        return code
