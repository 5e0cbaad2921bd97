"""The one-command recipe (scripts/world_gpu.sh) and the pieces it adds to the training chain:
episodes rendered by several processes, a wall-clock training budget, a contact sheet of any length."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO, time_limit


def test_workers_render_the_episodes_one_process_renders(tmp_path):
    """--workers 2 writes the files --workers 1 writes, with each action's wall distance."""
    from scripts import generate_data

    for workers in (1, 2):
        generate_data.main(["--out", str(tmp_path / f"w{workers}"), "--episodes", "3", "--frames", "10", "--seed", "11",
                            "--policy", "turns", "--corridor", "2", "--workers", str(workers)])
    for level in range(11, 14):
        one, two = (load_file(str(tmp_path / f"w{w}" / f"ep_{level:06d}.safetensors")) for w in (1, 2))
        assert one.keys() == two.keys() == {"frames", "mouse", "buttons", "wall_ahead"}
        assert all(torch.equal(one[k], two[k]) for k in one)
        assert one["wall_ahead"].shape == (10,) and (one["wall_ahead"] > 0).all()
    with pytest.raises(SystemExit):
        generate_data.main(["--out", str(tmp_path / "bad"), "--workers", "0"])


def test_step_budget_fits_the_steps_left_at_the_measured_pace(monkeypatch):
    from scripts import train_world

    now = [100.0]
    monkeypatch.setattr(train_world.time, "time", lambda: now[0])
    budget = train_world.StepBudget(60.0, start_step=0, warm=2, timed=4)
    now[0] += 10  # the compile, in the untimed steps
    assert budget.fit(1, 1000) is None
    assert budget.fit(2, 1000) is None
    for step in (3, 4, 5):
        now[0] += 0.5
        assert budget.fit(step, 1000) is None
    now[0] += 0.5
    assert budget.fit(6, 1000) == 6 + int((60 - 12) / 0.5)  # 12 s spent, 0.5 s a step
    assert budget.per_step == 0.5 and budget.fit(7, 1000) is None  # fitted once
    assert train_world.StepBudget(60.0, 0, 2, 4).fit(6, 1000) == 1000  # no time taken: the cap
    tight = train_world.StepBudget(1.0, 0, 2, 4)
    now[0] += 5
    tight.fit(2, 1000)
    assert tight.fit(6, 1000) == 6  # the budget is spent: stop here


def test_train_world_spends_its_seconds_and_ends_its_schedule_there(tmp_path, capsys):
    from scripts import generate_data, encode_latents, train_world

    generate_data.main(["--out", str(tmp_path / "data"), "--episodes", "2", "--frames", "12", "--seed", "3",
                        "--policy", "turns"])
    encode_latents.main(["--data", str(tmp_path / "data"), "--vae", str(REPO / "checkpoints/maze-world/vae"),
                         "--out", str(tmp_path / "latents")])
    config = tiny_config(tmp_path)
    train_world.main(["--config", str(config), "--latents", str(tmp_path / "latents"), "--out", str(tmp_path / "w"),
                      "--batch", "1", "--steps", "100000", "--seconds", "0.01", "--fp32", "--open-turn-weight", "2"])
    out = capsys.readouterr().out
    assert "--seconds 0.01:" in out and "-> 25 steps" in out
    record = json.loads((tmp_path / "w" / "train_metrics.json").read_text())
    assert record["steps"] == 25 and record["runs"][-1]["target"] == 25
    assert "--seconds 0.01" in record["runs"][-1]["options"] and "--open-turn-weight 2" in record["runs"][-1]["options"]
    with pytest.raises(SystemExit, match="--seconds 0 must be > 0"):
        train_world.main(["--config", str(config), "--latents", str(tmp_path / "latents"), "--out", str(tmp_path / "x"),
                          "--seconds", "0"])


def tiny_config(tmp_path):
    """The smooth-mouse world's config at two layers and a 6-frame window: fast on any CPU."""
    (tmp_path / "tiny.yaml").write_text(f"base: {json.dumps(str(REPO / 'configs' / 'maze_world_d128_smooth.yaml'))}\n"
                                        "model: {n_layers: 2, n_frames: 6}\npipeline: {window_frames: 6}\n")
    return tmp_path / "tiny.yaml"


