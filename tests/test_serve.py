"""The browser server (inference/serve.py, inference/web/) over plain websockets: every hostile
message gets an error or a close with its reason while another player's frames stay its own,
admission past capacity, idle sessions, events, recordings and the server's flags."""
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from inference.web import protocol
from inference.web.protocol import ProtocolError

from .conftest import REPO, run_main, time_limit
from .servers import Player, Server

FP32 = {"OWL_DTYPE": "fp32"}
# A session's frames in a batch are its frames alone up to float rounding: the batched matmuls sum
# in another order, and the shipped int8 cache can store a value at a rounding tie one code step
# away (tests/test_sessions.py).
# A rollout compounds that rounding: in float32 on the shipped world, two pages over about 60 frames
# differed by at most 1 level on an Intel Xeon; on an AMD EPYC a frame's largest pixel difference
# reached 6 levels by frame 14, 17 by frame 72 and 27 by frame 42 (its largest 8x8 square's mean
# 16.5), while each frame's mean difference stayed under 0.45 levels. Another session's controls,
# or this one's lost, change whole frames; a wrong token changes its square from the first frame on.
DRIFT_TOLERANCE = 1.0  # uint8 levels, the mean over a frame's pixels, at every frame: the same picture
LOCAL_FRAMES = 24  # the frames held to the local bounds too, before the rollout amplifies the rounding
BLOCK = 8  # pixels: what one latent token of the shipped world decodes to
BLOCK_TOLERANCE = 12  # uint8 levels, the largest mean over a BLOCK x BLOCK square: no part of it wrong
PIXEL_TOLERANCE = 48  # uint8 levels, the largest at a pixel: no line or dot of it wrong


def assert_frames_alone(shown: dict, want: np.ndarray, what) -> None:
    """Frames ``shown`` {index: image} (index 1: the session's first) are those of a run alone,
    ``want``, within the rounding a batch may add (its matmuls sum in another order, and a
    rollout carries that on): every frame within a mean of DRIFT_TOLERANCE, and the first
    LOCAL_FRAMES also within BLOCK_TOLERANCE over any square and PIXEL_TOLERANCE at any pixel."""
    for index, image in sorted(shown.items()):
        diff = np.abs(image.astype(int) - want[index - 1].astype(int))
        h, w = diff.shape[0] // BLOCK, diff.shape[1] // BLOCK
        blocks = diff[:h * BLOCK, :w * BLOCK].reshape(h, BLOCK, w, BLOCK, -1).mean(axis=(1, 3))
        local = index > LOCAL_FRAMES or (blocks.max() <= BLOCK_TOLERANCE and diff.max() <= PIXEL_TOLERANCE)
        assert diff.mean() <= DRIFT_TOLERANCE and local, (what, index, diff.mean(), blocks.max(), diff.max())


def alone(tmp_path, seed: int, actions, frames: int, name: str, start=("--clip", "0"), extra=()) -> np.ndarray:
    """The frames a headless run of one session makes with these actions (a list or an action file)."""
    if not isinstance(actions, str):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"mouse": list(m), "buttons": list(b)}) + "\n" for m, b in actions))
        actions = str(path)
    out = tmp_path / f"{name}.npy"
    r = run_main("inference.game_cv", ["--headless", "--seed", seed, *start, *extra, "--actions", actions, "--frames", frames,
                                       "--out", tmp_path / f"{name}.mp4", "--scale", 1, "--save-frames", out], env=FP32)
    assert r.returncode == 0, r.stderr
    return np.load(out)



def play_with_a_restart(players, frames: int, restart_at: int, mouse) -> None:
    """Every page sends its controls (``mouse(i)``, W held) and reads a frame, ``frames`` times;
    the second restarts at frame ``restart_at``; then every page closes."""
    for f in range(frames):
        for i, p in enumerate(players):
            p.controls(mouse=mouse(i), buttons=(1,) + (0,) * 10)
            if i == 1 and f == restart_at:
                p.send({"type": "event", "name": "restart"})
        for p in players:
            p.next_frame()
    for p in players:
        p.close()


