"""The pygame front end with SDL's dummy video driver and posted events, and one real
window under Xvfb driven by xdotool."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from inference.video import count_frames, read_frames

from .conftest import REPO, time_limit

pygame = pytest.importorskip("pygame")
E = pygame.event.Event
NO_OWL = {k: v for k, v in os.environ.items() if not k.startswith("OWL_")}


@pytest.fixture
def dummy_video(monkeypatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    monkeypatch.setenv("SDL_AUDIODRIVER", "dummy")


def test_bindings_map_keys_and_mouse_and_reject_collisions():
    from inference.play import Controls, parse_bindings

    keys, mouse = parse_bindings({"E": "q"})
    c = Controls(keys, mouse, sensitivity=2.0)
    for ev in (E(pygame.KEYDOWN, key=pygame.K_w), E(pygame.KEYDOWN, key=pygame.K_LSHIFT),
               E(pygame.KEYDOWN, key=pygame.K_q), E(pygame.KEYDOWN, key=pygame.K_e),
               E(pygame.MOUSEBUTTONDOWN, button=1), E(pygame.MOUSEMOTION, rel=(3, 1))):
        c.handle(ev)
    assert c.take() == ([0.0, 0.0], [1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0])  # motion ignored while not grabbed
    c.grabbed = True
    c.handle(E(pygame.MOUSEMOTION, rel=(3, -1)))
    c.handle(E(pygame.KEYUP, key=pygame.K_w))
    assert c.take() == ([6.0, -2.0], [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0])  # sensitivity scales the mouse only
    assert c.take()[0] == [0.0, 0.0]  # motion is consumed by the frame that used it
    with pytest.raises(ValueError, match="collides with the control key"):
        parse_bindings({"W": "f1"})
    with pytest.raises(ValueError, match="not a pygame key name"):
        parse_bindings({"W": "nokey"})
    with pytest.raises(ValueError, match="bound to both"):
        parse_bindings({"A": "w"})
    with pytest.raises(ValueError, match="unknown buttons"):
        parse_bindings({"JUMP": "j"})


class ScriptedGame:
    """A Game whose frames post events: {frame number: [events]}."""

    @staticmethod
    def make(pipe, options, script):
        from inference.play import Game

        class _Game(Game):
            def on_frame(self, r):
                super().on_frame(r)
                for ev in script.get(self.frames_shown, []):
                    pygame.event.post(ev)

        return _Game(pipe, options)


def read_lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_play_session_controls_record_and_replay_exactly(dummy_video, tmp_path):
    from inference.causvid_pipeline import CausvidPipeline
    from inference.play import PlayOptions

    pipe = CausvidPipeline.from_checkpoint(verbose=False)
    opts = PlayOptions(scale=2, record=tmp_path / "rec.mp4", record_dir=tmp_path,
                       save_actions=tmp_path / "a.jsonl", max_frames=16, sensitivity=2.0)
    key = lambda k: E(pygame.KEYDOWN, key=k)  # noqa: E731
    # The generating thread runs up to 3 frames ahead of the frames shown (2 queued, 1 waiting), and
    # a posted event is read on the window's next turn: a key held from frame 1's turn to frame 8's
    # is held when frame 8 starts whatever the timing, and released before frame 16 starts.
    script = {
        1: [key(pygame.K_w), E(pygame.MOUSEMOTION, rel=(5, -2), pos=(0, 0), buttons=(0, 0, 0)), key(pygame.K_F1)],
        3: [key(pygame.K_F11), key(pygame.K_F5), key(pygame.K_F12)],
        5: [key(pygame.K_F6)],
        8: [E(pygame.KEYUP, key=pygame.K_w)],
        9: [key(pygame.K_F4)],
        12: [key(pygame.K_F4)],
    }
    game = ScriptedGame.make(pipe, opts, script)
    assert game.run() == 0
    lines = read_lines(tmp_path / "a.jsonl")
    frames = [x for x in lines if "mouse" in x]
    events = [x["event"] for x in lines if "event" in x]
    assert len(frames) == 16 and game.frames_shown == 16
    assert any(f["mouse"] == [10.0, -4.0] for f in frames)  # motion x sensitivity 2, once
    assert any(f["buttons"][0] == 1 for f in frames) and frames[-1]["buttons"][0] == 0
    assert events == ["restart", "clip", "ground_truth", "ground_truth"]
    assert game.overlay == "full" and game.controls.sensitivity == 2.5  # F1: compact -> full
    shot = game.screenshots[0]
    assert shot.is_file() and pygame.image.load(str(shot)).get_size() == (128, 128)
    assert count_frames(tmp_path / "rec.mp4") == 16
    # the saved actions (with their events) re-render headless to the very same frames
    r = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--actions",
                        str(tmp_path / "a.jsonl"), "--scale", "2", "--out", str(tmp_path / "replay.mp4")],
                       cwd=REPO, env=NO_OWL, capture_output=True, text=True, timeout=time_limit(300))
    assert r.returncode == 0, r.stderr
    assert np.array_equal(read_frames(tmp_path / "rec.mp4"), read_frames(tmp_path / "replay.mp4"))


def test_pause_step_and_replay_in_the_window(dummy_video, tmp_path):
    from inference.actions import load_actions, write_action_file
    from inference.causvid_pipeline import CausvidPipeline
    from inference.play import Game, PlayOptions

    write_action_file(tmp_path / "in.jsonl", load_actions("random:2", 6))
    opts = PlayOptions(scale=1, record=tmp_path / "win.mp4", record_dir=tmp_path,
                       replay=load_actions(str(tmp_path / "in.jsonl"), None))
    game = Game(CausvidPipeline.from_checkpoint(verbose=False), opts)
    assert game.run() == 0 and game.frames_shown == 6  # the replay ends the session
    r = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--actions",
                        str(tmp_path / "in.jsonl"), "--scale", "1", "--out", str(tmp_path / "head.mp4")],
                       cwd=REPO, env=NO_OWL, capture_output=True, text=True, timeout=time_limit(300))
    assert r.returncode == 0 and np.array_equal(read_frames(tmp_path / "win.mp4"), read_frames(tmp_path / "head.mp4"))

    pause = {1: [E(pygame.KEYDOWN, key=pygame.K_F9), E(pygame.KEYDOWN, key=pygame.K_F2)]}
    game = ScriptedGame.make(CausvidPipeline.from_checkpoint(verbose=False),
                             PlayOptions(scale=1, max_frames=50, record_dir=tmp_path), pause)
    import threading

    def unpause_later():
        time.sleep(1.0)
        game.settled_frames = game.worker.frames  # frames already in flight when F2 was read
        time.sleep(1.0)
        game.paused_frames = game.worker.frames
        game.worker.step_once()
        time.sleep(1.0)
        game.stepped_frames = game.worker.frames
        pygame.event.post(E(pygame.KEYDOWN, key=pygame.K_ESCAPE))

    threading.Thread(target=unpause_later, daemon=True).start()
    assert game.run() == 0
    assert game.paused_frames == game.settled_frames <= 8  # paused: nothing new in a whole second
    assert game.stepped_frames == game.paused_frames + 1
    # F9 started a recording; quitting with Esc finalised it (frames already queued when F9
    # was read were shown before it, so the count is up to frames_shown - 1)
    ((_, rec),) = game.recordings
    assert rec.parent == tmp_path and 1 <= count_frames(rec) <= game.frames_shown - 1


def test_the_window_decoding_beside_the_generator_records_the_frames_decoded_in_line(dummy_video, tmp_path):
    """OWL_DECODE=async in the window: the recording holds the frames a headless run decoding in
    line makes from the same actions, a restart and a bias change among them."""
    from inference.actions import load_actions, write_action_file
    from inference.causvid_pipeline import CausvidPipeline
    from inference.play import Game, PlayOptions
    from owl_wms.config import load_world
    from owl_wms.loading import SHIPPED_WORLD
    from owl_wms.settings import Settings

    items = load_actions("random:4", 10)
    items[3:3] = [{"event": "restart"}]
    items[7:7] = [{"event": "bias", "value": -0.5}]
    write_action_file(tmp_path / "in.jsonl", items)
    settings = Settings.from_config(load_world(SHIPPED_WORLD).inference).replace(decode="async", compile=False,
                                                                                 compile_background=False)
    pipe = CausvidPipeline.from_checkpoint(settings=settings, verbose=False)
    game = Game(pipe, PlayOptions(scale=1, record=tmp_path / "win.mp4", record_dir=tmp_path,
                                  save_actions=tmp_path / "saved.jsonl",
                                  replay=load_actions(str(tmp_path / "in.jsonl"), None)))
    assert game.run() == 0 and game.frames_shown == 10
    # the saved actions, events in place, are the script: each event after the frames made before it
    assert read_lines(tmp_path / "saved.jsonl") == read_lines(tmp_path / "in.jsonl")
    r = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--actions",
                        str(tmp_path / "in.jsonl"), "--scale", "1", "--out", str(tmp_path / "head.mp4")],
                       cwd=REPO, env={**NO_OWL, "OWL_COMPILE": "0"}, capture_output=True, text=True,
                       timeout=time_limit(300))
    assert r.returncode == 0, r.stderr
    assert np.array_equal(read_frames(tmp_path / "win.mp4"), read_frames(tmp_path / "head.mp4"))


def test_ctrl_c_in_the_window_leaves_valid_recording_and_actions(tmp_path):
    import re
    import signal

    env = {**NO_OWL, "SDL_VIDEODRIVER": "dummy"}
    proc = subprocess.Popen([sys.executable, "-m", "inference.game_cv", "--record", str(tmp_path / "r.mp4"),
                             "--save-actions", str(tmp_path / "r.jsonl"), "--max-frames", "100000"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    def frames_written():  # the action file is flushed after every frame
        path = tmp_path / "r.jsonl"
        return path.read_text().count('"mouse"') if path.exists() else 0

    deadline = time.time() + time_limit(120)  # a count of frames, not a sleep: a busy machine plays fewer per second
    while time.time() < deadline and frames_written() <= 5 and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=time_limit(60))
    assert proc.returncode == 130, err  # Ctrl-C stops between frames, like the headless mode
    n = int(re.search(r"played (\d+) frames", out).group(1))
    assert n > 5 and count_frames(tmp_path / "r.mp4") == n
    assert sum("mouse" in x for x in read_lines(tmp_path / "r.jsonl")) == n


@pytest.mark.parametrize("headless", [False, True], ids=["window", "headless"])
def test_ctrl_c_during_start_up_ends_at_once_and_writes_nothing(tmp_path, headless):
    """While torch imports (headless) or the model loads on the window's worker thread, a Ctrl-C
    ends the run with a line saying so: no traceback, no abort, no file."""
    import signal

    env = {**NO_OWL, "SDL_VIDEODRIVER": "dummy"}
    outputs = (["--headless", "--out", str(tmp_path / "x.mp4"), "--save-frames", str(tmp_path / "x.npy")] if headless
               else ["--record", str(tmp_path / "r.mp4"), "--save-actions", str(tmp_path / "r.jsonl")])
    proc = subprocess.Popen([sys.executable, "-m", "inference.game_cv", *outputs], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for = "[owl] starting" if headless else "[owl] loading"
    lines = []
    while not any(ln.startswith(wait_for) for ln in lines):
        line = proc.stdout.readline()
        assert line, f"the app ended before {wait_for!r}: {lines}"
        lines.append(line)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=time_limit(60))
    assert proc.returncode == 130, err
    assert "[owl] interrupted during start-up (SIGINT); nothing was written" in err
    assert "Traceback" not in err and "terminate called" not in err
    assert list(tmp_path.iterdir()) == []


def test_unwritable_record_path_fails_at_start_up(tmp_path):
    env = {**NO_OWL, "SDL_VIDEODRIVER": "dummy"}
    r = subprocess.run([sys.executable, "-m", "inference.game_cv", "--record", str(tmp_path / "no" / "x.mp4")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=time_limit(120))
    assert r.returncode == 2 and "does not exist" in r.stderr and "[owl] loading" not in r.stdout


def test_no_display_gives_a_clear_message_not_a_traceback():
    env = {k: v for k, v in NO_OWL.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER")}
    r = subprocess.run([sys.executable, "-m", "inference.game_cv"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=time_limit(120))
    assert r.returncode == 2
    assert "--headless" in r.stderr and "SDL_VIDEODRIVER" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xdotool")),
                    reason="needs Xvfb and xdotool (Debian packages xvfb, xdotool)")
def test_real_window_under_xvfb_driven_by_xdotool(tmp_path):
    from scripts.bench_play import private_display  # a free display, ready before the game starts

    xvfb, display = private_display()
    try:
        env = {**{k: v for k, v in NO_OWL.items() if k != "SDL_VIDEODRIVER"}, "DISPLAY": display}
        game = subprocess.Popen([sys.executable, "-m", "inference.game_cv", "--record", str(tmp_path / "x.mp4"),
                                 "--save-actions", str(tmp_path / "x.jsonl"), "--record-dir", str(tmp_path),
                                 "--max-frames", "90"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        xdo = lambda *a: subprocess.run(["xdotool", *a], env=env, capture_output=True, text=True)  # noqa: E731
        deadline, win = time.time() + time_limit(120), None
        # the title names the world and KV mode; the window is searched for again each time, since
        # SDL may replace the first window it maps while the game sets its display up
        while time.time() < deadline and win is None:
            if game.poll() is not None:
                pytest.fail(f"game_cv exited ({game.returncode}) before its window opened: {game.communicate()[1]}")
            titled = [w for w in xdo("search", "--classname", "game_cv").stdout.split()
                      if "kv static" in xdo("getwindowname", w).stdout]
            win = titled[0] if titled else None
            time.sleep(0.1)
        assert win is not None, "no game_cv window titled with its KV mode ('kv static') appeared"
        xdo("mousemove", "--window", win, "128", "128")  # no window manager: focus follows the pointer
        xdo("windowfocus", win)
        xdo("keydown", "w")
        for _ in range(5):
            xdo("mousemove_relative", "--", "15", "0")
            time.sleep(0.1)
        xdo("key", "F12")
        time.sleep(0.5)
        xdo("keyup", "w")
        out, err = game.communicate(timeout=time_limit(180))
        assert game.returncode == 0, err
    finally:
        xvfb.terminate()
    shots = list(tmp_path.glob("screenshot_*.png"))
    assert shots, out
    img = pygame.surfarray.array3d(pygame.image.load(str(shots[0])))
    # the window sized from Xvfb's 800x600 screen (at least 512 px), and a real picture in it
    assert img.shape[:2] == (512, 512) and img.std() > 5 and "--scale 8" in out
    lines = read_lines(tmp_path / "x.jsonl")
    assert sum("mouse" in x for x in lines) == 90 and count_frames(tmp_path / "x.mp4") == 90
    assert any(x.get("buttons", [0])[0] == 1 for x in lines)  # xdotool's W reached the pipeline
    assert any(x.get("mouse", [0, 0])[0] > 0 for x in lines)  # and so did its mouse motion
    r = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--actions",
                        str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "replay.mp4"), "--scale", "8"],
                       cwd=REPO, env=NO_OWL, capture_output=True, text=True, timeout=time_limit(300))
    assert r.returncode == 0 and np.array_equal(read_frames(tmp_path / "x.mp4"), read_frames(tmp_path / "replay.mp4"))


def test_overlay_lines_wrap_to_the_window_width():
    """The default 256-pixel window shows every overlay field: long lines wrap at their field breaks."""
    from types import SimpleNamespace

    import pygame

    from inference.play import Game

    pygame.font.init()
    font = pygame.font.SysFont("monospace", 14)
    texts = ["kv static 1.2 MiB  frame 120  epoch 3  bias -1.5  GT replay", "held W A S D"]
    lines = Game.fit_lines(SimpleNamespace(font=font), texts, 240)
    assert all(font.size(x)[0] <= 240 for x in lines) and len(lines) > len(texts)
    assert "  ".join(lines[:-1]).split() == texts[0].split() and lines[-1] == "held W A S D"


def test_recordings_and_screenshots_go_to_a_folder_made_when_first_used(dummy_video, tmp_path, monkeypatch, capsys):
    """By default F9 and F12 write into recordings/ (git-ignored), made at the first one and named
    on the console; a file in its place is refused before the window opens."""
    from inference.causvid_pipeline import CausvidPipeline
    from inference.game_cv import parse_args
    from inference.play import PlayOptions
    from inference.video import OutputPathError

    monkeypatch.chdir(tmp_path)
    # (frames to spare after the last key: a posted key is read on the window's next turn, which
    # the last frames could otherwise end before the screenshot is drawn)
    opts = PlayOptions.from_args(parse_args(["--max-frames", "8"]))
    assert opts.record_dir == Path("recordings") and not (tmp_path / "recordings").exists()
    key = lambda k: E(pygame.KEYDOWN, key=k)  # noqa: E731
    game = ScriptedGame.make(CausvidPipeline.from_checkpoint(verbose=False), opts,
                             {1: [key(pygame.K_F9)], 2: [key(pygame.K_F12)], 3: [key(pygame.K_F9)]})
    assert game.run() == 0
    out = capsys.readouterr().out
    shots, videos = sorted((tmp_path / "recordings").glob("*.png")), sorted((tmp_path / "recordings").glob("*.mp4"))
    assert len(shots) == 1 and len(videos) == 1
    assert f"[owl] screenshot {Path('recordings') / shots[0].name}" in out and f"recorded {Path('recordings')}" in out
    assert "recordings/" in (REPO / ".gitignore").read_text().split()
    for p in (tmp_path / "recordings").iterdir():
        p.unlink()
    (tmp_path / "recordings").rmdir()
    (tmp_path / "recordings").write_text("not a folder")
    with pytest.raises(OutputPathError, match="is a file, not a folder"):
        PlayOptions.from_args(parse_args([]))


def test_default_window_fits_the_screen_with_a_corner_overlay_and_says_what_it_waits_for(dummy_video, tmp_path,
                                                                                          monkeypatch):
    """Without --scale the window opens from the screen's size (SDL's dummy screen is 1024x768:
    640 px), the default overlay is a corner box over at most 15% of the view (F1: the full one,
    then none), a slow event between frames shows its cue in the middle of the view while it
    runs, and until the mouse steers a hint says how."""
    import inference.play as play
    from inference.causvid_pipeline import CausvidPipeline
    from inference.play import PlayOptions, window_scale

    assert window_scale((64, 64), (1024, 768)) == 10 and window_scale((64, 64), (1920, 1080)) == 12
    assert window_scale((64, 64), (800, 600)) == 8 and window_scale((64, 64), (100, 60)) == 1
    seen, boxes = {}, {}
    apply = play.apply_event

    def slow_event(pipe, event):  # the level loads for a while: the cue is up meanwhile
        time.sleep(0.6)
        seen[event["event"]] = game.worker.busy[0] if game.worker.busy else None
        apply(pipe, event)

    monkeypatch.setattr(play, "apply_event", slow_event)
    key = lambda k: E(pygame.KEYDOWN, key=k)  # noqa: E731

    script = {2: [key(pygame.K_F7)], 5: [key(pygame.K_F1)], 6: [key(pygame.K_F1)]}

    class Watched(play.Game):
        def on_frame(self, r):
            super().on_frame(r)
            for ev in script.get(self.frames_shown, []):
                pygame.event.post(ev)

        def draw(self):
            super().draw()
            boxes["view"] = [self.screen.get_rect()]
            for name, rect in self.hud.items():
                boxes.setdefault(self.overlay if name == "overlay" else name, []).append(rect.copy())

    game = Watched(CausvidPipeline.from_checkpoint(verbose=False), PlayOptions(max_frames=8, record_dir=tmp_path))
    assert game.run() == 0
    view = boxes["view"][0].w * boxes["view"][0].h
    assert boxes["view"][0].size == (640, 640) and game.overlay == "off"
    assert boxes["compact"] and max(r.w * r.h for r in boxes["compact"]) <= 0.15 * view
    assert all(r.topleft == (4, 4) for r in boxes["compact"])
    assert boxes["full"] and max(r.w * r.h for r in boxes["full"]) > max(r.w * r.h for r in boxes["compact"])
    assert seen["world_seed"] == "loading level 0" and boxes["cue"]  # drawn while the level loaded
    assert all(abs(r.centery - 320) <= 1 for r in boxes["cue"])
    assert boxes["hint"]  # no mouse motion reached the game: the hint stayed


def test_every_slow_step_has_its_cue():
    """What the window (in its middle) and a headless run (on its progress bar) say while it waits."""
    from inference.cues import event_cue, first_frame_cue
    from owl_wms.settings import Settings

    assert first_frame_cue(Settings(compile=True)).startswith("compiling the frame call")
    assert first_frame_cue(Settings()) == "making the first frame"
    assert event_cue({"event": "restart"}) == "restarting from the clip's history"
    assert event_cue({"event": "world_seed", "seed": 7}) == "loading level 7"
    assert event_cue({"event": "clip", "clip": 2}) == "loading clip 2"
    assert event_cue({"event": "bias", "value": 1.0}) is None  # instant: no cue
