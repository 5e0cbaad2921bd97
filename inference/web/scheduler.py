"""Every player's session stepped together: one thread owns the model, and each step makes the
next frame of every player who is not paused in one batched call (``Sessions.step``).

The web app's event loop never runs torch. It hands the scheduler what pages send (a player's
latest controls, its events) and gets back each frame, encoded, through the player's ``send``
(thread-safe: the app posts it to its loop). Joining, leaving and events run on the scheduler's
thread between steps, so a step never sees a session half made, and each frame uses the
controls that arrived before its step began (mouse motion summed, buttons as last held).
"""
from __future__ import annotations

import collections
import concurrent.futures
import io
import json
import queue
import re
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from owl_wms.controls import N_BUTTONS
from owl_wms.engine import CausvidPipeline
from owl_wms.engine.decode_stage import DecodeStage
from owl_wms.engine.sessions import Sessions, batch_rows
from owl_wms.maze.worlds import load_level
from owl_wms.parallel import TPError, is_collective_error

from ..actions import action_line, apply_event
from ..video import MIN_FREE, Mp4Writer, remove_quietly
from .protocol import MAX_LEVEL, MOUSE_LIMIT, Controls, Event, Hello, frame_message

MAX_PENDING_EVENTS = 16  # events a page may queue before the next step (more: a flood)
# Events that cost the model's thread a prefill or a new encoder: one per player per step, and
# each at least this long after the player's last, so one page never stalls the others' frames.
COSTLY_EVENTS = ("level", "restart", "record_start")
COSTLY_EVENT_INTERVAL_S = 2.0
MAX_WAITING_COSTLY = 2  # more costly events than this waiting: the page hears "busy" and the event is not queued
RECORDINGS_PER_PLAYER = 8  # a player's oldest recording goes when one more is done
RECORDING_NAME = re.compile(r"^owl-[A-Za-z0-9_-]{16}\.mp4$")  # what record_start names a recording (and prunes)
RECORDING_KEEP_S = 3600
SLOW_STEP_S = 1.0


def stages_broke(exc: BaseException | None) -> bool:
    """Two stages disagree or the other rank failed: no frame can be made any more."""
    return isinstance(exc, TPError) or is_collective_error(exc)


class ServerFull(Exception):
    def __init__(self, players: int, capacity: int):
        super().__init__(f"server full, {players} playing (capacity {capacity}); try again later")
        self.players, self.capacity = players, capacity


class Stopping(RuntimeError):
    """The scheduler's thread is ending: it ran nothing more, and removes every player itself."""

    def __init__(self):
        super().__init__("the server is stopping")


class PlayerError(ValueError):
    """Something one player asked for failed; only that player hears of it."""


@dataclass
class ServeOptions:
    max_sessions: int | None = None  # fixed capacity; None: measured against target_fps (up to session_limit)
    session_limit: int = 8
    target_fps: float = 10.0  # each player's frame rate the measured capacity keeps
    batched: bool = True  # False: each session its own model calls, one after another (the baseline)
    clip: int | str = 0  # where a session starts without a level: a shipped clip's index or a clip file
    world_seed: int | None = None  # or a simulator level
    quality: int = 90  # JPEG quality
    max_fps: float | None = None  # steps a second at most (None: as fast as the machine goes)
    record_dir: Path = field(default_factory=lambda: Path("recordings"))
    record_scale: int = 4
    record_fps: float = 15.0
    record_frames: int = 9000  # a recording stops and downloads after this many frames
    save_actions: Path | None = None  # each session's controls and events as an action file, and its start