def assert_frames_of_runs_alone(tmp_path, players, first_seed: int, least: int, extra=()) -> None:
    """Page i (seed ``first_seed`` + i) got at least ``least`` frames, each within the tolerance
    of a headless run of its session's saved actions alone (``assert_frames_alone``; ``extra``:
    more arguments of that run)."""
    for i, p in enumerate(players):
        actions = tmp_path / "actions" / f"session-{p.welcome['session']}.jsonl"
        made = sum(1 for line in actions.read_text().splitlines() if "mouse" in line)
        assert made >= len(p.frames) >= least  # frames made while a page closed were never read
        want = alone(tmp_path, first_seed + i, str(actions), made, f"p{i}", extra=extra)
        assert_frames_alone({k: image for k, _, _, image in p.frames}, want, i)

# (message, the error code it gets) on a session that said hello
HOSTILE = [
    ("garbage", "bad_json"), ("", "bad_json"), ("{", "bad_json"), ("[]", "bad_type"), ("null", "bad_type"),
    ("42", "bad_type"), ('"text"', "bad_type"), ('{"type": 5}', "bad_type"), ('{"type": "nope"}', "bad_type"),
    ('{"no": "type"}', "bad_type"), ("[" * 3000, "bad_json"), (b"\x00\x01binary", "binary"),
    ('{"type": "hello", "version": 1}', "hello_again"),
    ('{"type": "controls", "type": "controls", "mouse": [0, 0], "buttons": [0,0,0,0,0,0,0,0,0,0,0], "seq": 1}', "bad_json"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11}, "missing_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11, "seq": 1, "extra": 1}, "unknown_field"),
    ({"type": "controls", "mouse": [1], "buttons": [0] * 11, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [1, 2, 3], "buttons": [0] * 11, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": ["a", 1], "buttons": [0] * 11, "seq": 1}, "bad_field"),
    ('{"type": "controls", "mouse": [NaN, 0], "buttons": [0,0,0,0,0,0,0,0,0,0,0], "seq": 1}', "bad_json"),
    ('{"type": "controls", "mouse": [1e999, 0], "buttons": [0,0,0,0,0,0,0,0,0,0,0], "seq": 1}', "bad_field"),
    ({"type": "controls", "mouse": [20000, 0], "buttons": [0] * 11, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [10**400, 0], "buttons": [0] * 11, "seq": 1}, "bad_field"),  # past any float
    ({"type": "controls", "mouse": [True, 0], "buttons": [0] * 11, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 10, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [2] + [0] * 10, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0.5] + [0] * 10, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [True] + [0] * 10, "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": "WASD", "seq": 1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11, "seq": -1}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11, "seq": 2**32}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11, "seq": "1"}, "bad_field"),
    ({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11, "seq": 1.5}, "bad_field"),
    ({"type": "event", "name": "explode"}, "bad_field"), ({"type": "event"}, "bad_field"),
    ({"type": "event", "name": "restart", "level": 3}, "unknown_field"),
    ({"type": "event", "name": "level", "level": -1}, "bad_field"),
    ({"type": "event", "name": "level", "level": 2**31}, "bad_field"),
    ({"type": "event", "name": "level", "level": "x"}, "bad_field"),
    ({"type": "event", "name": "record_stop"}, "event_failed"),  # nothing is recording
]


def test_the_protocol_refuses_each_hostile_message_by_name():
    for message, code in HOSTILE:
        if code in ("event_failed", "hello_again"):
            continue  # well formed; the session refuses it
        with pytest.raises(ProtocolError) as caught:
            protocol.parse(message if isinstance(message, (str, bytes)) else json.dumps(message))
        assert caught.value.code == code, (message, caught.value)
        assert len(str(caught.value)) < 300
    assert protocol.parse('{"type": "hello", "version": 1, "seed": 3, "level": 9, "format": "png"}') == \
        protocol.Hello(1, 3, 9, "png")
    c = protocol.parse('{"type": "controls", "mouse": [1.5, -2], "buttons": [1,0,0,0,0,0,0,0,0,0,1], "seq": 7}')
    assert c == protocol.Controls((1.5, -2.0), (1,) + (0,) * 9 + (1,), 7)
    assert protocol.parse('{"type": "event", "name": "level"}') == protocol.Event("level")
    frame = protocol.frame_message(b"img", 12, None, 3)
    assert protocol.read_frame(frame) == (12, None, 3, b"img")