def test_the_recipe_makes_checkpoints_in_pieces_in_turn_and_at_once(tmp_path):
    """scripts/world_gpu.sh at a tiny size on the CPU: data, encode, two variants trained in turn
    in two pieces (the second from the first's export, with flags of its own), each exported as a
    checkpoint that plays, with every stage timed; run again, it trains nothing more. Then two
    variants at once from the first run's world (INIT) in three pieces, the middle one with no
    flags of its own, each record keeping the whole chain."""
    config = tiny_config(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "EPISODES": "2", "FRAMES": "12", "WORKERS": "2",
           "PIECES": "1:--ema,0.9", "TRAIN_SECONDS": "1", "BATCH": "1", "COMPILE": "", "PRECISION": "--fp32",
           "CLIP_FUTURE": "8", "VARIANTS": f"open:turns:{config}:2 plain:turns:{config}:0", "LOOK": "flat",
           "TRAIN_FLAGS": "--self-rollout 2"}
    runs = [("run", env), ("run2", {**env, "TOGETHER": "1", "PIECES": "1 1:--ema,0.9",
                                     "INIT": str(tmp_path / "run" / "plain" / "checkpoint")})]
    for work, setting in runs:
        recipe = ["bash", "scripts/world_gpu.sh", str(tmp_path / work)]
        proc = subprocess.run(recipe, cwd=REPO, env=setting, capture_output=True, text=True, timeout=time_limit(600))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        times = (tmp_path / work / "times.tsv").read_text()
        assert [line.split("\t")[0] for line in times.splitlines()[3:] if not line.startswith("#")] == \
            ["data", "encode", "train", "export", "total"]
        assert "--device cpu" in times.splitlines()[0]
        records = {}
        for name in ("open", "plain"):
            ckpt = tmp_path / work / name / "checkpoint"
            assert all(f.stat().st_size <= 16 * 2**20 for f in ckpt.rglob("*") if f.is_file())
            record = records[name] = json.loads((ckpt / "world_training.json").read_text())
            assert record["data"]["options"] == {"policy": "turns", "corridor": 2, "look": "flat"}
            # a 1 s budget: the 25 steps the budget times (5 to warm up, 20 timed), or the few more it fits
            assert 25 <= record["steps"] == record["runs"][-1]["to_step"] <= 40
            assert "--self-rollout 2" in record["runs"][-1]["options"] and "--ema 0.9" in record["runs"][-1]["options"]
            # each piece fine-tunes the export of the one before; the record keeps the chain
            chain = [record]
            while chain[-1].get("base"):
                chain.append(chain[-1]["base"])
            pieces = [str(tmp_path / work / name / f"piece{k}" / "checkpoint") for k in range(len(chain) - 1)]
            expected = list(reversed(pieces)) + [None] if "INIT" not in setting else \
                list(reversed(pieces[:2])) + [setting["INIT"]] + [str(tmp_path / "run/plain/piece0/checkpoint"), None]
            assert [r["init"] for r in chain] == expected
            assert ["--ema 0.9" in r["runs"][-1]["options"] for r in chain] == \
                [True, False] + ([False, True, False] if "INIT" in setting else [])
            from inference.causvid_pipeline import CausvidPipeline

            pipe = CausvidPipeline.from_checkpoint(ckpt)
            frame, _ = pipe([4.0, 0.0], [1] + [0] * 10)
            assert frame.dtype == torch.uint8 and frame.shape == (64, 64, 3)
        assert "--open-turn-weight 2" in records["open"]["runs"][-1]["options"]
        if work == "run":  # again: every piece is done, so nothing trains further; a piece trained but
            # not exported (its export removed here) is exported again, not trained again
            first = tmp_path / work / "open" / "piece0"
            runs_before = json.loads((first / "checkpoint" / "world_training.json").read_text())["runs"]
            shutil.rmtree(first / "checkpoint")
            again = subprocess.run(recipe, cwd=REPO, env=setting, capture_output=True, text=True,
                                   timeout=time_limit(600))
            assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
            for name in ("open", "plain"):
                assert "trained already" in (tmp_path / work / name / "train.log").read_text()
                ckpt = tmp_path / work / name / "checkpoint"
                assert json.loads((ckpt / "world_training.json").read_text())["runs"] == records[name]["runs"]
            assert json.loads((first / "checkpoint" / "world_training.json").read_text())["runs"] == runs_before


