"""Headless rollouts: frame counts, Ctrl-C, bad paths and actions, profiling output."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from inference.actions import apply_event, load_actions, write_action_file
from inference.causvid_pipeline import CausvidPipeline
from inference.video import Mp4Writer, count_frames, mp4_bytes, read_frames
from owl_wms.config import load_config
from owl_wms.maze.worlds import load_level, pipeline_sim_config

from .conftest import REPO, run_main, time_limit

ENV = {k: v for k, v in os.environ.items() if not k.startswith("OWL_")}


def run(*args, env=None):
    return run_main("inference.game_cv", args, env)


def test_rollout_writes_exactly_n_h264_frames(tmp_path):
    out = tmp_path / "x.mp4"
    r = run("--headless", "--frames", "12", "--out", str(out), "--actions", "walk_turn")
    assert r.returncode == 0, r.stderr
    assert count_frames(out) == 12 and read_frames(out).shape == (12, 256, 256, 3)
    assert "world=maze-world params=" in r.stdout and "UNTRAINED" not in r.stdout  # the shipped, trained default
    assert re.search(r"pipeline [\d.]+ FPS \([\d.]+ after the first frame\), total [\d.]+ FPS", r.stdout), r.stdout
    assert not list(tmp_path.glob(".*partial*"))
    # the free-space estimate covers the video, and the same frames at --scale 1 (the densest)
    assert out.stat().st_size <= mp4_bytes(12, 256, 256)
    with Mp4Writer(tmp_path / "small.mp4", fps=15) as small:
        for frame in read_frames(out)[:, ::4, ::4]:
            small.write(frame)
    assert (tmp_path / "small.mp4").stat().st_size <= mp4_bytes(12, 64, 64)


def test_the_pipeline_rate_is_also_given_without_the_first_frame():
    """The first frame carries one-time work (with OWL_COMPILE=1 the graphs compile there), so
    the summary gives the rate from the second frame on beside the whole run's."""
    from inference.headless import pipeline_rate

    assert pipeline_rate([2.0, 0.1, 0.1, 0.05]) == "pipeline 1.78 FPS (12.00 after the first frame)"
    assert pipeline_rate([0.5]) == "pipeline 2.00 FPS"