def test_what_is_asked_of_an_ending_scheduler_is_refused_and_never_left_waiting():
    """A page that joins or leaves while the scheduler's thread ends hears ``Stopping`` at once:
    nothing it asks is left in a queue that nobody runs (its await would never end)."""
    from inference.web.scheduler import Scheduler, ServeOptions, Stopping

    building = threading.Event()

    def build():
        building.wait(5)
        raise ValueError("no world")

    scheduler = Scheduler(build, ServeOptions(max_sessions=1), log=lambda *_: None)
    scheduler.start()
    asked = [scheduler.add_player(protocol.Hello(version=protocol.VERSION), lambda item: None) for _ in range(3)]
    building.set()
    scheduler.join(5)  # nobody asks anything after it ended
    for future in asked:
        assert isinstance(future.exception(timeout=5), Stopping)
    assert isinstance(scheduler.error, ValueError)


def closed_with(player: Player, timeout: float = 30) -> tuple[int, str]:
    """Read until the server closes: (code, reason)."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            player.receive(timeout)
    return closed.value.rcvd.code, closed.value.rcvd.reason


def test_hostile_messages_get_errors_or_a_closed_reason_and_never_touch_another_player(tmp_path):
    # (6 steps a second: frames enough for the good player, cores left to the tests beside it)
    with Server("--max-sessions", 3, "--idle-timeout", 6, "--max-fps", 6, env=FP32) as server:
        good = Player(server.ws_url, seed=21, format="png")
        assert good.welcome["type"] == "welcome" and good.welcome["seed"] == 21
        playing = threading.Event()
        playing.set()

        def play():  # the good player plays on, no input, beside everything below
            while playing.is_set():
                good.next_frame()
                good.controls()

        player = threading.Thread(target=play)
        player.start()
        hostile = Player(server.ws_url, format="png")
        sent = 0
        for message, code in HOSTILE:  # a fresh session each 15: the 21st malformed message closes it
            if sent == 15:
                hostile.close()
                hostile, sent = Player(server.ws_url, format="png"), 0
            hostile.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
            sent += 1
            error = hostile.until(lambda m: m["type"] == "error")
            assert error["code"] == code, (message, error)
        hostile.close()

        # closes with a reason: a conversation not opened by hello, another version, a flood, a giant
        for first, reason in ((json.dumps({"type": "controls", "mouse": [0, 0], "buttons": [0] * 11, "seq": 1}),
                               "first message must be a hello"),
                              (json.dumps({"type": "hello", "version": 2}), "version 2 is not served"),
                              (json.dumps({"type": "hello", "version": 1.0}), "version 1.0 is not served"),
                              (json.dumps({"type": "hello", "version": 1, "level": -5}), "hello.level"),
                              (json.dumps({"type": "hello", "version": 1, "format": "ü" * 200}), "hello.format")):
            code, why = closed_with(Player(server.ws_url, first=first))
            assert code == protocol.CLOSE_PROTOCOL and reason in why, (code, why)
        foreign = connect(server.ws_url, open_timeout=30, legacy=True, origin="https://evil.example")  # another site's page
        with pytest.raises(ConnectionClosed) as closed:
            foreign.recv(timeout=30)
        assert closed.value.rcvd.code == protocol.CLOSE_PROTOCOL
        assert "a page from https://evil.example may not play here" in closed.value.rcvd.reason
        garbled = connect(server.ws_url, open_timeout=30, legacy=True)  # a text message that is not UTF-8
        garbled.send(json.dumps({"type": "hello", "version": 1}))
        garbled.send(b'\xff\xfe{"type"', text=True)
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                garbled.recv(timeout=30)
        assert closed.value.rcvd.code == 1007
        pinger = Player(server.ws_url)  # pings never reach the app: the protocol counts them
        with pytest.raises(ConnectionClosed) as closed:
            for i in range(400):
                pinger.ws.ping(str(i))
            while True:
                pinger.ws.recv(timeout=30)
        assert closed.value.rcvd.code == protocol.CLOSE_PROTOCOL and "too many pings" in closed.value.rcvd.reason
        own = Player(server.ws_url, origin=server.url)  # the server's own page
        assert own.welcome["type"] == "welcome"
        own.close()
        # a page's new levels wait their turn (one each COSTLY_EVENT_INTERVAL_S): the good player's frames go on
        leveller = Player(server.ws_url, format="png")
        for _ in range(16):
            leveller.send({"type": "event", "name": "level"})
        seen = len(good.frames)
        deadline = time.monotonic() + time_limit(8)
        while len(good.frames) < seen + 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(good.frames) >= seen + 10, "one page's queued levels stalled another player's frames"
        assert leveller.until(lambda m: m["type"] == "error")["code"] == "busy"  # past 2 waiting: not queued
        leveller.close()
        flood = Player(server.ws_url)
        try:
            for _ in range(2000):
                flood.controls()
        except ConnectionClosed:
            pass
        assert closed_with(flood) == (protocol.CLOSE_PROTOCOL, "too many messages: at most 120 a second")
        giant = Player(server.ws_url)
        giant.send(json.dumps({"type": "controls", "pad": "x" * 10_000}))
        assert closed_with(giant)[0] == 1009  # message too big, closed by the websocket layer
        idle = Player(server.ws_url)
        code, why = closed_with(idle, timeout=30)
        assert code == protocol.CLOSE_IDLE and "no message for 6 s" in why

        health = server.health()
        assert health["status"] == "ok" and health["sessions"] == 1
        playing.clear()
        player.join(60)
        good.close()
    assert "not UTF-8 (closed with 1007)" in server.output and "Traceback" not in server.output, server.output[-3000:]
    shown = {index: image for index, _, _, image in good.frames if index <= 160}  # a slow reader skips some
    assert len(shown) >= 40
    want = alone(tmp_path, 21, [([0.0, 0.0], [0] * 11)] * max(shown), max(shown), "good")
    assert_frames_alone(shown, want, "the good player")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_capacity_line_says_when_even_one_player_is_under_the_target_frame_rate():
    from inference.web.scheduler import ServeOptions, capacity_text

    opt = ServeOptions(target_fps=10.0)
    assert capacity_text({1: 0.04, 2: 0.05, 4: 0.09, 8: 0.2}, opt) == "capacity 4 players at 10 FPS each (--target-fps)"
    assert capacity_text({1: 0.04}, ServeOptions(target_fps=10.0, batched=False)) == \
        "capacity 2 players at 10 FPS each (--target-fps)"  # one by one: two steps of 40 ms fit in 100 ms
    assert capacity_text({1: 0.18, 2: 0.4}, opt).startswith(
        "capacity 1 player: even one gets 5.6 FPS, under the 10 FPS of --target-fps")
    assert capacity_text({1: 0.18}, ServeOptions(max_sessions=2)) == "capacity 2 players"


def test_past_capacity_a_player_hears_server_full_and_the_others_keep_playing():
    with Server("--max-sessions", 2) as server:
        # sockets that never say hello cost the server nothing while they wait (no busy loop)
        silent = [connect(server.ws_url, open_timeout=30, legacy=True) for _ in range(3)]
        used = cpu_seconds(server.proc.pid)
        time.sleep(3)
        assert cpu_seconds(server.proc.pid) - used < 1.0, "an idle server spun while three pages said nothing"
        for page in silent:
            page.close()
        a, b = Player(server.ws_url), Player(server.ws_url)
        assert a.welcome["capacity"] == 2 and b.welcome["players"] == 2
        c = Player(server.ws_url)
        assert c.welcome == {"type": "full", "message": "server full, 2 playing", "players": 2, "capacity": 2}
        assert closed_with(c) == (protocol.CLOSE_FULL, "server full, 2 playing")
        before = a.next_frame()[0], b.next_frame()[0]
        for _ in range(5):
            a.next_frame(), b.next_frame()
        assert a.next_frame()[0] > before[0] and b.next_frame()[0] > before[1]
        assert server.health()["sessions"] == 2
        a.close()  # a leaves: its place is free for the next player
        for _ in range(100):
            if server.health()["sessions"] == 1:
                break
            b.next_frame()
        d = Player(server.ws_url)
        assert d.welcome["type"] == "welcome" and d.next_frame()[0] == 1


def test_events_pause_restart_new_level_and_a_recording_that_downloads(tmp_path):
    with Server("--max-sessions", 1, "--save-actions", tmp_path / "actions") as server:
        p = Player(server.ws_url, seed=4, level=11)
        assert p.welcome["level"] == 11 and p.welcome["frame_size"] == [64, 64]
        epoch = p.next_frame()[2]
        p.send({"type": "event", "name": "pause"})
        assert p.until(lambda m: m["type"] == "state")["paused"] is True
        p.frames.clear()
        end = time.monotonic() + 2
        with pytest.raises(TimeoutError):
            while True:
                p.receive(timeout=max(0.01, end - time.monotonic()))
        assert len(p.frames) <= 1  # a paused session makes no frames (one made before may still arrive)
        p.send({"type": "event", "name": "resume"})
        p.next_frame()
        p.send({"type": "event", "name": "restart"})
        while p.next_frame()[2] == epoch:
            pass
        p.send({"type": "event", "name": "level", "level": 3})
        assert p.until(lambda m: m["type"] == "level")["level"] == 3
        p.send({"type": "event", "name": "record_start"})
        p.until(lambda m: m["type"] == "recording")
        p.send({"type": "event", "name": "record_start"})
        assert "already running" in p.until(lambda m: m["type"] == "error")["message"]
        for _ in range(6):
            p.next_frame()
        p.send({"type": "event", "name": "record_stop"})
        done = p.until(lambda m: m["type"] == "recording")
        assert done["state"] == "done" and done["frames"] >= 6
        with urllib.request.urlopen(server.url + done["url"], timeout=30) as r:
            video = r.read()
            assert r.headers["Content-Type"] == "video/mp4" and "attachment" in r.headers["Content-Disposition"]
        assert video[4:8] == b"ftyp"
        path = tmp_path / "rec.mp4"
        path.write_bytes(video)
        from inference.video import count_frames

        assert count_frames(path) == done["frames"]
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url + "/recordings/..%2f..%2fetc%2fpasswd", timeout=10)
        assert missing.value.code == 404
        p.close()
    log = (tmp_path / "actions" / "session-0.jsonl").read_text().splitlines()
    assert {"event": "restart"} in [json.loads(line) for line in log]
    assert {"event": "world_seed", "seed": 3} in [json.loads(line) for line in log]
    meta = json.loads((tmp_path / "actions" / "session-0.json").read_text())
    assert meta["seed"] == 4 and meta["level"] == 11 and "--world-seed 11" in meta["replay"]


def test_decoding_beside_the_model_thread_serves_each_player_the_frames_of_its_run_alone(tmp_path):
    """OWL_DECODE=async: a step's frames decode and encode on their own thread while the next
    step is made; each page still gets its session's frames, in order, a restart among them."""
    with Server("--max-sessions", 2, "--save-actions", tmp_path / "actions", env={**FP32, "OWL_DECODE": "async"}) as server:
        assert server.health()["decode"] == "async"
        players = [Player(server.ws_url, seed=30 + i, format="png") for i in range(2)]
        play_with_a_restart(players, 16, restart_at=7, mouse=lambda i: (3.0 * i, 0.0))
    for i, p in enumerate(players):
        index = [f[0] for f in p.frames]
        assert index == sorted(index) and len(set(index)) == len(index)  # in order, none twice
        assert len({f[2] for f in p.frames}) == 1 + i  # the restart started a new cache epoch
    assert_frames_of_runs_alone(tmp_path, players, 30, least=14)