@pytest.mark.parametrize("setting, named", [({"TOGETHER": "yes"}, "TOGETHER=yes"),
                                             ({"PIECES": "60 0:--self-rollout,6"}, "'0:--self-rollout,6'"),
                                             ({"PIECES": "a minute"}, "'a'"),
                                             ({"PIECES": "30:ema,0.9"}, "'30:ema,0.9'"),
                                             ({"VARIANTS": "turns:turns:configs/maze_world_d128.yaml"},
                                              "'turns:turns:configs/maze_world_d128.yaml'"),
                                             ({"INIT": "no/such/world"}, "INIT=no/such/world"),
                                             ({"INIT": "checkpoints/untrained-tiny"}, "no world_training.json")])
def test_the_recipe_names_a_bad_setting_before_any_work(tmp_path, setting, named):
    env = {**os.environ, "PYTHON": sys.executable, **setting}
    proc = subprocess.run(["bash", "scripts/world_gpu.sh", str(tmp_path / "run")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=time_limit(60))
    assert proc.returncode == 2 and named in proc.stderr and "error:" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_contact_sheet_of_any_length(tmp_path):
    """20 frames at 16 to a row: the last row holds 4 and ends in white (it used to crash)."""
    from inference.headless import save_sheet

    shown = [(np.full((8, 8, 3), i, np.uint8),) for i in range(20)]
    save_sheet(tmp_path / "s.png", shown, every=1)
    import matplotlib.image

    sheet = (matplotlib.image.imread(tmp_path / "s.png")[..., :3] * 255).round().astype(np.uint8)
    assert sheet.shape[:2] == (8 + 2 + 8, 16 * 8)
    assert sheet[10, 3 * 8, 0] == 19 and (sheet[10:, 4 * 8:] == 255).all()
    save_sheet(tmp_path / "t.png", shown[:5], every=3)  # 5 frames, every 3rd: frames 1 and 4
    assert matplotlib.image.imread(tmp_path / "t.png").shape[:2] == (8, 2 * 8)


def test_a_chain_spends_its_budget_in_pieces_that_resume_where_they_stopped(tmp_path):
    """PIECE_SECONDS: the stage running when the budget is spent is stopped with SIGINT, the piece's
    time goes in the table and the script exits 75; the next run is the next piece, from there."""
    counter = tmp_path / "count.py"  # a resumable stage: one item a quarter second, each kept at once
    counter.write_text("import pathlib, sys, time\n"
                       "done = pathlib.Path(sys.argv[1])\n"
                       "n = int(done.read_text()) if done.exists() else 0\n"
                       "while n < 12:\n"
                       "    time.sleep(0.25)\n"
                       "    n += 1\n"
                       "    done.write_text(str(n))\n")
    chain = tmp_path / "chain.sh"
    chain.write_text(f"set -euo pipefail\nPY={sys.executable}\n. {REPO}/scripts/stage_times.sh\n"
                     f"start_stage_log {tmp_path}/times.tsv\n"
                     f"stage first $PY -c 'pass'\n"
                     f"stage items $PY {counter} {tmp_path}/done\n"
                     "end_stage_log\n")
    run = lambda budget: subprocess.run(["bash", str(chain)], env={**os.environ, "PIECE_SECONDS": str(budget)},  # noqa: E731
                                        capture_output=True, text=True, timeout=120)
    first = run(2)
    assert first.returncode == 75, first.stderr
    assert "ran out in items, which saved where it was; run the same command again to resume" in first.stderr
    made = int((tmp_path / "done").read_text())
    assert 0 < made < 12
    second = run(60)
    assert second.returncode == 0, second.stderr
    assert int((tmp_path / "done").read_text()) == 12
    rows = [ln.split("\t") for ln in (tmp_path / "times.tsv").read_text().splitlines()]
    assert rows[2] == ["stage", "seconds", "piece"]
    stages = [r for r in rows[3:] if not r[0].startswith("#") and r[0] != "total"]
    assert [(r[0], r[2], r[3:]) for r in stages] == [("first", "1", []), ("items", "1", ["stopped"]),
                                                      ("first", "2", []), ("items", "2", [])]
    took = [int(r[1]) for r in rows if r[0].startswith("# piece") and r[0].endswith("took")]
    assert len(took) == 2 and 1 <= took[0] <= 4
    assert rows[-1] == ["total", str(sum(int(r[1]) for r in stages))]
    assert run(60).returncode == 0  # a finished chain run again starts a new table
    assert sum(ln.startswith("# piece") for ln in (tmp_path / "times.tsv").read_text().splitlines()) == 2


@pytest.mark.parametrize("budget", [None, "600"])
def test_a_stage_stopped_by_a_signal_ends_the_piece_and_the_next_run_goes_on(tmp_path, budget):
    """A training stage stopped by Ctrl-C saves and exits 75, with or without a piece budget (said
    to be stopped, not out of budget); its time and the piece's go in the table, and the same
    command again is the next piece."""
    flag = tmp_path / "stopped_once"
    chain = tmp_path / "chain.sh"
    chain.write_text(f"set -euo pipefail\nPY={sys.executable}\n. {REPO}/scripts/stage_times.sh\n"
                     f"start_stage_log {tmp_path}/times.tsv\n"
                     f"stage train $PY -c 'import pathlib, sys; f = pathlib.Path(sys.argv[1]); "
                     f"sys.exit(0 if f.exists() else (f.touch(), 75)[1])' {flag}\n"
                     "end_stage_log\n")
    env = {k: v for k, v in os.environ.items() if k != "PIECE_SECONDS"} | ({"PIECE_SECONDS": budget} if budget else {})
    first = subprocess.run(["bash", str(chain)], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == 75 and "train was stopped and saved where it was" in first.stderr, first.stderr
    assert "ran out" not in first.stderr  # a budget that is not spent is not blamed
    second = subprocess.run(["bash", str(chain)], env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    rows = [ln.split("\t") for ln in (tmp_path / "times.tsv").read_text().splitlines()]
    assert [r[0] for r in rows if r[0].startswith("# piece") and r[0].endswith("took")] == ["# piece 1 took", "# piece 2 took"]
    assert [(r[0], r[2], r[3:]) for r in rows[3:] if r[0] == "train"] == [("train", "1", ["stopped"]), ("train", "2", [])]


def test_ctrl_c_in_the_recipe_stops_its_training_and_the_same_command_resumes_it(tmp_path):
    """Ctrl-C while a variant trains: train_world saves and exits 75, and the recipe stops there
    (75, not a failure, and no export of a half-trained world); the same command again goes on from
    the saved step and exports the world."""
    config = tiny_config(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE": "cpu", "EPISODES": "2", "FRAMES": "12", "WORKERS": "2",
           "TRAIN_SECONDS": "8", "BATCH": "1", "COMPILE": "", "PRECISION": "--fp32", "CLIP_FUTURE": "8",
           "VARIANTS": f"solo:turns:{config}:0", "LOOK": "flat"}
    env.pop("PIECE_SECONDS", None)
    recipe = ["bash", "scripts/world_gpu.sh", str(tmp_path / "run")]
    log = tmp_path / "run" / "solo" / "train.log"
    proc = subprocess.Popen(recipe, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + time_limit(300)
    while not (log.is_file() and "loss=" in log.read_text()):  # a step done: its stop handler is in place
        assert proc.poll() is None and time.monotonic() < deadline, "the recipe ended before its training began"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=time_limit(120))
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    assert "train was stopped and saved where it was" in err and "failed" not in out + err
    world = tmp_path / "run" / "solo" / "world"
    assert (world / "train_state.pt").is_file() and not (world / "ema_core.pt").exists()
    assert not (tmp_path / "run" / "solo" / "checkpoint").exists()
    again = subprocess.run(recipe, cwd=REPO, env=env, capture_output=True, text=True, timeout=time_limit(600))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    runs = json.loads((tmp_path / "run" / "solo" / "checkpoint" / "world_training.json").read_text())["runs"]
    assert len(runs) == 2 and runs[0]["from_step"] == 0 and 0 < runs[0]["to_step"] == runs[1]["from_step"]


@pytest.mark.parametrize("frames", [48, 64])
def test_the_longer_window_configs_hold_the_shipped_model(frames):
    """configs/maze_world_d128_wN.yaml: the shipped world's model (so --init fine-tunes it) with an
    N-frame window, which sets the training clip and the pipeline's history alike."""
    from owl_wms.config import load_config

    shipped = load_config(REPO / "checkpoints" / "maze-world" / "config.yaml")
    longer = load_config(REPO / "configs" / f"maze_world_d128_w{frames}.yaml")
    assert longer.model == shipped.model and longer.pipeline.window_frames == frames
    assert load_config(REPO / "configs" / "maze_world_d128.yaml").pipeline.window_frames == 32