class Player:
    """One page's session. The app writes what the page sends (under ``lock``); the scheduler's
    thread owns the session, its recording and its action log."""

    def __init__(self, number: int, seed: int, level: int | None, clip, fmt: str, send):
        self.number, self.seed, self.level, self.clip, self.format, self.send = number, seed, level, clip, fmt, send
        self.lock = threading.Lock()
        self.buttons, self.dx, self.dy, self.seq = (0,) * N_BUTTONS, 0.0, 0.0, None
        self.events: collections.deque = collections.deque()
        self.paused = False
        self.pipe = None
        self.frames = 0  # frames made since the session began
        self.dropped = 0  # frames the page was too slow to take (the app counts them)
        self.recorder: Mp4Writer | None = None
        self.recordings: collections.deque = collections.deque()  # this player's finished recordings, oldest first
        self.actions = None  # the action log's file
        self.costly_at = -COSTLY_EVENT_INTERVAL_S  # when its last costly event ran (time.monotonic)

    @property
    def start(self) -> dict:
        """Where the session's history came from: a simulator level, or else the server's clip."""
        return {"level": self.level, "clip": None if self.level is not None else str(self.clip)}

    def set_controls(self, c: Controls) -> None:
        with self.lock:  # motion adds up until a step takes it; buttons are as last held
            self.dx = max(-MOUSE_LIMIT, min(MOUSE_LIMIT, self.dx + c.mouse[0]))
            self.dy = max(-MOUSE_LIMIT, min(MOUSE_LIMIT, self.dy + c.mouse[1]))
            self.buttons, self.seq = c.buttons, c.seq

    def add_event(self, event: Event) -> str:
        """Queue an event for the next step: "queued"; "busy" when too many costly events wait
        their turn already (it is dropped); "flood" when too many events wait in all."""
        with self.lock:
            if len(self.events) >= MAX_PENDING_EVENTS:
                return "flood"
            if event.name in COSTLY_EVENTS and sum(e.name in COSTLY_EVENTS for e in self.events) >= MAX_WAITING_COSTLY:
                return "busy"
            self.events.append(event)
            return "queued"

    def events_due(self) -> bool:
        """Whether the next step takes any of its events (a costly one may have to wait)."""
        with self.lock:
            return bool(self.events) and (self.events[0].name not in COSTLY_EVENTS
                                          or time.monotonic() - self.costly_at >= COSTLY_EVENT_INTERVAL_S)

    def keep_recording(self, path: Path) -> None:
        """A finished recording to download; the player's oldest past RECORDINGS_PER_PLAYER go."""
        self.recordings.append(path)
        while len(self.recordings) > RECORDINGS_PER_PLAYER:
            remove_quietly(self.recordings.popleft())

    def take_controls(self) -> tuple[list[float], list[int], int | None]:
        with self.lock:
            mouse, self.dx, self.dy = [self.dx, self.dy], 0.0, 0.0
            return mouse, list(self.buttons), self.seq

    def take_events(self) -> list[Event]:
        """The events due at this step, in order: all of them up to the first costly one that may
        run (COSTLY_EVENTS); a costly one waits while the player's last ran too recently."""
        now = time.monotonic()
        with self.lock:
            events = []
            while self.events:
                if self.events[0].name in COSTLY_EVENTS:
                    if now - self.costly_at < COSTLY_EVENT_INTERVAL_S:
                        break
                    self.costly_at = now
                    events.append(self.events.popleft())
                    break
                events.append(self.events.popleft())
            return events