def test_a_guided_server_serves_each_player_the_frames_its_replay_command_makes_alone(tmp_path):
    """--guidance 1.5: the rest call is batched like every other call, and each session's saved
    start names the guidance, so its replay command makes the frames the page got."""
    with Server("--max-sessions", 2, "--guidance", 1.5, "--save-actions", tmp_path / "actions", env=FP32) as server:
        players = [Player(server.ws_url, seed=60 + i, format="png") for i in range(2)]
        play_with_a_restart(players, 10, restart_at=4, mouse=lambda i: (4.0 - 8.0 * i, 0.0))
    for p in players:
        meta = json.loads((tmp_path / "actions" / f"session-{p.welcome['session']}.json").read_text())
        assert meta["guidance"] == 1.5 and " --guidance 1.5 " in meta["replay"]
    assert_frames_of_runs_alone(tmp_path, players, 60, least=8, extra=("--guidance", "1.5"))
    guided = np.load(tmp_path / "p0.npy")  # the first page's run alone, above
    unguided = alone(tmp_path, 60, str(tmp_path / "actions" / "session-0.jsonl"), len(guided), "unguided")
    assert np.abs(guided.astype(int) - unguided.astype(int)).mean() > 1  # the guidance changed the frames


def test_two_stages_serve_each_player_the_frames_of_its_run_alone(tmp_path):
    """``--pp 2``: rank 0 serves the pages and decodes while rank 1 makes every step's frames in
    one batched call; a player joins late, one restarts, one leaves, and the server stops cleanly."""
    with Server("--pp", 2, "--max-sessions", 3, "--save-actions", tmp_path / "actions", env=FP32,
                launch=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")) as server:
        health = server.health()
        assert health["stages"] == 2 and health["generating_ranks"] == 1 and health["capacity"] == 3
        players = [Player(server.ws_url, seed=40 + i, format="png") for i in range(2)]
        for f in range(14):
            if f == 4:
                players.append(Player(server.ws_url, seed=42, format="png"))
            for i, p in enumerate(players):
                p.controls(mouse=(2.0 * i - 1.0, 0.5), buttons=(1,) + (0,) * 10)
                if i == 1 and f == 6:
                    p.send({"type": "event", "name": "restart"})
            for p in players:
                p.next_frame()
        players[0].close()
        for f in range(3):
            for p in players[1:]:
                p.controls(mouse=(0.0, 1.0), buttons=(0, 1) + (0,) * 9)
            for p in players[1:]:
                p.next_frame()
        for p in players[1:]:
            p.close()
        server.stop()  # Ctrl-C: torchrun reports the signal it got; the ranks stop cleanly
    assert "rank 1 makes each step's frames in one batched call" in server.output
    assert not our_traceback(server.output) and "error:" not in server.output, server.output  # from neither rank
    assert_frames_of_runs_alone(tmp_path, players, 40, least=10)


def test_a_generating_stage_that_splits_the_heads_serves_each_player_the_frames_of_its_run_alone(tmp_path):
    """``--pp 2 --tp 2``: ranks 1 and 2 each hold half the heads of every batched step; a player
    restarts, and the server stops cleanly."""
    with Server("--pp", 2, "--tp", 2, "--max-sessions", 2, "--save-actions", tmp_path / "actions", env=FP32,
                launch=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3")) as server:
        health = server.health()
        assert health["stages"] == 2 and health["generating_ranks"] == 2
        players = [Player(server.ws_url, seed=50 + i, format="png") for i in range(2)]
        play_with_a_restart(players, 8, restart_at=3, mouse=lambda i: (1.0 - 2.0 * i, 0.5))
        server.stop()
    assert "ranks 1-2 (tensor parallel: each holds 1 of 2 heads) make each step's frames" in server.output, server.output
    assert not our_traceback(server.output) and "error:" not in server.output, server.output
    assert all(len({f[2] for f in p.frames}) == 1 + i for i, p in enumerate(players))  # the restart: a new epoch
    assert_frames_of_runs_alone(tmp_path, players, 50, least=6)


def our_traceback(output: str) -> list[str]:
    """The lines of ``output`` that are frames of a traceback in this project's code (torchrun's own
    report of a signal or a failed rank is its business; a virtual environment inside the checkout
    holds installed packages, not this project's code)."""
    return [line for line in output.splitlines() if f'File "{REPO}/' in line and "/site-packages/" not in line]


def rank_pid(launcher: int, rank: int) -> int:
    """The process torchrun (``launcher``) started as ``rank``."""
    import pathlib

    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher \
                    and f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                return int(proc.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no rank {rank} under process {launcher}")


def test_a_two_stage_server_whose_generating_rank_dies_closes_every_page_and_stops():
    with Server("--pp", 2, "--max-sessions", 2, env=FP32,
                launch=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")) as server:
        player = Player(server.ws_url, seed=1)
        player.controls()
        player.next_frame()
        os.kill(rank_pid(server.proc.pid, 1), signal.SIGKILL)
        closed = None
        try:
            while closed is None:
                player.controls()
                m = player.receive(timeout=30)
                if isinstance(m, dict) and m.get("type") == "error":
                    closed = m
        except ConnectionClosed:
            closed = "closed"
        assert closed == "closed" or closed["code"] == "server_failed", closed
        server.proc.wait(60)  # torchrun ends the job: no rank is left waiting
    assert "local_rank: 1" in server.output, server.output  # torchrun names the rank that died
    assert not our_traceback(server.output), server.output  # rank 0 stopped without a traceback


def test_the_servers_flags_are_checked_with_the_fix(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    r = run_main("inference.serve", ["--port", port])
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "--port 0" in r.stderr
    taken.close()
    r = run_main("inference.serve", ["--port", 0, "--checkpoint", tmp_path / "nothing"])
    assert r.returncode == 2 and "nothing" in r.stderr
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    folders = [(["--save-actions", str(a_file)], f"--save-actions {str(a_file)!r}: is a file, not a folder"),
               (["--record-dir", str(a_file / "x")], f"{str(a_file)!r} is a file, not a folder; choose another folder")]
    if not os.access(read_only, os.W_OK):  # (root may write anywhere)
        folders.append((["--record-dir", str(read_only / "r")], "is not writable"))
    for argv, text in [*folders, (["--max-sessions", "0"], "--max-sessions 0"), (["--max-sessions", "65"], "[1, 64]"),
                       (["--target-fps", "-1"], "--target-fps"),
                       (["--idle-timeout", "1e-9"], "--idle-timeout 1e-09: must be a positive number of at least 1"),
                       (["--port", "70000"], "--port 70000"), (["--pp", "3"], "--pp: invalid choice"),
                       (["--pp", "2", "--one-by-one"], "with --pp 2 rank 1 makes every step in one batched call"),
                       (["--pp", "2", "--port", "0"], "'torchrun --nproc-per-node 2 -m inference.serve --pp 2 ...'"),
                       (["--tp", "2"], "--tp 2 splits the heads of the generating stage: add --pp 2"),
                       (["--pp", "2", "--tp", "0"], "--tp 0: must be a whole number in [1, 64]"),
                       (["--pp", "2", "--tp", "2", "--port", "0"],
                        "'torchrun --nproc-per-node 3 -m inference.serve --pp 2 --tp 2 ...'")]:
        r = run_main("inference.serve", argv)
        assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, r.stderr


def page_as(server, name: str, origin: str | None):
    """A websocket to ``server`` (on 127.0.0.1) that asks for the host ``name``, as a browser
    whose page came from ``origin`` would (a name resolving to 127.0.0.1: DNS rebinding)."""
    port = int(server.url.rsplit(":", 1)[1])
    return connect(f"ws://{name}:{port}/ws", sock=socket.create_connection(("127.0.0.1", port)), open_timeout=30,
                   legacy=True, origin=origin)


def test_a_loopback_server_answers_to_loopback_names_and_the_allowed_origins_only():
    with Server("--max-sessions", 1, "--allow-origin", "https://Play.Example.org") as server:
        rebound = page_as(server, "attacker.example", "http://attacker.example")
        with pytest.raises(ConnectionClosed) as closed:
            rebound.recv(timeout=30)
        assert closed.value.rcvd.code == protocol.CLOSE_PROTOCOL
        assert "answers to localhost only, not 'attacker.example'" in closed.value.rcvd.reason
        for name, origin in (("localhost", "http://localhost"), ("play.example.org", "https://play.example.org"),
                             ("127.0.0.1", "https://play.example.org")):  # its own names, and the allowed one's page
            page = page_as(server, name, origin)
            page.send(json.dumps({"type": "hello", "version": 1}))
            assert json.loads(page.recv(timeout=30))["type"] == "welcome", (name, origin)
            page.close()
            for _ in range(100):
                if server.health()["sessions"] == 0:
                    break
                time.sleep(0.05)
    r = run_main("inference.serve", ["--allow-origin", " "])
    assert r.returncode == 2 and "--allow-origin ' ': give a host name" in r.stderr


def test_a_slow_step_rate_still_lets_players_join_and_pause_at_once():
    """--max-fps 0.05 (a step every 20 s): the model thread waits for the step awake to joins
    and events, so a second player is welcomed and a pause answered in seconds, not at the next step."""
    with Server("--max-sessions", 2, "--max-fps", 0.05) as server:
        a = Player(server.ws_url)
        a.next_frame()
        t0 = time.monotonic()
        b = Player(server.ws_url)
        assert b.welcome["type"] == "welcome" and time.monotonic() - t0 < min(15, time_limit(8))  # (a step: 20 s)
        a.send({"type": "event", "name": "pause"})
        assert a.until(lambda m: m["type"] == "state")["paused"] and time.monotonic() - t0 < min(15, time_limit(8))
        a.close(), b.close()


def test_a_players_recordings_past_the_last_few_are_removed(tmp_path):
    from inference.web.scheduler import RECORDINGS_PER_PLAYER, Player as Session

    session = Session(1, 0, None, 0, "jpeg", send=lambda message: None)
    paths = [tmp_path / f"owl-{i:016d}.mp4" for i in range(RECORDINGS_PER_PLAYER + 2)]
    for path in paths:
        path.write_bytes(b"video")
        session.keep_recording(path)
    assert [p.exists() for p in paths] == [False, False] + [True] * RECORDINGS_PER_PLAYER


def test_the_pages_keys_are_the_windows_bindings_in_browser_key_codes():
    from inference.bindings import browser_bindings

    default = browser_bindings(None)
    assert default["keys"] == {"KeyW": 0, "KeyA": 1, "KeyS": 2, "KeyD": 3, "ShiftLeft": 4, "Space": 5, "KeyR": 6,
                               "KeyF": 7, "KeyE": 8}
    assert default["mouse"] == {"0": 9, "2": 10}
    moved = browser_bindings({"E": "q", "W": "up", "RMB": "mouse2"})
    assert moved["keys"]["KeyQ"] == 8 and moved["keys"]["ArrowUp"] == 0 and moved["mouse"]["1"] == 10
    for bindings, message in (({"W": "f13"}, "controls.bindings.W='f13' has no browser key"),
                              ({"A": "w"}, "bound to both W and A"), ({"JUMP": "j"}, "unknown buttons ['JUMP']"),
                              ({"LMB": "mouse9"}, "a browser has mouse1 to mouse5")):
        with pytest.raises(ValueError, match=re.escape(message)):
            browser_bindings(bindings)