def test_profile_lines_when_enabled(tmp_path):
    r = run("--headless", "--frames", "4", "--out", str(tmp_path / "p.mp4"),
            env={"OWL_PROFILE_KV": "1", "OWL_PROFILE_KV_FIRST": "2", "OWL_PROFILE_KV_EVERY": "100"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[KV-Profile]")]
    assert lines[0].startswith("[KV-Profile] prefill_s=")
    assert len(lines) == 3 and all("step1_ms=" in ln and "decoder_ms=" in ln for ln in lines[1:])


@pytest.mark.parametrize("decode, stop, status", [("sync", signal.SIGINT, 130), ("async", signal.SIGTERM, 143)])
def test_a_stop_signal_leaves_a_valid_mp4_and_exits_with_the_shell_s_status_for_it(tmp_path, decode, stop, status):
    """Ctrl-C (to the process group, as a terminal sends it) or SIGTERM: the frames so far are a
    valid video, every output is named in the closing line, and the exit status is 128 + the signal."""
    out, sheet = tmp_path / "long.mp4", tmp_path / "long.png"
    proc = subprocess.Popen([sys.executable, "-m", "inference.game_cv", "--headless", "--frames", "2000",
                             "--out", str(out), "--sheet", str(sheet)], cwd=REPO, env={**ENV, "OWL_DECODE": decode},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen, said = [], []  # stderr as it comes (progress), stdout; each read to its end by its own thread
    readers = [threading.Thread(target=lambda pipe=pipe, into=into: into.extend(iter(lambda: pipe.read(64), "")),
                                daemon=True) for pipe, into in ((proc.stderr, seen), (proc.stdout, said))]
    for reader in readers:
        reader.start()
    deadline = time.time() + time_limit(120)
    def progress():
        done = re.findall(r"\| *(\d+)/2000", "".join(seen))
        return int(done[-1]) if done else 0

    while time.time() < deadline and progress() < 8 and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, "".join(seen)[-3000:]
    if stop == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    else:
        proc.send_signal(stop)
    proc.wait(timeout=time_limit(60))
    for reader in readers:
        reader.join(timeout=10)
    stdout = "".join(said)
    assert proc.returncode == status, stdout + "".join(seen)
    # the background compile process (started after the first frame, maybe still importing torch)
    # leaves the Ctrl-C to the app: no KeyboardInterrupt from it
    assert "KeyboardInterrupt" not in stdout + "".join(seen), (stdout + "".join(seen))[-3000:]
    written = int(re.search(rf"wrote {re.escape(str(out))} \((\d+) frames\), {re.escape(str(sheet))} - interrupted",
                            stdout).group(1))
    assert 8 <= written < 2000 and count_frames(out) == written and sheet.stat().st_size > 0
    assert not list(tmp_path.glob(".*partial*"))


def test_decoding_beside_the_generator_renders_the_frames_decoded_in_line(tmp_path):
    """OWL_DECODE=async: the same frames, beside the simulator, across a snapshot and its restore,
    a restart, a bias change and recomputes that re-encode decoded frames while the decoding
    thread works."""
    items = load_actions("walk_turn", 14)
    items[3:3] = [{"event": "snapshot"}]
    items[6:6] = [{"event": "restart"}]
    items[10:10] = [{"event": "bias", "value": -1.0}]
    items[13:13] = [{"event": "restore"}]
    write_action_file(tmp_path / "a.jsonl", items)
    frames = {}
    for decode in ("sync", "async"):
        r = run("--headless", "--actions", str(tmp_path / "a.jsonl"), "--beside-simulator", "--out",
                str(tmp_path / f"{decode}.mp4"), "--save-frames", str(tmp_path / f"{decode}.npy"),
                env={"OWL_DECODE": decode, "OWL_KV_RECOMPUTE_EVERY": "4", "OWL_KV_RECOMPUTE_ANCHOR": "decoded"})
        assert r.returncode == 0, r.stderr
        frames[decode] = np.load(tmp_path / f"{decode}.npy")
    assert frames["sync"].shape[0] == 14 and np.array_equal(frames["sync"], frames["async"])
    assert np.array_equal(read_frames(tmp_path / "sync.mp4"), read_frames(tmp_path / "async.mp4"))


def test_decode_flag_errors_name_the_flag_and_the_fix(tmp_path):
    r = run("--headless", "--frames", "2", "--out", str(tmp_path / "x.mp4"), env={"OWL_DECODE": "later"})
    assert r.returncode == 2 and "OWL_DECODE='later' is malformed; accepted values: sync|async" in r.stderr
    r = run("--headless", "--frames", "2", "--out", str(tmp_path / "x.mp4"),
            env={"OWL_DECODE": "async", "OWL_PROFILE_KV": "1"})
    assert r.returncode == 2 and "OWL_PROFILE_KV='1'" in r.stderr and "OWL_DECODE='async'" in r.stderr
    assert "Traceback" not in r.stderr


def test_unwritable_output_fails_before_loading(tmp_path):
    t0 = time.time()
    r = run("--headless", "--frames", "3", "--out", str(tmp_path / "no" / "such" / "dir" / "x.mp4"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "--out" in r.stderr
    assert "[owl] loading" not in r.stdout and time.time() - t0 < time_limit(60)
    r = run("--headless", "--out", str(tmp_path / "x.avi"))
    assert r.returncode == 2 and "must end in .mp4" in r.stderr


def test_action_file_round_trip_and_errors(tmp_path):
    actions = load_actions("random:3", 20)
    write_action_file(tmp_path / "a.jsonl", actions)
    assert load_actions(str(tmp_path / "a.jsonl"), None) == actions
    with pytest.raises(ValueError, match="has 20 frames of actions but 30 frames"):
        load_actions(str(tmp_path / "a.jsonl"), 30)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"mouse": [0, 0], "buttons": [0] * 10}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: buttons must be 11"):
        load_actions(str(tmp_path / "bad.jsonl"), None)
    r = run("--headless", "--actions", "nonsense", "--out", str(tmp_path / "y.mp4"))
    assert r.returncode == 2 and "neither a built-in script" in r.stderr


def test_an_action_file_longer_than_a_run_is_refused_unless_cut(tmp_path):
    from inference.actions import MAX_FRAMES

    path = tmp_path / "long.jsonl"
    write_action_file(path, [([0.0, 0.0], [0] * 11)] * (MAX_FRAMES + 1))
    with pytest.raises(ValueError, match=f"has {MAX_FRAMES + 1} frames of actions; a run makes at most {MAX_FRAMES}"):
        load_actions(str(path), None)
    assert len(load_actions(str(path), 3)) == 3


def test_action_file_drives_rollout_and_frames_are_deterministic(tmp_path):
    write_action_file(tmp_path / "a.jsonl", load_actions("random:1", 6))
    outs = []
    for name in ("a", "b"):
        r = run("--headless", "--actions", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / f"{name}.mp4"))
        assert r.returncode == 0, r.stderr
        outs.append(read_frames(tmp_path / f"{name}.mp4"))
    assert outs[0].shape[0] == 6 and np.array_equal(outs[0], outs[1])


def test_pipeline_frames_deterministic_and_controls_validated():
    frames = []
    for _ in range(2):
        pipe = CausvidPipeline.from_checkpoint(verbose=False)
        frames.append(torch.stack([pipe([1.0, 0.0], [1] + [0] * 10)[0] for _ in range(3)]))
    assert frames[0].dtype == torch.uint8 and frames[0].shape == (3, 64, 64, 3)
    assert torch.equal(frames[0], frames[1])
    with pytest.raises(ValueError, match="buttons has 10 values; expected 11"):
        pipe([0, 0], [0] * 10)
    with pytest.raises(ValueError, match="mouse has 3 values"):
        pipe([0, 0, 0], [0] * 11)


def test_ground_truth_replays_clip_actions_and_restart_repeats():
    pipe = CausvidPipeline.from_checkpoint(ground_truth=True, verbose=False)
    a = [pipe(None, None)[0] for _ in range(3)]
    assert pipe.replay.step == 3
    pipe.restart_from_buffer()
    b = [pipe(None, None)[0] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    pipe.load_clip(1)
    assert pipe.clip.name == "clip_01" and pipe.replay.step == 0


def test_ground_truth_past_the_clip_is_refused_first_or_stops_with_a_clear_error_and_keeps_the_video(tmp_path):
    from owl_wms.clips import Clip, load_clip

    from inference.causvid_pipeline import DEFAULT_CHECKPOINT
    from owl_wms.config import load_config

    model = load_config(DEFAULT_CHECKPOINT / "config.yaml").model
    src = load_clip(DEFAULT_CHECKPOINT / "clips" / "clip_00.safetensors", model.channels, model.sample_size)
    n = src.history_frames + 3
    Clip(src.latents, src.mouse[:n], src.buttons[:n], src.history_frames).save(tmp_path / "short.safetensors")
    out = tmp_path / "gt.mp4"
    r = run("--headless", "--ground-truth", "--clip", str(tmp_path / "short.safetensors"), "--frames", "5",
            "--out", str(out))
    assert r.returncode == 2 and "records 3 future actions; ask for at most --frames 3" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    # with events (a restart would replay the clip again) the run is not refused first: it stops at the end
    frame = json.dumps({"mouse": [0, 0], "buttons": [0] * 11})
    (tmp_path / "a.jsonl").write_text("\n".join([frame] * 3 + ['{"event": "bias", "value": 0.0}'] + [frame] * 2))
    r = run("--headless", "--ground-truth", "--clip", str(tmp_path / "short.safetensors"), "--actions",
            str(tmp_path / "a.jsonl"), "--out", str(out))
    assert r.returncode == 2 and "records 3 future actions" in r.stderr and "Traceback" not in r.stderr
    assert "(3 frames) - stopped by an error" in r.stdout and count_frames(out) == 3


def test_fresh_levels_come_from_the_simulator_the_world_was_trained_on(tmp_path):
    """A world whose config says ``simulator: {corridor: 2}`` starts --world-seed levels, and
    the evaluation's episodes, in that maze (its history encodes the wide maze's frames)."""
    import shutil

    from owl_wms.maze.data import rollout_episode
    from owl_wms.maze.evaluation import Episode, replay

    ckpt = tmp_path / "wide"
    shutil.copytree(REPO / "checkpoints" / "untrained-tiny", ckpt)
    with open(ckpt / "config.yaml", "a") as f:
        f.write("simulator:\n  corridor: 2\n")
    pipe = CausvidPipeline.from_checkpoint(ckpt, verbose=False)
    assert pipeline_sim_config(pipe).corridor == 2 and (pipeline_sim_config(pipe).height, pipeline_sim_config(pipe).width) == pipe.frame_shape
    clip = load_level(pipe, 3, future=4)
    wide, _, _ = rollout_episode(3, pipe.window, config=pipeline_sim_config(pipe))
    narrow, _, _ = rollout_episode(3, pipe.window)
    assert torch.equal(clip.latents, pipe.decoder.encode_uint8(wide))
    assert not torch.equal(clip.latents, pipe.decoder.encode_uint8(narrow))
    ep = Episode(pipe, 3, 4)
    assert np.array_equal(ep.frames[:pipe.window], wide)
    assert replay(ep, 5).grid.shape == (22, 22)  # the turn diagnostic replays the same wide level


def test_world_seed_starts_from_a_fresh_simulator_level(tmp_path):
    pipe = CausvidPipeline.from_checkpoint(verbose=False)
    clip = load_level(pipe, 3, future=40)
    assert clip.name == "world-3" and clip.latents.shape == (pipe.window, pipe.cfg.channels, 8, 8) and clip.future_mouse.shape == (40, 2)
    a = pipe([0, 0], [0] * 11)[0]
    load_level(pipe, 4, future=40)
    assert not torch.equal(a, pipe([0, 0], [0] * 11)[0])
    r = run("--headless", "--world-seed", "3", "--frames", "4", "--out", str(tmp_path / "w.mp4"))
    assert r.returncode == 0, r.stderr
    assert count_frames(tmp_path / "w.mp4") == 4


def wide_tiny_checkpoint(tmp_path):
    """The untrained tiny checkpoint in a world of 2-unit corridors (its clips record no level)."""
    import shutil

    ckpt = tmp_path / "wide"
    shutil.copytree(REPO / "checkpoints" / "untrained-tiny", ckpt)
    with open(ckpt / "config.yaml", "a") as f:
        f.write("simulator:\n  corridor: 2\n")
    return ckpt


def test_the_simulator_plays_on_beside_the_model_from_the_same_level(tmp_path):
    """--beside-simulator: the left view is the simulator's frame under the controls the model's
    frame used (the level's recorded ones in ground-truth mode), exactly the episode's next frames;
    a restart and a snapshot/restore move it with the pipeline."""
    from owl_wms.maze.data import rollout_episode

    from inference.headless import SimulatorBeside

    pipe = CausvidPipeline.from_checkpoint(wide_tiny_checkpoint(tmp_path), ground_truth=True, verbose=False)
    load_level(pipe, 3, future=6)
    real, _, _ = rollout_episode(3, pipe.window + 6, config=pipeline_sim_config(pipe))  # the level's recorded episode
    beside = SimulatorBeside(pipe)
    h, w = pipe.frame_shape

    def step():
        model = pipe(None, None)[0].numpy()
        out = beside.frame(beside.step(pipe.last_controls), model)
        assert out.shape == (h, 2 * w + SimulatorBeside.GAP, 3) and np.array_equal(out[:, -w:], model)
        assert not out[:, w:w + SimulatorBeside.GAP].any()
        return out[:, :w]

    assert all(np.array_equal(step(), real[pipe.window + k]) for k in range(2))
    for name in ("snapshot", "restart"):
        apply_event(pipe, {"event": name})
        beside.handle({"event": name})
    assert np.array_equal(step(), real[pipe.window])  # back to the end of the history
    for name in ("restore",):
        apply_event(pipe, {"event": name})
        beside.handle({"event": name})
    assert np.array_equal(step(), real[pipe.window + 2])  # on from the snapshot (after two frames)


def test_clips_record_their_level_and_the_cli_puts_the_simulator_beside(tmp_path):
    from owl_wms.clips import Clip, load_clip

    from inference.headless import SimulatorBeside

    ckpt = wide_tiny_checkpoint(tmp_path)
    pipe = CausvidPipeline.from_checkpoint(ckpt, verbose=False)
    clip = load_level(pipe, 5, future=3)
    assert clip.level == {"seed": 5, "simulator": {**clip.level["simulator"], "corridor": 2}}
    clip.save(tmp_path / "level.safetensors")
    assert load_clip(tmp_path / "level.safetensors", pipe.cfg.channels, pipe.cfg.sample_size).level == clip.level
    Clip(clip.latents, clip.mouse, clip.buttons, clip.history_frames).save(tmp_path / "bare.safetensors")
    pipe.load_clip(load_clip(tmp_path / "bare.safetensors", pipe.cfg.channels, pipe.cfg.sample_size))
    with pytest.raises(ValueError, match="does not record the simulator level"):
        SimulatorBeside(pipe)

    out, sheet = tmp_path / "beside.mp4", tmp_path / "beside.png"
    r = run("--checkpoint", str(ckpt), "--headless", "--beside-simulator", "--clip", str(tmp_path / "level.safetensors"),
            "--frames", "3", "--scale", "1", "--out", str(out), "--sheet", str(sheet), "--save-frames", str(tmp_path / "m.npy"))
    assert r.returncode == 0, r.stderr
    video = read_frames(out)
    assert video.shape == (3, 64, 2 * 64 + SimulatorBeside.GAP, 3)
    # the contact sheet: frames 0 and 2 (--sheet-every 2), the simulator's row above the model's, exactly
    import matplotlib.pyplot as plt

    picture = (plt.imread(sheet)[..., :3] * 255).round().astype(np.uint8)
    model = np.load(tmp_path / "m.npy")
    assert picture.shape == (2 * 64, 2 * 64, 3)
    assert np.array_equal(picture[64:, :64], model[0]) and np.array_equal(picture[64:, 64:], model[2])
    def far(a, b):  # the video is H.264: near the sheet's simulator frames, not exact
        return np.abs(a.astype(int) - b).mean()

    assert far(picture[:64, :64], video[0, :, :64]) < 8 and far(picture[:64, 64:], video[2, :, :64]) < 8
    r = run("--checkpoint", str(ckpt), "--headless", "--frames", "1", "--out", str(out), "--sheet", str(tmp_path / "s.jpg"))
    assert r.returncode == 2 and "--sheet" in r.stderr and "must end in .png" in r.stderr
    r = run("--checkpoint", str(ckpt), "--headless", "--beside-simulator", "--clip", str(tmp_path / "bare.safetensors"),
            "--frames", "3", "--out", str(tmp_path / "bare.mp4"))
    assert r.returncode == 2 and "does not record the simulator level" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*bare*.mp4"))
    r = run("--beside-simulator")
    assert r.returncode == 2 and "add --headless" in r.stderr


def test_shipped_clips_record_their_level_so_the_simulator_plays_beside():
    from owl_wms.maze.data import rollout_episode

    from inference.headless import SimulatorBeside
    from scripts.export_checkpoint import CLIP_SEED

    pipe = CausvidPipeline.from_checkpoint(ground_truth=True, verbose=False)  # clip 0 of the shipped world
    assert pipe.clip.level["seed"] == CLIP_SEED and pipe.clip.level["simulator"]["corridor"] == pipeline_sim_config(pipe).corridor
    real, _, _ = rollout_episode(CLIP_SEED, pipe.window + 2, config=pipeline_sim_config(pipe))
    beside = SimulatorBeside(pipe)
    for k in range(2):
        model = pipe(None, None)[0].numpy()
        out = beside.frame(beside.step(pipe.last_controls), model)
        assert np.array_equal(out[:, :real.shape[2]], real[pipe.window + k])


def test_bench_pipeline_measures_each_checkpoint_in_one_run(capsys):
    from scripts import bench_pipeline

    tiny, world = REPO / "checkpoints" / "untrained-tiny", REPO / "checkpoints" / "maze-world"
    bench_pipeline.main(["--skip-prod", "--frames", "2", "--warmup", "1", "--prefill-rounds", "1",
                         "--checkpoint", str(tiny), "--checkpoint", str(world)])
    out = capsys.readouterr().out
    cfg = load_config(world / "config.yaml")
    for name in (f"{tiny} (", f"{world} (maze-world, d_model {cfg.model.d_model}, window {cfg.pipeline.window_frames})"):
        # denoise+decode, denoise only and 2 prefill rows, each as measured and in the table
        assert out.count(name) == 8, out
    bench_pipeline.main(["--skip-prod", "--frames", "2", "--warmup", "1", "--prefill-rounds", "1",
                         "--checkpoint", str(tiny), "--compare-backends"])
    out = capsys.readouterr().out
    assert out.count(f"{tiny} (") == 12 and out.count("(alternating)") == 4, out
    assert re.search(r"\(FlexAttention / SDPA: \d+\.\d+x\)", out), out