def encode_image(frame: np.ndarray, fmt: str, quality: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(frame).save(buf, "PNG", compress_level=1)
    else:
        Image.fromarray(frame).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def players_at_target(step_s: dict[int, float], opt: ServeOptions) -> int:
    """How many players each get ``opt.target_fps``, by the measured seconds of a step ``step_s``
    (by padded batch size; one-by-one stepping: a player's step, once per player); 0: not even one."""
    def seconds(n):
        return step_s.get(batch_rows(n)) if opt.batched else (n * step_s[1] if 1 in step_s else None)

    return max((n for n in range(1, opt.session_limit + 1)
                if (s := seconds(n)) is not None and s * opt.target_fps <= 1), default=0)


def capacity_text(step_s: dict[int, float], opt: ServeOptions) -> str:
    """The capacity and what it keeps, from the measured ``step_s`` by batch size."""
    if opt.max_sessions:
        return f"capacity {opt.max_sessions} players"
    players = players_at_target(step_s, opt)
    if players:
        return f"capacity {players} players at {opt.target_fps:g} FPS each (--target-fps)"
    return (f"capacity 1 player: even one gets {1 / step_s[min(step_s)]:.1f} FPS, under the {opt.target_fps:g} FPS "
            "of --target-fps (a busy machine, or frames still eager)")


class Scheduler(threading.Thread):
    def __init__(self, build, options: ServeOptions, on_ready=None, log=print, on_fail=None, budget=None):
        """``build()`` -> ``Sessions`` (run on this thread: on the CPU torch's thread pool belongs
        to the thread that first runs it); ``on_ready(scheduler)`` runs here once it is built;
        ``on_fail(error)`` when the stages of a two-stage server fail (the server cannot go on);
        ``budget`` (a CoreBudget): torch's threads, re-checked before each step."""
        super().__init__(daemon=True, name="owl-serve-steps")
        self.build, self.opt, self.on_ready, self.log, self.on_fail = build, options, on_ready, log, on_fail
        self.budget = budget
        self.sessions: Sessions | None = None
        self.players: list[Player] = []  # this thread's
        self.joined = 0
        self.tasks: queue.Queue = queue.Queue()
        self.tasks_lock, self.tasks_closed = threading.Lock(), False  # closed: submit refuses at once
        self.ready, self.stopping, self.wake = threading.Event(), threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.step_s: dict[int, float] = {}  # measured seconds of a step (made and decoded) by padded batch size
        self.capacity = options.max_sessions or 1
        self.measured_with = None  # the frame call's state when the capacity was measured ("eager", "compiled" ...)
        self.frames_made, self.last_step_s = 0, 0.0
        self.stats: dict = {}  # for /healthz, replaced whole after every change
        self.frame_size: list[int] = []  # (H, W) of frames, found on this thread (torch runs here and in the stage)
        self.stage: DecodeStage | None = None  # OWL_DECODE=async: the thread that decodes and encodes frames

    # -- called from the app's thread ----------------------------------------------------------
    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on this thread between steps."""
        future = concurrent.futures.Future()
        with self.tasks_lock:
            if self.tasks_closed:  # this thread is ending: nobody would run it
                future.set_exception(Stopping())
                return future
            self.tasks.put((future, fn, args))
        self.wake.set()
        return future

    def add_player(self, hello: Hello, send) -> concurrent.futures.Future:
        """A new session for a page (``ServerFull`` past capacity)."""
        return self.submit(self._join, hello, send)

    def remove_player(self, player: Player) -> concurrent.futures.Future:
        return self.submit(self._leave, player)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def health(self) -> dict:
        """What /healthz and the status messages report (read on any thread: no torch runs)."""
        return {**self.stats, "compile": self.sessions.runner.compile_state()}

    def welcome(self, player: Player) -> dict:
        s = self.sessions
        return {"type": "welcome", "session": player.number, "seed": player.seed, **player.start, "format": player.format,
                "frame_size": self.frame_size,
                "kv": s.settings.kv.describe() if s.settings.kv_cache != "none" else "none",
                "players": len(self.players), "capacity": self.capacity}

    # -- this thread ---------------------------------------------------------------------------
    def run(self):
        try:
            self.sessions = self.build()
            # (on the CPU, torch ops on a second thread would slow this one's about twice, measured)
            self.frame_size = list(self.sessions.runner.decoder.frame_shape(self.sessions.world.model.sample_size))
            self._measure_capacity()  # first, on a quiet machine
            staged = self.sessions.stages is not None  # two stages: rank 1 makes the next step meanwhile
            if self.sessions.settings.decode == "async" or staged:  # a step's frames decode while the next is made
                self.stage = DecodeStage(self._decode_and_encode, threads=self.sessions.settings.threads if staged
                                         else self.sessions.settings.decode_threads)
            self._publish()
            if self.on_ready is not None:  # (a background compile starts with the first player, or soon)
                self.on_ready(self)
        except BaseException as exc:
            self.error = exc
            self._close_tasks()
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop()
        except BaseException as exc:  # /healthz says so (503); broken stages end the server (on_fail)
            if not stages_broke(exc):
                traceback.print_exc(file=sys.stderr)
            self.error = exc
        finally:
            if self.stage is not None:
                self.stage.close()
            broken = stages_broke(self.error)
            for player in list(self.players):
                if broken:
                    player.send({"type": "error", "code": "server_failed", "message": str(self.error), "close": True})
                    self.players.remove(player)
                else:
                    self._leave(player)
            self._close_tasks()
            if broken and self.on_fail is not None:
                self.on_fail(self.error)
            elif self.sessions is not None:
                self.sessions.shut_down()  # two stages: the generating rank stops

    def _loop(self):
        next_step = time.perf_counter()
        while not self.stopping.is_set():
            if not self.players and self.measured_with != "compiled" == self.sessions.runner.compile_state():
                self._measure_capacity()  # every compiled graph is in: measured again while nobody plays
                self._publish()
            if self.stage is not None and (not self.tasks.empty() or any(p.events_due() for p in self.players)):
                self._deliver_decoded(self.stage.drain())  # frames made before a join, leave or event go first
            self._run_tasks()
            for player in list(self.players):
                self._apply_events(player)
            stepping = [p for p in self.players if not p.paused]
            if not stepping:
                if self.stage is not None:
                    self._deliver_decoded(self.stage.drain())
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            if self.opt.max_fps:  # wait for the step's time, awake to joins, leaves and events meanwhile
                wait = next_step - time.perf_counter()
                if wait > 0:
                    self.wake.wait(min(wait, 0.05))
                    self.wake.clear()
                    continue
                next_step = max(next_step + 1 / self.opt.max_fps, time.perf_counter())
            self._step(stepping)

    def _close_tasks(self) -> None:
        """Refuse what waits and whatever is asked from now on (with ``Stopping``)."""
        with self.tasks_lock:
            self.tasks_closed = True
        self._run_tasks(refuse=Stopping())

    def _run_tasks(self, refuse: Exception | None = None):
        """Run what was asked of this thread; with ``refuse``, hand each waiter that error instead
        (nobody will run it: the thread is stopping)."""
        while True:
            try:
                future, fn, args = self.tasks.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    if refuse is not None:
                        raise refuse
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to whoever waits on it
                    future.set_exception(exc)
                    if refuse is None and stages_broke(exc):  # and the server cannot go on
                        raise

    def _open_pipe(self, seed: int):
        s = self.sessions
        if self.opt.batched:
            return s.open(seed=seed, clip=None)
        return CausvidPipeline(s.model, s.decoder, s.world, s.settings.replace(seed=seed), verbose=False,
                               weights=s.weights, runner=s.runner)

    def _close_pipe(self, pipe) -> None:
        if self.opt.batched:
            self.sessions.close(pipe)

    def _start(self, pipe, level: int | None) -> None:
        """The session's first history: a simulator level, or the server's clip."""
        if level is not None:
            load_level(pipe, level, future=0)  # only the history: a session replays no recorded future
        else:
            pipe.load_clip(self.opt.clip)

    def _frames(self, controls: dict) -> dict:
        """{pipe: uint8 frame [H, W, 3]} for {pipe: (mouse, buttons)}: one batched call a
        denoising step, or (not batched) each session's own calls in turn."""
        if self.opt.batched:
            latents = self.sessions.step(controls)
            order = list(latents)
            return dict(zip(order, self.sessions.decode([latents[p] for p in order]).numpy()))
        return {pipe: pipe.decode(pipe.generate(*c)).numpy() for pipe, c in controls.items()}

    def _measure_capacity(self) -> None:
        """Time a step at each padded batch size up to the limit: the capacity is the most players
        whose step still gives each ``target_fps`` (kept current by every step after)."""
        self.measured_with = self.sessions.runner.compile_state()
        limit = self.opt.max_sessions or self.opt.session_limit
        sizes = [n for n in (1 << i for i in range(11)) if n <= batch_rows(limit)] if self.opt.batched else [1]
        pipes = []
        try:
            for n in sizes:
                while len(pipes) < min(n, limit):
                    pipes.append(self._open_pipe(self.sessions.settings.seed))
                    self._start(pipes[-1], None)
                times = []
                for _ in range(3):  # the first step of a size warms its kernels up
                    t0 = time.perf_counter()
                    self._frames({p: ([0.0, 0.0], [0] * N_BUTTONS) for p in pipes[:n]})
                    times.append(time.perf_counter() - t0)
                self.step_s[n] = min(times[1:])
        finally:
            for pipe in pipes:
                self._close_pipe(pipe)
        self._update_capacity()
        ms = ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in self.step_s.items())
        self.log(f"[owl] serve: a step by players {ms} ({self.sessions.runner.compile_state()}); "
                 + capacity_text(self.step_s, self.opt))

    def _update_capacity(self) -> None:
        self.capacity = self.opt.max_sessions or max(1, players_at_target(self.step_s, self.opt))

    def _publish(self) -> None:
        self.stats = {"sessions": len(self.players), "capacity": self.capacity,
                      "paused": sum(p.paused for p in self.players),
                      "step_ms": {str(n): round(s * 1000, 2) for n, s in sorted(self.step_s.items())},
                      "last_step_ms": round(self.last_step_s * 1000, 2), "frames": self.frames_made,
                      "batched": self.opt.batched, "measured_with": self.measured_with,
                      "decode": self.sessions.settings.decode, "stages": 1 if self.sessions.stages is None else 2,
                      "generating_ranks": 1 if self.sessions.stages is None else self.sessions.stages.generating_ranks,
                      "threads": self.budget.threads if self.budget is not None else self.sessions.settings.threads}

    def _join(self, hello: Hello, send) -> Player:
        if len(self.players) >= self.capacity:
            raise ServerFull(len(self.players), self.capacity)
        number, self.joined = self.joined, self.joined + 1
        seed = hello.seed if hello.seed is not None else (self.sessions.settings.seed + number) % (2**63)
        level = hello.level if hello.level is not None else self.opt.world_seed
        player = Player(number, seed, level, self.opt.clip, hello.format, send)
        player.pipe = self._open_pipe(seed)
        try:
            self._start(player.pipe, level)
            if self.opt.save_actions is not None:
                self._open_action_log(player)
        except BaseException:
            self._close_pipe(player.pipe)
            raise
        self.players.append(player)
        self._publish()
        return player

    def _open_action_log(self, player: Player) -> None:
        folder = self.opt.save_actions
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"session-{player.number}"
        start = (f"--world-seed {player.level}" if player.level is not None else f"--clip {player.clip}")
        guidance = self.sessions.guidance
        guided = f"--guidance {guidance:g} " if guidance != 1 else ""
        meta = {"session": player.number, "seed": player.seed, **player.start, "settings": self.sessions.settings.describe(),
                "guidance": guidance,
                "replay": f"python -m inference.game_cv --headless --seed {player.seed} {start} {guided}"
                          f"--actions {stem}.jsonl --out session-{player.number}.mp4"}
        stem.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        player.actions = open(stem.with_suffix(".jsonl"), "w")

    def _log_action(self, player: Player, item) -> None:
        if player.actions is not None:
            player.actions.write(action_line(item))
            player.actions.flush()  # a server stopped hard still leaves every finished line

    def _leave(self, player: Player) -> None:
        if player not in self.players:
            return
        self.players.remove(player)
        self._close_pipe(player.pipe)
        player.pipe = None  # its cache row is free; the session's memory goes with the player
        if player.recorder is not None:  # the page is gone: nobody will download it
            path = player.recorder.close()
            player.recorder = None
            if path is not None:
                path.unlink(missing_ok=True)
        if player.actions is not None:
            player.actions.close()
        self._publish()

    def _apply_events(self, player: Player) -> None:
        for event in player.take_events():
            try:
                self._apply_event(player, event)
            except Exception as exc:  # this player's event failed: only this player hears of it
                if stages_broke(exc):
                    raise
                if not isinstance(exc, (PlayerError, ValueError, OSError, RuntimeError)):
                    traceback.print_exc(file=sys.stderr)
                player.send({"type": "error", "code": "event_failed", "message": f"{event.name}: {exc}"})

    def _apply_event(self, player: Player, event: Event) -> None:
        name = event.name
        if name in ("pause", "resume"):
            player.paused = name == "pause"
            player.send({"type": "state", "paused": player.paused})
            self._publish()
        elif name == "restart":
            apply_event(player.pipe, {"event": "restart"})
            self._log_action(player, {"event": "restart"})
        elif name == "level":
            level = event.level if event.level is not None else ((player.level or 0) + 1) % (MAX_LEVEL + 1)
            load_level(player.pipe, level, future=0)
            player.level = level
            self._log_action(player, {"event": "world_seed", "seed": level})
            player.send({"type": "level", "level": level})
        elif name == "record_start":
            if player.recorder is not None:
                raise PlayerError("a recording is already running; record_stop ends it")
            self.opt.record_dir.mkdir(parents=True, exist_ok=True)
            self._prune_recordings()
            player.recorder = Mp4Writer(self.opt.record_dir / f"owl-{secrets.token_urlsafe(12)}.mp4", fps=self.opt.record_fps,
                                        scale=self.opt.record_scale, flag="recording", need=MIN_FREE)
            player.send({"type": "recording", "state": "started", "limit_frames": self.opt.record_frames})
        elif name == "record_stop":
            if player.recorder is None:
                raise PlayerError("no recording is running; record_start begins one")
            self._finish_recording(player)

    def _prune_recordings(self) -> None:
        """Recordings are downloaded at once: those older than RECORDING_KEEP_S go."""
        cutoff = time.time() - RECORDING_KEEP_S
        for path in self.opt.record_dir.glob("*.mp4"):
            if RECORDING_NAME.match(path.name) and path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)

    def _finish_recording(self, player: Player) -> None:
        recorder, player.recorder = player.recorder, None
        path = recorder.close()
        if path is None:
            player.send({"type": "recording", "state": "empty", "frames": 0})
        else:
            player.keep_recording(path)
            player.send({"type": "recording", "state": "done", "frames": recorder.frames,
                         "url": f"/recordings/{path.name}"})

    def _step(self, stepping: list[Player]) -> None:
        if self.budget is not None:
            self.budget.check()
        taken = {p: p.take_controls() for p in stepping}
        controls = {p.pipe: (mouse, buttons) for p, (mouse, buttons, _) in taken.items()}
        t0 = time.perf_counter()
        try:
            if self.stage is None:
                frames = self._frames(controls)
            else:  # OWL_DECODE=async: make this step's latents; the last step's frames decode meanwhile
                latents = self._latents(controls)
                self.stage.submit(([latents[p.pipe] for p in stepping], [p.format for p in stepping]),
                                  tag=(stepping, taken, {p: p.pipe.cache_epoch for p in stepping}))
        except Exception as exc:  # the step as a whole failed: its players end, the server goes on
            if stages_broke(exc):
                raise
            traceback.print_exc(file=sys.stderr)
            for player in stepping:
                player.send({"type": "error", "code": "step_failed", "message": f"the server could not make the "
                                                                                 f"frame: {exc}", "close": True})
                self._leave(player)
            return
        seconds = time.perf_counter() - t0
        if seconds > SLOW_STEP_S:  # the players felt it: say so (a busy machine, a graph's first call)
            self.log(f"[owl] serve: a step of {len(stepping)} players took {seconds:.2f} s")
        size = batch_rows(max(self.sessions.rows[p.pipe] for p in stepping) + 1) if self.opt.batched else 1
        per = seconds if self.opt.batched else seconds / len(stepping)
        self.step_s[size] = per if size not in self.step_s else 0.8 * self.step_s[size] + 0.2 * per
        self.last_step_s, self.frames_made = seconds, self.frames_made + len(stepping)
        self._update_capacity()
        if self.stage is None:
            epochs = {p: p.pipe.cache_epoch for p in stepping}
            images = [encode_image(frames[p.pipe], p.format, self.opt.quality) for p in stepping]
            self._deliver(stepping, taken, epochs, [frames[p.pipe] for p in stepping], images)
        else:
            self._deliver_decoded(self.stage.ready())
        self._publish()

    def _latents(self, controls: dict) -> dict:
        """{pipe: latent} of one step, not yet decoded."""
        if self.opt.batched:
            return self.sessions.step(controls)
        return {pipe: pipe.generate(*c) for pipe, c in controls.items()}

    def _decode_and_encode(self, step: tuple[list, list[str]]) -> tuple:
        """On the decoding thread: (frames, images) of a step's (latents, each page's format)."""
        latents, formats = step
        frames = self.sessions.decode(latents).numpy()
        return frames, [encode_image(f, fmt, self.opt.quality) for f, fmt in zip(frames, formats)]

    def _deliver_decoded(self, decoded) -> None:
        for (stepping, taken, epochs), (frames, images) in decoded:
            self._deliver(stepping, taken, epochs, frames, images)

    def _deliver(self, stepping: list[Player], taken: dict, epochs: dict, frames, images) -> None:
        """Each player's frame of a step: its action log, its recording, its page."""
        for player, frame, image in zip(stepping, frames, images):
            if player not in self.players:  # left while its frame decoded
                continue
            mouse, buttons, seq = taken[player]
            player.frames += 1
            self._log_action(player, (mouse, buttons))
            if player.recorder is not None:
                try:
                    player.recorder.write(frame)
                    if player.recorder.frames >= self.opt.record_frames:
                        self._finish_recording(player)
                except (OSError, ValueError) as exc:
                    player.recorder = None
                    player.send({"type": "error", "code": "record_failed", "message": str(exc)})
            player.send(frame_message(image, player.frames, seq, epochs[player]))
