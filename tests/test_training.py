"""Smoke tests of the training chain on tiny settings: every stage runs, resumes, and learns."""
import json
import re

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from owl_wms.config import load_config
from owl_wms.model import GameRFT
from owl_wms.maze.training.vae import build_autoencoder, vae_loss
from owl_wms.maze.training.world import flow_loss, own_history, sample_times, teacher_first_step

from .conftest import REPO


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from scripts import encode_latents, generate_data, train_vae

    root = tmp_path_factory.mktemp("chain")
    generate_data.main(["--out", str(root / "data"), "--episodes", "3", "--frames", "24", "--seed", "5"])
    train_vae.main(["--data", str(root / "data"), "--out", str(root / "vae"), "--steps", "12", "--batch", "4",
                    "--width", "8", "--held-out", "1", "--save-every", "6"])
    encode_latents.main(["--data", str(root / "data"), "--vae", str(root / "vae" / "final"),
                         "--out", str(root / "latents")])
    return root


def test_stages_write_their_outputs(chain):
    from safetensors.torch import load_file

    assert len(list((chain / "data").glob("ep_*.safetensors"))) == 3
    assert (chain / "vae" / "final" / "config.json").is_file()
    metrics = json.loads((chain / "vae" / "final" / "metrics.json").read_text())
    assert metrics["steps"] == 12 and metrics["held_out_psnr_db"] > 0
    lat = load_file(str(chain / "latents" / "ep_000005.safetensors"))
    assert lat["latents"].shape == (24, 32, 8, 8) and lat["mouse"].shape == (24, 2)
    assert json.loads((chain / "latents" / "stats.json").read_text())["vae_scale"] > 0


def test_stages_resume(chain, capsys):
    from scripts import generate_data, train_vae

    generate_data.main(["--out", str(chain / "data"), "--episodes", "3", "--frames", "24", "--seed", "5"])
    train_vae.main(["--data", str(chain / "data"), "--out", str(chain / "vae"), "--steps", "14", "--batch", "4",
                    "--width", "8", "--held-out", "1", "--save-every", "7"])
    assert "resumed at step 12" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--policy explore; this run asks for lively"):  # never mix two policies
        generate_data.main(["--out", str(chain / "data"), "--episodes", "4", "--frames", "24", "--seed", "5",
                            "--policy", "lively"])
    with pytest.raises(SystemExit, match="--corridor 1; this run asks for 2"):  # nor two mazes
        generate_data.main(["--out", str(chain / "data"), "--episodes", "4", "--frames", "24", "--seed", "5",
                            "--corridor", "2"])
    with pytest.raises(SystemExit):
        generate_data.main(["--out", str(chain / "x"), "--episodes", "1", "--corridor", "0"])
    assert "SimConfig.corridor must be a whole number >= 1, got 0" in capsys.readouterr().err
    assert not (chain / "x").exists()


@pytest.mark.parametrize("module_name, precision", [("train_world", "--fp32"), ("train_world", "--compile"),
                                                    ("train_vae", "--fp32")],
                         ids=["world fp32", "world bf16 compiled", "autoencoder fp32"])
def test_a_signal_stops_training_at_a_step_that_the_next_run_resumes_exactly(chain, tmp_path, monkeypatch, capsys,
                                                                              module_name, precision):
    """SIGINT or SIGTERM (a chain's time budget, Ctrl-C) finishes the step, saves there and exits
    with STOPPED; the resumed run ends with the weights of a run never stopped, also in the
    chain's own setting for the world (bf16 autocast, compiled blocks)."""
    import importlib
    import os
    import signal

    from torch._dynamo.utils import counters

    from owl_wms.maze.training import STOPPED

    module = importlib.import_module(f"scripts.{module_name}")
    (tmp_path / "tiny.yaml").write_text(f"base: {json.dumps(str(REPO / 'configs' / 'maze_world.yaml'))}\n"
                                        "model: {n_layers: 1, d_model: 64, n_heads: 1}\npipeline: {window_frames: 4}\n")
    if module_name == "train_world":
        step_fn, weights, stop = "train_step", "ema_core.pt", signal.SIGTERM

        def args(out):
            return ["--config", str(tmp_path / "tiny.yaml"), "--latents", str(chain / "latents"), "--out", str(out),
                    "--batch", "2", "--steps", "6", "--save-every", "100", precision]
    else:
        step_fn, weights, stop = "vae_loss", "final/diffusion_pytorch_model.safetensors", signal.SIGINT

        def args(out):
            return ["--data", str(chain / "data"), "--out", str(out), "--steps", "6", "--batch", "2", "--width", "8",
                    "--held-out", "1", "--save-every", "100", precision]

    graphs = counters["stats"]["unique_graphs"]
    module.main(args(tmp_path / "whole"))
    if precision == "--compile":  # the training windows run compiled, not only a generated frame's calls
        assert counters["stats"]["unique_graphs"] > graphs
    calls, real = [], getattr(module, step_fn)

    def signalled(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # SIGTERM for the world, SIGINT for the autoencoder: both stop cleanly
            os.kill(os.getpid(), stop)
        return real(*a, **k)

    monkeypatch.setattr(module, step_fn, signalled)
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with pytest.raises(SystemExit) as stopped:
        module.main(args(tmp_path / "pieces"))
    monkeypatch.undo()
    assert stopped.value.code == STOPPED
    assert "stopped at step 3 of 6" in capsys.readouterr().out
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # given back
    module.main(args(tmp_path / "pieces"))
    assert "resumed at step 3" in capsys.readouterr().out
    assert (tmp_path / "whole" / weights).read_bytes() == (tmp_path / "pieces" / weights).read_bytes()


def test_file_stages_keep_their_time_over_reruns(chain, tmp_path):
    """generate_data and encode_latents add each run that made files to their record; a rerun
    with nothing left to make keeps the earlier time (MODEL.md once said 0.0 min after one)."""
    from scripts import encode_latents, generate_data

    def record(path):
        rec = json.loads(path.read_text())
        return {k: rec[k] for k in ("seconds_this_run", "seconds_all_runs", "runs")}

    data, lat = tmp_path / "data", tmp_path / "latents"
    stages = [(lambda n: generate_data.main(["--out", str(data), "--episodes", str(n), "--frames", "8"]),
               data / "manifest.json"),
              (lambda n: encode_latents.main(["--data", str(data), "--vae", str(chain / "vae" / "final"),
                                              "--out", str(lat)]), lat / "stats.json")]
    # make, rerun with nothing to do, make one more, rerun again
    for n, makes in ((1, True), (1, False), (2, True), (2, False)):
        for run, path in stages:
            before = record(path) if path.is_file() else {"runs": []}
            run(n)
            after = record(path)
            assert len(after["runs"]) == len(before["runs"]) + makes, (path, n)
            if not makes:
                assert after == before, path
            assert after["seconds_all_runs"] == pytest.approx(sum(r["seconds"] for r in after["runs"]))
    for _, path in stages:
        assert [(r["from_step"], r["to_step"], r["target"]) for r in record(path)["runs"]] == [(0, 1, 1), (1, 2, 2)]


def test_decoder_only_fine_tune_keeps_the_encoder(chain, tmp_path):
    """--init ... --decoder-only trains the decoder alone: the encoder, and so the latents a world
    model learned from, stay bit-identical; the metrics keep the base run's for MODEL.md."""
    from owl_wms.vae import load_autoencoder
    from scripts import train_vae
    from scripts.export_checkpoint import chain_commands

    base = chain / "vae" / "final"
    args = ["--data", str(chain / "data"), "--init", str(base), "--batch", "4", "--held-out", "1"]
    with pytest.raises(SystemExit):
        train_vae.main(args[:2] + ["--out", str(tmp_path / "x"), "--decoder-only", "--steps", "2"])  # no --init
    train_vae.main(args + ["--decoder-only", "--out", str(tmp_path / "dec"), "--steps", "3", "--lr", "3e-3"])
    before, after = load_autoencoder(base).state_dict(), load_autoencoder(tmp_path / "dec" / "final").state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("encoder."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    metrics = json.loads((tmp_path / "dec" / "final" / "metrics.json").read_text())
    assert metrics["decoder_only"] and metrics["base"] == json.loads((base / "metrics.json").read_text())
    recipe = chain_commands({}, {"batch": 4, "steps": 8}, metrics)
    assert recipe[1].split("#")[0].strip() == f"python -m scripts.train_vae --steps {metrics['base']['steps']}"
    assert recipe[2].split("#")[0].strip() == ("python -m scripts.train_vae --init work/vae/final --decoder-only "
                                               "--out work/vae_decoder --steps 3 --lr 0.003")
    assert all("--vae work/vae_decoder/final" in c for c in recipe if "export_checkpoint" in c)
    with pytest.raises(SystemExit, match="no metrics.json"):
        chain_commands({}, {"batch": 4, "steps": 8}, {**metrics, "base": None})


def test_the_card_lists_every_training_run_of_a_chain_of_fine_tunes():
    from scripts.export_checkpoint import world_row

    def run(steps, frames, loss, seconds, base=None):
        return {"steps": steps, "batch": 4, "frames": frames, "final_loss": loss, "seconds_all_runs": seconds,
                "runs": [{}], "init": "a checkpoint" if base else None, "base": base}

    chain = run(800, 64, 0.21, 3210, run(500, 32, 0.23, 590, run(3000, 32, 0.22, 3810)))
    assert world_row(chain) == ("3000 steps x batch 4 x 32 frames, final loss 0.2200, 63.5 min in 1 run; "
                                "then 500 steps of fine-tuning x batch 4, final loss 0.2300, 9.8 min in 1 run; "
                                "then 800 steps of fine-tuning x batch 4 x 64 frames, final loss 0.2100, 53.5 min in 1 run")
    assert world_row(chain["base"]["base"]).count("then") == 0


def test_score_only_reports_the_held_out_psnr_the_training_recorded(chain, tmp_path, capsys):
    from scripts import train_vae

    final = chain / "vae" / "final"
    train_vae.main(["--data", str(chain / "data"), "--init", str(final), "--held-out", "1", "--score-only",
                    "--out", str(tmp_path / "untouched")])
    recorded = json.loads((final / "metrics.json").read_text())
    assert 0 < recorded["held_out_sharpness_ratio"] < 2
    assert (f"held-out reconstruction PSNR {recorded['held_out_psnr_db']:.2f} dB, sharpness ratio "
            f"{recorded['held_out_sharpness_ratio']:.2f}") in capsys.readouterr().out
    assert not (tmp_path / "untouched").exists()  # it trains and writes nothing
    with pytest.raises(SystemExit):
        train_vae.main(["--data", str(chain / "data"), "--score-only"])  # no --init


def test_a_missing_autoencoder_folder_is_named_with_the_fix(chain, tmp_path):
    """Not diffusers' hub message about an internet connection: the flag, the path and what to give."""
    from scripts import encode_latents, train_vae

    missing = tmp_path / "vae" / "final"
    with pytest.raises(SystemExit, match=f"--vae '{missing}' does not exist.*final/ folder that scripts.train_vae wrote"):
        encode_latents.main(["--data", str(chain / "data"), "--vae", str(missing), "--out", str(tmp_path / "lat")])
    assert not (tmp_path / "lat").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=f"--init '{tmp_path / 'empty'}' has no config.json"):
        train_vae.main(["--data", str(chain / "data"), "--init", str(tmp_path / "empty"), "--score-only"])


def test_world_training_stage_runs_and_resumes(chain, tmp_path, capsys, monkeypatch):
    from scripts import train_world

    (tmp_path / "tiny.yaml").write_text(f"base: {json.dumps(str(REPO / 'configs' / 'maze_world.yaml'))}\n"
                                        "model: {n_layers: 2, d_model: 128, n_heads: 2}\npipeline: {window_frames: 6}\n")
    common = ["--config", str(tmp_path / "tiny.yaml"), "--latents", str(chain / "latents"), "--out",
              str(tmp_path / "world"), "--batch", "2", "--save-every", "2"]
    train_world.main(common + ["--steps", "2"])
    train_world.main(common + ["--steps", "3", "--compile"])  # a compiled run resumes an eager one
    assert "resumed at step 2" in capsys.readouterr().out
    runs = json.loads((tmp_path / "world" / "train_metrics.json").read_text())["runs"]
    assert [(r["from_step"], r["to_step"]) for r in runs] == [(0, 2), (2, 3)]
    # Ctrl-C after the save at step 4 of a --steps 5 run: the next run resumes there, and the
    # record keeps the stopped run's time up to that save
    calls, train_step = [], train_world.train_step

    def stopped_at_second_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return train_step(*args, **kwargs)

    monkeypatch.setattr(train_world, "train_step", stopped_at_second_step)
    with pytest.raises(KeyboardInterrupt):
        train_world.main(common + ["--steps", "5", "--save-every", "1"])
    monkeypatch.undo()
    train_world.main(common + ["--steps", "5"])
    assert "resumed at step 4" in capsys.readouterr().out
    record = json.loads((tmp_path / "world" / "train_metrics.json").read_text())
    assert [(r["from_step"], r["to_step"], r["target"]) for r in record["runs"][2:]] == [(3, 4, 5), (4, 5, 5)]
    assert record["seconds_all_runs"] == pytest.approx(sum(r["seconds"] for r in record["runs"]))
    assert record["runs"][2]["seconds"] > 0
    state = torch.load(tmp_path / "world" / "ema_core.pt", weights_only=True)
    assert "proj_in.weight" in state

    # export: a checkpoint folder the pipeline plays
    from inference.causvid_pipeline import CausvidPipeline
    from scripts import export_checkpoint

    export = ["--config", str(tmp_path / "tiny.yaml"), "--vae", str(chain / "vae" / "final"), "--latents",
              str(chain / "latents"), "--world", str(tmp_path / "world"), "--out", str(tmp_path / "ckpt"),
              "--clips", "2", "--future", "20"]
    export_checkpoint.main(export)
    card = (tmp_path / "ckpt" / "MODEL.md").read_text()
    # the run records its config (so an export needs no --config); a config unlike the weights is
    # refused before anything is written
    assert json.loads((tmp_path / "world" / "train_metrics.json").read_text())["config"] == str(tmp_path / "tiny.yaml")
    full = str(REPO / "configs" / "maze_world.yaml")
    with pytest.raises(SystemExit, match=r"(?s)--config .*maze_world.yaml: checkpoint .*ema_core.pt does not match "
                                         r"the model config:.*shape mismatch proj_in.weight: expected \[256, 32\]"):
        export_checkpoint.main(["--config", full, *export[2:-6], "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    assert card.count("|") > 10 and "3 episodes x 24 frames, explore policy, corridors 1 grid unit wide" in card
    # the checkpoint names the simulator its episodes came from; a config that says otherwise is refused
    assert load_config(tmp_path / "ckpt" / "config.yaml").simulator == {"corridor": 1, "look": "brick"}
    (tmp_path / "wide.yaml").write_text((tmp_path / "tiny.yaml").read_text() + "simulator:\n  corridor: 2\n")
    with pytest.raises(SystemExit, match=r"says simulator corridor: 2, but the episodes in .* were made with --corridor 1"):
        export_checkpoint.main(["--config", str(tmp_path / "wide.yaml"), *export[2:-6], "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    (tmp_path / "other").mkdir()  # the latents record their episodes: --data of other episodes is refused
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"policy": "explore", "corridor": 2}))
    with pytest.raises(SystemExit, match=r"were encoded from episodes made with \{'policy': 'explore', 'corridor': 1, 'look': 'brick'\}"):
        export_checkpoint.main([*export[:-6], "--data", str(tmp_path / "other"), "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    # a config over a base is written merged: the checkpoint's config.yaml stands alone
    (tmp_path / "based.yaml").write_text("base: tiny.yaml\nworld:\n  name: based-tiny\n")
    export_checkpoint.main(["--config", str(tmp_path / "based.yaml"), *export[2:-5], str(tmp_path / "y"), *export[-4:]])
    assert "base" not in OmegaConf.load(tmp_path / "y" / "config.yaml")
    (tmp_path / "based.yaml").unlink()
    based = load_config(tmp_path / "y" / "config.yaml")
    assert based.name == "based-tiny" and based.model == load_config(tmp_path / "ckpt" / "config.yaml").model
    vae_record = (chain / "vae" / "final" / "metrics.json").read_text()
    assert f"python -m scripts.train_vae --steps {json.loads(vae_record)['steps']} " in card  # the recipe makes this VAE
    # the VAE's training record travels with it, so the checkpoint's vae/ can be a later --vae,
    # also when re-exporting into the same checkpoint
    assert (tmp_path / "ckpt" / "vae" / "metrics.json").read_text() == vae_record
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):  # a bigger world's shards
        (tmp_path / "ckpt" / stale).write_text("{}")
    export_checkpoint.main([*export[:2], "--vae", str(tmp_path / "ckpt" / "vae"), *export[4:]])
    assert sorted(f.name for f in (tmp_path / "ckpt").glob("model*")) == ["model.safetensors"]
    assert (tmp_path / "ckpt" / "vae" / "metrics.json").read_text() == vae_record
    assert card == (tmp_path / "ckpt" / "MODEL.md").read_text()
    pipe = CausvidPipeline.from_checkpoint(tmp_path / "ckpt", verbose=False)
    assert pipe.vae_scale == json.loads((chain / "latents" / "stats.json").read_text())["vae_scale"]
    assert len(pipe.replay.paths) == 2 and pipe([0, 0], [1] + [0] * 10)[0].shape == (64, 64, 3)

    # fine-tune: --init starts model and EMA from the checkpoint, with the checkpoint's vae_scale
    (chain / "latents2").mkdir()
    for f in (chain / "latents").iterdir():
        (chain / "latents2" / f.name).write_bytes(f.read_bytes())
    stats = json.loads((chain / "latents2" / "stats.json").read_text())
    (chain / "latents2" / "stats.json").write_text(json.dumps({**stats, "vae_scale": 9.0}))  # other data's scale
    tune = common[:2] + ["--latents", str(chain / "latents2"), "--batch", "2", "--init", str(tmp_path / "ckpt")]
    train_world.main(tune + ["--out", str(tmp_path / "ft0"), "--steps", "1", "--lr", "0"])  # a step that moves nothing
    from owl_wms.loading import read_state_dict

    shipped = read_state_dict(tmp_path / "ckpt" / "model.safetensors")
    kept = torch.load(tmp_path / "ft0" / "ema_core.pt", weights_only=True)
    assert kept.keys() == shipped.keys() and all(torch.equal(kept[k], shipped[k].float()) for k in kept)
    record = json.loads((tmp_path / "ft0" / "train_metrics.json").read_text())
    assert record["vae_scale"] == pipe.vae_scale and record["init"] == str(tmp_path / "ckpt")
    train_world.main(tune + ["--out", str(tmp_path / "ft"), "--steps", "1", "--self-history", "1"])
    tuned = torch.load(tmp_path / "ft" / "ema_core.pt", weights_only=True)
    assert any(not torch.equal(tuned[k], kept[k]) for k in kept)
    # a distilling fine-tune: the teacher is the --init weights, also when the run resumes
    distil = tune + ["--out", str(tmp_path / "ftd"), "--pipeline-frac", "1", "--distill", "2", "--save-every", "1"]
    train_world.main(distil + ["--steps", "1"])
    train_world.main(distil + ["--steps", "2"])
    assert "resumed at step 1" in capsys.readouterr().out
    runs = json.loads((tmp_path / "ftd" / "train_metrics.json").read_text())["runs"]
    assert [r["to_step"] for r in runs] == [1, 2] and all("--distill 2" in r["options"] for r in runs)
    with pytest.raises(SystemExit, match="--distill 2 needs a teacher"):
        train_world.main(common + ["--steps", "1", "--distill", "2"])
    with pytest.raises(SystemExit, match="--distill -1 must be a number of Euler steps"):
        train_world.main(distil[:-4] + ["--distill", "-1", "--steps", "1"])
    with pytest.raises(SystemExit, match=r"--history-noise -0.5 must be a noise std in \[0, 4\]"):
        train_world.main(common + ["--steps", "1", "--history-noise", "-0.5"])
    train_world.main(tune + ["--out", str(tmp_path / "fth"), "--steps", "1", "--history-noise", "0.3"])
    assert "--history-noise 0.3" in json.loads((tmp_path / "fth" / "train_metrics.json").read_text())["runs"][-1]["options"]
    # the fine-tune's MODEL.md lists the whole chain: the base world, its export, the fine-tune
    record = json.loads((tmp_path / "ft" / "train_metrics.json").read_text())
    # the base's training record, and the episodes its export says it learned from
    base = dict(record["base"])
    assert base.pop("data")["options"] == {"policy": "explore", "corridor": 1, "look": "brick"}
    assert base == json.loads((tmp_path / "world" / "train_metrics.json").read_text())
    export_checkpoint.main([*export[2:6], "--world", str(tmp_path / "ft"), "--out", str(tmp_path / "ckpt_ft"),
                            *export[-4:]])  # no --config: the fine-tune's record names it
    recipe = [line.split("#")[0].strip() for line in (tmp_path / "ckpt_ft" / "MODEL.md").read_text().splitlines()
              if "scripts.train_world" in line or "scripts.export_checkpoint" in line]
    assert recipe[0].endswith(f"--out {tmp_path / 'world'} --batch 2 --steps 2 --config {tmp_path / 'tiny.yaml'}")
    assert recipe[3].endswith(f"--world {tmp_path / 'world'} --out {tmp_path / 'ckpt'}")  # the base's export
    assert recipe[4] == (f"python -m scripts.train_world --out {tmp_path / 'ft'} --batch 2 --steps 1 "
                         f"--config {tmp_path / 'tiny.yaml'} --self-history 1 --init {tmp_path / 'ckpt'}")
    assert recipe[5].endswith(f"--world {tmp_path / 'ft'}")
    assert "; then 1 steps of fine-tuning x batch 2" in (tmp_path / "ckpt_ft" / "MODEL.md").read_text()

    # evaluate a training run's weights in the checkpoint's world, on lively-policy episodes
    from scripts import eval_world

    eval_world.main(["--checkpoint", str(tmp_path / "ckpt"), "--weights", str(tmp_path / "ft" / "ema_core.pt"),
                     "--episodes", "2", "--frames", "3", "--tf-frames", "2", "--gap-range", "1", "3",
                     "--policy", "lively", "--script-frames", "3", "--out", str(tmp_path / "eval")])
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["policy"] == "lively" and report["weights"].endswith("ema_core.pt")
    # MODEL.md quotes the evaluation, turn following included
    export_checkpoint.main(export + ["--eval", str(tmp_path / "eval" / "eval.json")])
    card = (tmp_path / "ckpt" / "MODEL.md").read_text()
    gap, gap_se = report["action_gap_db"], report["standard_error"]["action_gap_db"]
    assert f"{report['teacher_forced_psnr']:.2f} dB ± {report['standard_error']['teacher_forced_psnr']:.2f} / " in card
    assert f"| {gap:.2f} dB ± {gap_se:.2f}, lowest level " in card and "one standard error of the mean" in card
    assert "frame 16 | not measured" in card  # a 3-frame evaluation has no frame 16
    assert "`eval_rollouts.png`" in card and (tmp_path / "ckpt" / "eval_rollouts.png").is_file()
    assert "`eval_turns.png`" in card and (tmp_path / "ckpt" / "eval_turns.png").is_file()
    walk = report["walk_and_turn"]
    assert (f"the least sharp frame's sharpness ratio (high-frequency energy, model over simulator) | "
            f"{walk['sharpness_ratio_min']:.2f} ({walk['frames_below_sharp_enough']} frames below 0.5") in card
    for sheet in ("eval_walk_and_turn.png", "eval_turn_in_place.png"):
        assert f"`{sheet}`" in card and (tmp_path / "ckpt" / sheet).is_file()
    assert "layout score at frame 64" not in card  # a 3-frame evaluation has no frame 64
    assert f"one in {report['turn_sheet_every']}; simulator, teacher-forced, autoregressive, one row each" in card
    assert f"| {report['turn_following']:.2f} ({report['turn_shift_model']:.2f} vs " in card
    assert f"(teacher-forced) {report['turn_following_teacher_forced']:.2f}; in the open " in card
    from scripts.export_checkpoint import share

    assert (f"facing a wall nearer than 1.6 {share(report['turn_following_near_wall'])} (one step "
            f"{share(report['turn_following_teacher_forced_near_wall'])}) |") in card
    assert f"| {report['rest_walk_psnr']:.2f} dB against {report['nudged_walk_psnr']:.2f} dB |" in card
    assert f", lowest level {min(report['per_level']['action_gap_db']):+.2f} dB (target" in card
    assert f"({report['settings']}; {report['machine']})" in card  # the dtype and CPU behind the figures
    # an evaluation from before the teacher-forced row (the shipped MODEL.md's) keeps its wording
    old = {k: v for k, v in report.items() if k not in ("sheet_rows", "turn_following_teacher_forced")}
    (tmp_path / "eval" / "old.json").write_text(json.dumps(old))
    export_checkpoint.main(export + ["--eval", str(tmp_path / "eval" / "old.json")])
    card = (tmp_path / "ckpt" / "MODEL.md").read_text()
    assert f"one in {report['turn_sheet_every']}; simulator above, model below" in card and "(teacher-forced)" not in card
    with pytest.raises(SystemExit, match="holds a model unlike"):
        train_world.main(["--latents", str(chain / "latents2"), "--out", str(tmp_path / "ft2"), "--steps", "0",
                          "--init", str(tmp_path / "ckpt")])  # the default config is the full-size world


def test_a_policy_mixture_takes_its_styles_in_turn(tmp_path, capsys):
    """--policy still+explore: episode k (from --seed) is the one --policy still or --policy
    explore makes for that level, alternating; the manifest records the mixture; an unknown
    style is refused by name before anything is written."""
    from safetensors.torch import load_file

    from scripts import generate_data

    for policy in ("still+explore", "still", "explore"):
        generate_data.main(["--out", str(tmp_path / policy), "--episodes", "3", "--frames", "12", "--seed", "7",
                            "--policy", policy])
    for k, level in enumerate(range(7, 10)):
        name = f"ep_{level:06d}.safetensors"
        mixed = load_file(str(tmp_path / "still+explore" / name))
        alone = load_file(str(tmp_path / ("still" if k % 2 == 0 else "explore") / name))
        other = load_file(str(tmp_path / ("explore" if k % 2 == 0 else "still") / name))
        assert all(torch.equal(mixed[key], alone[key]) for key in mixed)
        assert not torch.equal(mixed["mouse"], other["mouse"])  # the styles differ on these levels
    assert json.loads((tmp_path / "still+explore" / "manifest.json").read_text())["policy"] == "still+explore"
    with pytest.raises(SystemExit):
        generate_data.main(["--out", str(tmp_path / "bad"), "--episodes", "1", "--policy", "still+calm"])
    assert "unknown style 'calm'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_model_card_recipe_follows_the_data_policy():
    from scripts.export_checkpoint import chain_commands

    runs = {"runs": [{"batch": 4, "from_step": 0, "to_step": 1100}, {"batch": 4, "from_step": 1100, "to_step": 1800}]}
    explore = chain_commands({"policy": "explore", "corridor": 1}, runs, {"steps": 5000})
    assert not any("--policy" in c or "--latents" in c for c in explore)
    assert explore[1].split("#")[0].strip() == "python -m scripts.train_vae --steps 5000"  # the VAE's own steps
    assert [c.split("#")[0].strip() for c in explore if "train_world" in c] == [
        "python -m scripts.train_world --batch 4 --steps 1100", "python -m scripts.train_world --batch 4 --steps 1800"]
    # a run stopped and resumed with the same --steps is one command
    stopped = {"runs": [{"batch": 4, "from_step": 0, "to_step": 1100, "target": 1100},
                        {"batch": 4, "from_step": 1100, "to_step": 1250, "target": 1800},
                        {"batch": 4, "from_step": 1250, "to_step": 1800, "target": 1800}]}
    assert chain_commands({}, stopped, {"steps": 5000}) == explore  # a manifest from before the options
    lively = chain_commands({"policy": "lively"}, runs, {"steps": 5000})
    # the VAE still learns from the exploring episodes; the world model's data, latents and export follow the policy
    assert lively[:2] == explore[:2]
    assert "generate_data --policy lively --out work/data_lively" in lively[2]
    assert "encode_latents --data work/data_lively --out work/latents_lively" in lively[3]
    assert all("--latents work/latents_lively" in c for c in lively if "train_world" in c or "export" in c)
    assert all("--data work/data_lively" in c for c in lively if "export" in c)
    # wider corridors: the world's own episodes, named by every option that differs from the default
    wide = chain_commands({"policy": "explore", "corridor": 2}, runs, {"steps": 5000})
    assert wide[:2] == explore[:2] and "generate_data --corridor 2 --out work/data_corridor2" in wide[2]
    assert "encode_latents --data work/data_corridor2 --out work/latents_corridor2" in wide[3]
    assert all("--latents work/latents_corridor2" in c for c in wide if "train_world" in c or "export" in c)
    mixed = chain_commands({"policy": "still+explore", "corridor": 2}, runs, {"steps": 5000})
    assert "generate_data --policy still+explore --corridor 2 --out work/data_still+explore_corridor2" in mixed[2]
    both = chain_commands({"policy": "lively", "corridor": 3}, runs, {"steps": 5000})
    assert "generate_data --policy lively --corridor 3 --out work/data_lively_corridor3" in both[2]
    # flags beyond --batch/--steps come back as typed; a change of them is a new command
    flagged = {"runs": [{"batch": 4, "from_step": 0, "to_step": 900, "target": 2600, "options": "--target-frac 0.5 --compile"},
                        {"batch": 4, "from_step": 900, "to_step": 2600, "target": 2600, "options": "--target-frac 0.5 --compile"}]}
    assert [c.split("#")[0].strip() for c in chain_commands({}, flagged, {"steps": 5000}) if "train_world" in c] == [
        "python -m scripts.train_world --batch 4 --steps 2600 --target-frac 0.5 --compile"]


def test_model_card_recipe_trains_a_fine_tunes_base_on_its_own_episodes():
    """A world fine-tuned on other episodes than its base learned from: MODEL.md makes both sets
    of episodes, trains and exports the base on its own latents, then fine-tunes on the new ones;
    the data and encode rows give both."""
    from scripts.export_checkpoint import chain_commands, data_rows

    base = {"batch": 4, "steps": 1000, "frames": 32, "final_loss": 0.22, "init": None, "out": "work/world_mix",
            "runs": [{"batch": 4, "from_step": 0, "to_step": 1000, "options": "--lr 0.001"}],
            "data": {"options": {"policy": "still+explore", "corridor": 2}, "episodes": 256, "frames": 256,
                     "generate": {"seconds_this_run": 192.0}, "encode": {}, "vae_scale": 0.5672}}
    ft = {"batch": 4, "steps": 300, "frames": 32, "final_loss": 0.2, "init": "work/maze-world-mix", "base": base,
          "runs": [{"batch": 4, "from_step": 0, "to_step": 300, "options": "--init work/maze-world-mix"}]}
    roam = {"policy": "roam", "corridor": 2}
    mix_lat, mix_data = "work/latents_still+explore_corridor2", "work/data_still+explore_corridor2"
    assert [c.split("#")[0].strip() for c in chain_commands(roam, ft, {"steps": 5000}, "work/ft")] == [
        "python -m scripts.generate_data",
        "python -m scripts.train_vae --steps 5000",
        f"python -m scripts.generate_data --policy still+explore --corridor 2 --out {mix_data}",
        f"python -m scripts.encode_latents --data {mix_data} --out {mix_lat}",
        f"python -m scripts.train_world --latents {mix_lat} --out work/world_mix --batch 4 --steps 1000 --lr 0.001",
        f"python -m scripts.export_checkpoint --latents {mix_lat} --data {mix_data} --world work/world_mix "
        "--out work/maze-world-mix",
        "python -m scripts.generate_data --policy roam --corridor 2 --out work/data_roam_corridor2",
        "python -m scripts.encode_latents --data work/data_roam_corridor2 --out work/latents_roam_corridor2",
        "python -m scripts.train_world --latents work/latents_roam_corridor2 --out work/ft --batch 4 --steps 300 "
        "--init work/maze-world-mix",
        "python -m scripts.export_checkpoint --latents work/latents_roam_corridor2 --data work/data_roam_corridor2 "
        "--world work/ft",
        "OWL_DTYPE=fp32 python -m scripts.eval_world --checkpoint checkpoints/maze-world --euler-steps 16 "
        "--out eval/maze-world",
        "python -m scripts.export_checkpoint --latents work/latents_roam_corridor2 --data work/data_roam_corridor2 "
        "--world work/ft --eval eval/maze-world/eval.json"]
    # a base exported before its record kept its episodes: the fine-tune's stand in, made once
    older = chain_commands(roam, {**ft, "base": {k: v for k, v in base.items() if k != "data"}}, {"steps": 5000})
    assert not any("still+explore" in c for c in older)
    assert sum("generate_data --policy roam" in c for c in older) == 1
    own = {**base["data"], "options": roam, "vae_scale": 0.5305, "encode": {"seconds_this_run": 162.0}}
    data_row, encode_row = data_rows(own, ft)
    assert data_row.startswith("256 episodes x 256 frames, still+explore policy, corridors 2 grid units wide, brick walls, 3.2 min")
    assert "roam policy" in data_row.split("(the base world's);")[1]
    assert "0.5672, not recorded (the base world's, which the fine-tune keeps)" in encode_row
    assert "0.5305, 2.7 min (the fine-tune's episodes)" in encode_row
    assert data_rows(own, {"batch": 4}) == ("256 episodes x 256 frames, roam policy, corridors 2 grid units wide, brick walls, "
                                           "3.2 min", "vae_scale (latent std) 0.5305, 2.7 min")
    # a base world with no training record (an untrained checkpoint): its own rows, and the commands
    # say plainly that the card cannot tell how the base was made
    unrecorded = {**ft, "base": None}
    assert data_rows(own, unrecorded) == data_rows(own, {"batch": 4})
    with pytest.raises(SystemExit, match="'work/maze-world-mix', whose folder has no world_training.json"):
        chain_commands(roam, unrecorded, {"steps": 5000})


def test_train_world_records_the_recipe_flags_it_was_given():
    from scripts.train_world import parser, recipe_options

    p = parser()
    assert recipe_options(p, p.parse_args(["--out", "elsewhere", "--device", "cpu", "--save-every", "5"])) == ""
    assert recipe_options(p, p.parse_args(["--target-frac", "0.5", "--compile", "--lr", "3e-4", "--ema", "0.98"])) == \
        "--lr 0.0003 --ema 0.98 --target-frac 0.5 --compile"
    assert recipe_options(p, p.parse_args(["--config", "configs/maze_world_d128.yaml", "--compile"])) == \
        "--config configs/maze_world_d128.yaml --compile"  # the model's shape is part of the recipe


def test_vae_training_lowers_the_loss():
    torch.manual_seed(0)
    ae = build_autoencoder(16, 8)
    opt = torch.optim.AdamW(ae.parameters(), lr=3e-3)
    x = torch.rand(4, 3, 64, 64) * 2 - 1
    losses = []
    for _ in range(25):
        loss, _ = vae_loss(ae, x, latent_noise=0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_world_model_training_lowers_the_loss():
    world = load_config(REPO / "configs" / "maze_world.yaml")
    cfg = world.model.__class__(**{**world.model.to_dict(), "n_layers": 2, "d_model": 128, "n_heads": 2})
    torch.manual_seed(0)
    model = GameRFT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4, cfg.channels, 8, 8).cumsum(1) * 0.5  # temporally correlated "latents"
    m, b = torch.randn(2, 4, 2), (torch.rand(2, 4, 11) > 0.5).float()
    losses = []
    for _ in range(30):  # one fixed batch (same times and noise every step): the fit must improve
        g = torch.Generator().manual_seed(0)
        t = sample_times(2, 4, g, 0.5, 0.25, (1.0, 0.25, 0.0))
        loss = flow_loss(model.core, x, m, b, t, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])


def tiny_world_model(layers: int = 2):
    world = load_config(REPO / "configs" / "maze_world.yaml")
    cfg = world.model.__class__(**{**world.model.to_dict(), "n_layers": layers, "d_model": 128, "n_heads": 2})
    torch.manual_seed(0)
    return GameRFT(cfg), cfg


def test_self_history_conditions_on_the_models_own_samples():
    model, cfg = tiny_world_model()
    sched = (1.0, 0.25, 0.0)
    x = torch.randn(2, 5, cfg.channels, 8, 8)
    m, b = torch.randn(2, 5, 2), (torch.rand(2, 5, 11) > 0.5).float()
    t = sample_times(2, 5, torch.Generator().manual_seed(0), 1.0, 0.25, sched)  # all history at 0.25
    moved = x.clone()
    moved[:, :-1] += 1.0  # other real history
    loss = {(share, name): flow_loss(model.core, clip, m, b, t, torch.Generator().manual_seed(1), share, sched).item()
            for share in (0.0, 1.0) for name, clip in (("real", x), ("moved", moved))}
    # Off: the real history is what the target frame sees; every history frame swapped for the
    # model's own samples: the loss no longer depends on it.
    assert loss[(0.0, "real")] != pytest.approx(loss[(0.0, "moved")], rel=1e-3)
    assert loss[(1.0, "real")] == pytest.approx(loss[(1.0, "moved")], rel=1e-6)
    # Off draws nothing extra: the generator ends where the plain loss leaves it.
    g0, g1 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    flow_loss(model.core, x, m, b, t, g0, 0.0, sched)
    torch.randn(x.shape, generator=g1)
    assert torch.equal(g0.get_state(), g1.get_state())


def test_own_history_is_the_pipelines_cached_state():
    """A swapped frame becomes z - 0.75 v(z, t=1), the state the pipeline writes to its cache."""
    model, cfg = tiny_world_model()
    x_t = torch.randn(1, 3, cfg.channels, 8, 8)
    z = torch.randn_like(x_t)
    m, b = torch.randn(1, 3, 2), torch.zeros(1, 3, 11)
    t = torch.full((1, 3), 0.25)
    chosen = torch.tensor([[False, True, False]])
    out = own_history(model.core, x_t, z, t, chosen, m, b, (1.0, 0.25, 0.0))
    seen = x_t[:, :2].clone()  # causal: frame 1 sees frame 0 and itself, starting from its noise
    seen[:, 1] = z[:, 1]
    with torch.no_grad():
        v = model.core(seen, torch.tensor([[0.25, 1.0]]), m[:, :2], b[:, :2])
    assert torch.equal(out[:, [0, 2]], x_t[:, [0, 2]])
    torch.testing.assert_close(out[:, 1], z[:, 1] - 0.75 * v[:, 1], rtol=1e-4, atol=1e-5)


def test_a_self_rollout_makes_each_frame_from_the_models_own_earlier_frames():
    """sequential: frame 2 is sampled after frame 1 became the model's own, as the pipeline plays;
    all at once, frame 2 sees the real frame 1 (one step of exposure)."""
    model, cfg = tiny_world_model()
    sched = (1.0, 0.25, 0.0)
    g = torch.Generator().manual_seed(3)
    x_t = torch.randn(2, 4, cfg.channels, 8, 8, generator=g)
    z = torch.randn(x_t.shape, generator=g)
    m, b = torch.randn(2, 4, 2, generator=g), torch.zeros(2, 4, 11)
    t = torch.full((2, 4), 0.25)
    chosen = torch.tensor([[False, True, True, False]] * 2)
    rolled = own_history(model.core, x_t, z, t, chosen, m, b, sched, sequential=True)
    at_once = own_history(model.core, x_t, z, t, chosen, m, b, sched)
    torch.testing.assert_close(rolled[:, 1], at_once[:, 1])  # the first made frame sees only real ones
    seen = x_t[:, :3].clone()
    seen[:, 1], seen[:, 2] = rolled[:, 1], z[:, 2]
    with torch.no_grad():
        v = model.core(seen, torch.tensor([[0.25, 0.25, 1.0]] * 2), m[:, :3], b[:, :3])
    torch.testing.assert_close(rolled[:, 2], z[:, 2] - 0.75 * v[:, 2], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(rolled[:, 2], at_once[:, 2])
    assert torch.equal(rolled[:, [0, 3]], x_t[:, [0, 3]])


def test_self_rollout_replaces_the_last_history_frames_of_pipeline_samples_only():
    model, cfg = tiny_world_model()
    sched = (1.0, 0.25, 0.0)
    x = torch.randn(2, 5, cfg.channels, 8, 8)
    m, b = torch.randn(2, 5, 2), (torch.rand(2, 5, 11) > 0.5).float()
    t = sample_times(2, 5, torch.Generator().manual_seed(0), 1.0, 0.25, sched)  # pipeline-shaped
    late, early = x.clone(), x.clone()
    late[:, 2:4] += 1.0  # the two frames the rollout makes, real content changed
    early[:, :2] += 1.0  # the real history it starts from
    loss = lambda clip, t, k: flow_loss(model.core, clip, m, b, t, torch.Generator().manual_seed(1),  # noqa: E731
                                        schedule=sched, self_rollout=k).item()
    assert loss(x, t, 2) == pytest.approx(loss(late, t, 2), rel=1e-6)  # replaced by the model's own frames
    assert loss(x, t, 2) != pytest.approx(loss(early, t, 2), rel=1e-3)  # the rollout starts from these
    assert loss(x, t, 0) != pytest.approx(loss(late, t, 0), rel=1e-3)
    diffusion_forcing = sample_times(2, 5, torch.Generator().manual_seed(0), 0.0, 0.25, sched)
    assert loss(x, diffusion_forcing, 2) == loss(x, diffusion_forcing, 0)  # independent levels: nothing to roll
    # no extra draws: the generator ends where the plain loss leaves it
    g0, g1 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    flow_loss(model.core, x, m, b, t, g0, schedule=sched, self_rollout=2)
    torch.randn(x.shape, generator=g1)
    assert torch.equal(g0.get_state(), g1.get_state())


def test_teacher_first_step_is_the_euler_solve_of_the_whole_clip():
    """The cached teacher (history prefilled once, only the last frame stepped) gives the velocity
    of the straight jump from the noise to where K Euler steps of the full clip reach."""
    model, cfg = tiny_world_model()
    sched, k = (1.0, 0.25, 0.0), 3
    g = torch.Generator().manual_seed(2)
    x_t = torch.randn(2, 4, cfg.channels, 8, 8, generator=g)
    m, b = torch.randn(2, 4, 2, generator=g), (torch.rand(2, 4, 11, generator=g) > 0.5).float()
    t = torch.full((2, 4), 0.25)
    t[:, -1] = 1.0
    target = teacher_first_step(model.core, x_t, t, m, b, sched, k)
    x, tl = x_t.clone(), t.clone()
    with torch.no_grad():
        for level, nxt in ((1.0, 0.75), (0.75, 0.5), (0.5, 0.25)):
            tl[:, -1] = level
            x[:, -1] -= (level - nxt) * model.core(x, tl, m, b)[:, -1]
    torch.testing.assert_close(target, (x_t[:, -1] - x[:, -1]) / 0.75, rtol=1e-4, atol=1e-4)


def test_distillation_trains_the_first_step_towards_the_teacher():
    """With a teacher, a pipeline sample's last frame at t = 1 is scored against the teacher's
    target, other frames at t = 1 are left out, and everything else keeps the flow loss."""
    model, cfg = tiny_world_model()
    teacher, _ = tiny_world_model(layers=1)
    sched = (1.0, 0.25, 0.0)
    x = torch.randn(2, 4, cfg.channels, 8, 8)
    m, b = torch.randn(2, 4, 2), (torch.rand(2, 4, 11) > 0.5).float()
    t = torch.full((2, 4), 0.25)
    t[0, -1], t[1, -1] = 1.0, 0.25  # clip 0 distilled, clip 1 a second-step target
    plain = flow_loss(model.core, x, m, b, t, torch.Generator().manual_seed(4), schedule=sched).item()
    distilled = flow_loss(model.core, x, m, b, t, torch.Generator().manual_seed(4), schedule=sched,
                          teacher=teacher.core, teacher_steps=2).item()
    # By hand: the same noise, the teacher's target on clip 0's last frame, the flow target elsewhere.
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    x_t = (1 - t[..., None, None, None]) * x + t[..., None, None, None] * z
    target = z - x
    target[0, -1] = teacher_first_step(teacher.core, x_t[:1], t[:1], m[:1], b[:1], sched, 2)[0]
    with torch.no_grad():
        want = (model.core(x_t, t, m, b) - target).pow(2).mean().item()
    assert distilled == pytest.approx(want, rel=1e-5) and distilled != pytest.approx(plain, rel=1e-3)
    # An earlier frame at t = 1 is not scored: its error does not move the loss.
    t2 = t.clone()
    t2[0, 1] = 1.0
    x2 = x.clone()
    x2[0, 1] += 5.0  # changes frame 1's target (and, causally, what later frames see)
    keep = torch.ones(2, 4)
    keep[0, 1] = 0
    z2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    x_t2 = (1 - t2[..., None, None, None]) * x2 + t2[..., None, None, None] * z2
    target2 = z2 - x2
    target2[0, -1] = teacher_first_step(teacher.core, x_t2[:1], t2[:1], m[:1], b[:1], sched, 2)[0]
    with torch.no_grad():
        err = (model.core(x_t2, t2, m, b) - target2).pow(2).mean(dim=(2, 3, 4))
    got = flow_loss(model.core, x2, m, b, t2, torch.Generator().manual_seed(4), schedule=sched,
                    teacher=teacher.core, teacher_steps=2).item()
    assert got == pytest.approx(float((err * keep).sum() / keep.sum()), rel=1e-5)


def test_pipeline_shaped_times():
    g = torch.Generator().manual_seed(0)
    t = sample_times(64, 5, g, 1.0, 0.25, (1.0, 0.25, 0.0))
    assert bool((t[:, :-1] == 0.25).all()) and set(t[:, -1].tolist()) <= {1.0, 0.25}
    t = sample_times(64, 5, g, 0.0, 0.25, (1.0, 0.25, 0.0))
    assert 0 < t.min() and t.max() < 1 and t.std() > 0.1


def test_target_frac_adds_next_frame_targets_to_pipeline_samples():
    sched = (1.0, 0.25, 0.0)
    plain = sample_times(16, 8, torch.Generator().manual_seed(3), 0.5, 0.25, sched)
    same = sample_times(16, 8, torch.Generator().manual_seed(3), 0.5, 0.25, sched, target_frac=0.0)
    assert torch.equal(plain, same)  # off: the shipped recipe's draws, bit for bit
    t = sample_times(256, 8, torch.Generator().manual_seed(3), 1.0, 0.25, sched, target_frac=0.5)
    assert set(t.flatten().tolist()) <= {1.0, 0.25}
    share = float((t[:, :-1] == 1.0).float().mean())
    assert 0.2 < share < 0.3  # half the earlier frames are targets, half of those at t = 1


def test_shipped_recipe_trains_the_shipped_vae():
    """MODEL.md's and the README's VAE command ask for the steps the shipped VAE was trained with
    (the script's default differs)."""
    card = (REPO / "checkpoints" / "maze-world" / "MODEL.md").read_text()
    steps, rest = re.search(r"VAE held-out reconstruction PSNR \| [\d.]+ dB \((\d+) steps([^|]*)", card).groups()
    decoder_steps = re.search(r"then (\d+) steps of decoder-only fine-tuning", rest)
    for text in (card, (REPO / "README.md").read_text()):
        commands = re.findall(r"python -m scripts\.train_vae([^#\n]*)", text)
        assert commands[0].strip() == f"--steps {steps}"
        if decoder_steps:
            assert "--decoder-only" in commands[1] and f"--steps {decoder_steps.group(1)} " in commands[1]


def test_history_noise_corrupts_the_real_history_of_pipeline_samples_and_leaves_it_out_of_the_loss():
    model, cfg = tiny_world_model()
    sched = (1.0, 0.25, 0.0)
    x = torch.randn(2, 5, cfg.channels, 8, 8)
    m, b = torch.randn(2, 5, 2), (torch.rand(2, 5, 11) > 0.5).float()
    seen = []
    core = lambda x_t, *rest: seen.append(x_t) or model.core(x_t, *rest)  # noqa: E731
    pipeline = sample_times(2, 5, torch.Generator().manual_seed(0), 1.0, 0.25, sched)  # history at the cache level
    loss = flow_loss(core, x, m, b, pipeline, torch.Generator().manual_seed(1), schedule=sched, history_noise=0.5)
    plain = flow_loss(core, x, m, b, pipeline, torch.Generator().manual_seed(1), schedule=sched)
    noisy, clean = seen
    assert torch.equal(noisy[:, -1], clean[:, -1])  # the frame being made is untouched
    extra = (noisy[:, :-1] - clean[:, :-1]).flatten(2).std(-1)
    assert (extra > 0).all() and (extra < 0.55).all()  # a std drawn per frame from [0, 0.5)
    # only the last frame is scored: its error alone
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = model.core(noisy, pipeline, m, b)
    assert loss.item() == pytest.approx((v[:, -1] - (z - x)[:, -1]).pow(2).mean().item(), rel=1e-5)
    assert loss.item() != pytest.approx(plain.item(), rel=1e-3)
    # diffusion forcing's frames are never at the cache level: nothing changes
    independent = sample_times(2, 5, torch.Generator().manual_seed(0), 0.0, 0.25, sched)
    assert flow_loss(model.core, x, m, b, independent, torch.Generator().manual_seed(1), schedule=sched,
                     history_noise=0.5) == flow_loss(model.core, x, m, b, independent,
                                                     torch.Generator().manual_seed(1), schedule=sched)
    # off draws nothing extra
    g0, g1 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    flow_loss(model.core, x, m, b, pipeline, g0, schedule=sched, history_noise=0.0)
    torch.randn(x.shape, generator=g1)
    assert torch.equal(g0.get_state(), g1.get_state())


def test_world_latents_pair_the_worlds_predictions_with_the_frames_they_should_show(chain, tmp_path, monkeypatch):
    """scripts.world_latents keeps, per training level, each teacher-forced prediction's latent (as
    the decoder receives it) with the simulator's frame; a rerun makes only what is missing, and
    another run's options or held-out levels are refused. train_vae --world-latents trains the
    decoder on them, the encoder untouched, and records the predictions' PSNR before and after."""
    from safetensors.torch import load_file

    from inference.causvid_pipeline import DEFAULT_CHECKPOINT, CausvidPipeline
    from inference.flags import resolve_settings
    from owl_wms.config import load_world
    from owl_wms.controls import to_uint8, to_unit
    from owl_wms.maze.data import HELD_OUT_SEED
    from owl_wms.maze.evaluation import Episode, teacher_forced
    from owl_wms.maze.training.vae import psnr
    from owl_wms.vae import load_autoencoder
    from scripts import train_vae, world_latents

    monkeypatch.setenv("OWL_DTYPE", "fp32")
    out = tmp_path / "pairs"
    world_latents.main(["--levels", "3", "--frames", "3", "--out", str(out)])
    files = sorted(out.glob("ep_*.safetensors"))
    assert [f.name for f in files] == ["ep_000000.safetensors", "ep_000001.safetensors", "ep_000002.safetensors"]
    world = load_world(DEFAULT_CHECKPOINT)  # the settings world_latents runs with: float32 on any CPU
    pipe = CausvidPipeline.from_checkpoint(world, clip=None, verbose=False, settings=resolve_settings(world.inference))
    pair = load_file(str(files[1]))
    ep = Episode(pipe, 1, 3, "explore")  # still+explore: odd levels explore
    made = []
    teacher_forced(pipe, ep, 3, frames=made)
    assert pair["latents"].shape == (3, 32, 8, 8) and pair["frames"].shape == (3, 64, 64, 3)
    for k in range(3):
        assert torch.equal(pair["frames"][k], torch.from_numpy(ep.future(k)[0]))
        shown = to_uint8(pipe.decoder.decode(pair["latents"][k:k + 1]))[0]
        assert (shown.int() - torch.from_numpy(made[k]).int()).abs().max() <= 1

    stamp = files[0].stat().st_mtime_ns
    world_latents.main(["--levels", "4", "--frames", "3", "--out", str(out)])  # one more level, the others kept
    assert len(list(out.glob("ep_*.safetensors"))) == 4 and files[0].stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit, match="holds levels made with frames 3"):
        world_latents.main(["--levels", "4", "--frames", "5", "--out", str(out)])
    with pytest.raises(SystemExit):
        world_latents.main(["--first-seed", str(HELD_OUT_SEED - 1), "--levels", "2", "--out", str(tmp_path / "x")])

    base = REPO / "checkpoints" / "maze-world" / "vae"
    args = ["--data", str(chain / "data"), "--init", str(base), "--world-latents", str(out), "--batch", "4",
            "--held-out", "1", "--steps", "2", "--lr", "1e-4", "--fp32"]
    with pytest.raises(SystemExit):  # the encoder would change: the world's latents with it
        train_vae.main(args + ["--out", str(tmp_path / "no")])
    with pytest.raises(SystemExit):  # the detail term is the world latents' loss
        train_vae.main(args[:4] + ["--decoder-only", "--detail-weight", "0.01", "--out", str(tmp_path / "no")])
    train_vae.main(args + ["--decoder-only", "--detail-weight", "0.01", "--out", str(tmp_path / "dec")])
    before, after = load_autoencoder(base).state_dict(), load_autoencoder(tmp_path / "dec" / "final").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("encoder."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("decoder."))
    metrics = json.loads((tmp_path / "dec" / "final" / "metrics.json").read_text())
    assert metrics["world_latents"] == str(out) and metrics["world_share"] == 0.5 and metrics["detail_weight"] == 0.01
    # scored on the held-out last level's predictions (every 4th: here its first), decoded as they are in play
    held = load_file(str(out / "ep_000003.safetensors"))
    with torch.no_grad():
        shown = load_autoencoder(base).decode(held["latents"][:1]).sample
    assert metrics["held_out_world_psnr_db_before"] == pytest.approx(
        psnr(shown, to_unit(held["frames"][:1].permute(0, 3, 1, 2))), abs=1e-3)
    assert np.isfinite(metrics["held_out_world_psnr_db"]) and metrics["held_out_world_sharpness_ratio"] > 0


def test_detail_gap_is_the_log_sharpness_ratio_and_its_gradient_sharpens():
    """detail_gap is 0 for a frame as sharp as its target and the squared log of eval_world's
    sharpness ratio otherwise; a step down its gradient makes a blurred frame sharper."""
    from owl_wms.controls import to_uint8
    from owl_wms.maze.evaluation import sharpness_ratio
    from owl_wms.maze.training.vae import detail_gap

    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    blurred = torch.nn.functional.avg_pool2d(x, 3, 1, 1, count_include_pad=False)
    assert detail_gap(x, x).item() == 0
    ratio = sharpness_ratio(to_uint8(blurred)[0].numpy(), to_uint8(x)[0].numpy())
    assert detail_gap(blurred, x).item() == pytest.approx(np.log(ratio) ** 2, rel=0.05)  # uint8 rounding aside
    y = blurred.clone().requires_grad_(True)
    detail_gap(y, x).backward()
    assert detail_gap(y.detach() - 0.5 * y.grad, x) < detail_gap(blurred, x)
