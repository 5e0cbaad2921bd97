import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import owl_wms
from owl_wms.loading import CheckpointError, read_state_dict

from .conftest import REPO, random_model, time_limit


def write_config(tmp_path):
    text = (REPO / "configs" / "untrained_tiny.yaml").read_text()
    text = text.replace("n_layers: 8", "n_layers: 2")
    (tmp_path / "config.yaml").write_text(text)
    return tmp_path / "config.yaml"


def small_state(cfg_path):
    from owl_wms.config import load_config

    return random_model(load_config(cfg_path).model).core.state_dict()


@pytest.mark.parametrize("wrap", ["plain", "ema", "model"])
@pytest.mark.parametrize("prefix", ["", "core.", "ema_model.", "module.", "_orig_mod.", "module._orig_mod.core."])
def test_pt_wrappers_and_prefixes_load(tmp_path, wrap, prefix):
    cfg = write_config(tmp_path)
    state = small_state(cfg)
    sd = {prefix + k: v for k, v in state.items()}
    torch.save(sd if wrap == "plain" else {wrap: sd}, tmp_path / "w.pt")
    model = owl_wms.from_pretrained(cfg, tmp_path / "w.pt")
    assert all(torch.equal(model.core.state_dict()[k], v) for k, v in state.items())


def test_sharded_safetensors_load_like_one_file(tmp_path):
    """Shards + index (the layout export_checkpoint writes for big models) load by the index,
    or by the single file's name they replace; a missing shard is a clear error."""
    from huggingface_hub import save_torch_state_dict

    cfg = write_config(tmp_path)
    state = small_state(cfg)
    save_torch_state_dict(state, tmp_path, max_shard_size=sum(v.nbytes for v in state.values()) // 3)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    for path in (tmp_path / "model.safetensors", tmp_path / "model.safetensors.index.json"):
        model = owl_wms.from_pretrained(cfg, path)
        assert all(torch.equal(model.core.state_dict()[k], v) for k, v in state.items())
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match="could not be read"):
        owl_wms.from_pretrained(cfg, tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="does not exist .*index.json"):
        owl_wms.from_pretrained(cfg, tmp_path / "model.safetensors")


def test_safetensors_and_decoder(tmp_path):
    cfg = write_config(tmp_path)
    save_file(small_state(cfg), str(tmp_path / "model.safetensors"))
    (tmp_path / "vae").symlink_to(REPO / "checkpoints" / "untrained-tiny" / "vae")
    model, decoder = owl_wms.from_pretrained(cfg, tmp_path / "model.safetensors", return_decoder=True)
    rgb = decoder.decode(torch.randn(2, model.config.channels, 8, 8))
    assert rgb.shape == (2, 3, 64, 64) and rgb.min() >= -1 and rgb.max() <= 1
    with pytest.raises(ValueError, match="expected \\[batch, 16, h, w\\]"):
        decoder.decode(torch.randn(2, 3, 8, 8))
    lat = decoder.encode_uint8(torch.randint(0, 256, (3, 64, 64, 3), dtype=torch.uint8))
    assert lat.shape == (3, 16, 8, 8) and lat.dtype == torch.float32
    with pytest.raises(ValueError, match="expected uint8 \\[n, H, W, 3\\]"):
        decoder.encode_uint8(torch.zeros(3, 64, 64, 3))


def test_mismatch_errors_name_file_and_keys(tmp_path):
    cfg = write_config(tmp_path)
    state = small_state(cfg)
    state.pop("proj_in.weight")
    state["extra.weight"] = torch.zeros(1)
    state["proj_out.proj.bias"] = torch.zeros(3)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as err:
        owl_wms.from_pretrained(cfg, path)
    msg = str(err.value)
    assert str(path) in msg and "proj_in.weight" in msg and "extra.weight" in msg
    assert "proj_out.proj.bias: expected [16], got [3]" in msg


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_state_dict(tmp_path / "nope.safetensors")
    torch.save({"model": {"w": torch.zeros(1)}, "opt": object()}, tmp_path / "pickle.pt")
    with pytest.raises(CheckpointError, match=r"holds pickled objects other than tensors, which are never loaded "
                                              r"\(they could run code\): Unsupported global"):  # weights_only
        read_state_dict(tmp_path / "pickle.pt")
    from owl_wms.config import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):
        owl_wms.from_pretrained(tmp_path / "missing.yaml", tmp_path / "x.pt")


def test_config_errors_are_specific(tmp_path):
    from owl_wms.config import ConfigError, load_config

    text = (REPO / "configs" / "untrained_tiny.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text.replace("tokens_per_frame: 64", "tokens_per_frame: 60"))
    with pytest.raises(ConfigError, match="tokens_per_frame=60"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text(text.replace("schedule: [1.0, 0.25, 0.0]", "schedule: [1.0, 0.5]"))
    with pytest.raises(ConfigError, match="schedule"):
        load_config(tmp_path / "b.yaml")


def test_a_config_gives_only_what_differs_from_its_base(tmp_path):
    """``base:`` names a config relative to this one; sections merge key by key, a list is replaced whole,
    and a chain of bases merges in order."""
    from owl_wms.config import load_config

    tiny = load_config(REPO / "configs" / "untrained_tiny.yaml")
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text((REPO / "configs" / "untrained_tiny.yaml").read_text())
    (tmp_path / "sub" / "wide.yaml").write_text("base: ../base.yaml\nmodel:\n  n_heads: 4\n  d_model: 256\n"
                                                "pipeline:\n  schedule: [1.0, 0.5, 0.0]\n")
    (tmp_path / "sub" / "long.yaml").write_text("base: wide.yaml\npipeline:\n  window_frames: 48\n")
    wide, long = load_config(tmp_path / "sub" / "wide.yaml"), load_config(tmp_path / "sub" / "long.yaml")
    assert (wide.model.d_model, wide.model.n_heads, wide.model.n_layers) == (256, 4, tiny.model.n_layers)
    assert wide.pipeline.schedule == (1.0, 0.5, 0.0) and wide.pipeline.window_frames == tiny.pipeline.window_frames
    assert long.model == wide.model and long.pipeline.schedule == (1.0, 0.5, 0.0) and long.pipeline.window_frames == 48
    assert long.name == tiny.name and long.decoder == tiny.decoder
    # paths in the merged config are the loaded file's, as for any config
    assert long.resolve("clips") == tmp_path / "sub" / "clips"
    # the configs beside the shipped world's are it with what their names say changed
    shipped = load_config(REPO / "configs" / "maze_world_d128.yaml")
    changed = {"maze_world": (dict(d_model=256, n_heads=4), {}), "maze_world_d128_smooth": (dict(mouse_embed="smooth"), {}),
               "maze_world_d128_w48": ({}, dict(window_frames=48)), "maze_world_d128_w64": ({}, dict(window_frames=64))}
    for name, (model, pipeline) in changed.items():
        world = load_config(REPO / "configs" / f"{name}.yaml")
        assert world.model == dataclasses.replace(shipped.model, **model), name
        assert world.pipeline == dataclasses.replace(shipped.pipeline, **pipeline), name
        assert (world.inference, world.decoder, world.name, world.vae_scale) == \
            (shipped.inference, shipped.decoder, shipped.name, shipped.vae_scale), name


@pytest.mark.parametrize("text, message", [
    ("base: missing.yaml\n", r"'.*loop.yaml': base: '.*missing.yaml' does not exist; name a config file relative to"),
    ("base: sub\n", r"base: '.*sub' is a folder, not a config file; name a config file relative to"),
    ("base: list.yaml\n", r"base: '.*list.yaml' is not a mapping of sections \(model:, pipeline:, ...\); name a world"),
    ("base: broken.yaml\n", r"config file '.*broken.yaml' is not valid YAML"),
    ("base: 3\n", r"base=3 must name a config file, relative to this one"),
    ("base: ${model.name}\n", r"base='\$\{model.name\}' must name a config file, relative to this one \(a plain path, "
                              r"not an interpolation\)"),
    ("base: circle.yaml\n", r"base 'circle.yaml' cannot be followed \(.*\); name a config file relative to this one"),
    ("base: loop.yaml\n", r"base 'loop.yaml' leads back to itself \(.*loop.yaml -> .*loop.yaml\); break the loop"),
    ("base: other.yaml\n", r"base 'loop.yaml' leads back to itself \(.*loop.yaml -> .*other.yaml -> .*loop.yaml\)"),
    ("base: tiny.yaml\nmodel: [1]\n", r"'.*loop.yaml' cannot be merged over its base '.*tiny.yaml': .*; give each "
                                      r"section the kind \(a mapping, a list\) it has in the base"),
    ("base: tiny.yaml\nmodel:\n  d_model: wide\n", r"d_model"),
])
def test_a_bad_base_is_named_with_the_fix(tmp_path, text, message):
    from owl_wms.config import ConfigError, load_config

    (tmp_path / "tiny.yaml").write_text((REPO / "configs" / "untrained_tiny.yaml").read_text())
    (tmp_path / "other.yaml").write_text("base: loop.yaml\n")
    (tmp_path / "list.yaml").write_text("- model\n")
    (tmp_path / "broken.yaml").write_text("model: [\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "circle.yaml").symlink_to(tmp_path / "circle.yaml")  # a link to itself: resolving it loops
    (tmp_path / "loop.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "loop.yaml")


def test_a_deep_chain_of_bases_is_refused(tmp_path):
    from owl_wms.config import MAX_BASE_DEPTH, ConfigError, load_config

    (tmp_path / "c0.yaml").write_text((REPO / "configs" / "untrained_tiny.yaml").read_text())
    for i in range(1, MAX_BASE_DEPTH + 2):
        (tmp_path / f"c{i}.yaml").write_text(f"base: c{i - 1}.yaml\n")
    assert load_config(tmp_path / f"c{MAX_BASE_DEPTH}.yaml").name == "untrained-tiny"
    with pytest.raises(ConfigError, match=rf"more than {MAX_BASE_DEPTH} bases deep"):
        load_config(tmp_path / f"c{MAX_BASE_DEPTH + 1}.yaml")


def test_simulator_section_is_checked_and_sizes_come_from_the_decoder(tmp_path):
    from owl_wms.config import ConfigError, load_config
    from owl_wms.maze.worlds import sim_config

    text = (REPO / "configs" / "untrained_tiny.yaml").read_text()
    (tmp_path / "ok.yaml").write_text(text + "simulator:\n  corridor: 2\n")
    world = load_config(tmp_path / "ok.yaml")
    sim = sim_config(world, 48, 96)
    assert (sim.corridor, sim.height, sim.width) == (2, 48, 96)
    assert sim_config(load_config(REPO / "configs" / "untrained_tiny.yaml"), 64, 64).corridor == 1  # no section: the default
    for bad, message in (("corridor: 0", r"corridor.*whole number >= 1, got 0"),
                         ("corridors: 2", r"unknown simulator keys \['corridors'\]; known: .*'corridor'"),
                         ("width: 32", r"unknown simulator keys \['width'\].*the frame size is the decoder's")):
        (tmp_path / "bad.yaml").write_text(text + f"simulator:\n  {bad}\n")
        with pytest.raises(ConfigError, match=message):
            sim_config(load_config(tmp_path / "bad.yaml"), 64, 64)  # checked where the maze builds a level


@pytest.mark.parametrize("name, trained", [("maze-world", True), ("untrained-tiny", False)])
def test_shipped_checkpoints_load_and_match_their_config(name, trained):
    from inference.causvid_pipeline import DEFAULT_CHECKPOINT
    from owl_wms.config import load_config

    ckpt = REPO / "checkpoints" / name
    model, decoder = owl_wms.from_pretrained(ckpt / "config.yaml", ckpt / "model.safetensors", return_decoder=True)
    world = load_config(ckpt / "config.yaml")
    assert model.config == world.model and world.trained == trained
    assert decoder.decode(torch.zeros(1, world.model.channels, 8, 8)).shape == (1, 3, 64, 64)
    assert (DEFAULT_CHECKPOINT.name == name) == trained  # the trained world is the default
    size_mb = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**20
    assert size_mb <= 60


def test_the_decoder_runs_in_the_pipelines_dtype_within_a_level_of_float32():
    """A bf16 pipeline decodes in bf16 (its convolutions are the work that grows with a batch's
    rows); on frames of a simulator level the shipped decoder's uint8 frames stay within a level
    of float32's on average and a few levels at most."""
    from owl_wms.controls import to_uint8
    from owl_wms.engine import CausvidPipeline
    from owl_wms.maze.simulator import MazeSim

    from .conftest import fp32_settings

    pipes = {dtype: CausvidPipeline.from_checkpoint(REPO / "checkpoints" / "maze-world", verbose=False,
                                                    settings=fp32_settings().replace(dtype=dtype))
             for dtype in (torch.float32, torch.bfloat16)}
    sim = MazeSim(seed=1000123)
    walk = [1] + [0] * 10
    frames = np.stack([sim.step((3.0 if i % 4 == 0 else 0.0, 0.0), walk) for i in range(24)])
    latents = pipes[torch.float32].decoder.encode_uint8(frames)
    decoded = {}
    for dtype, pipe in pipes.items():
        assert next(pipe.decoder.parameters()).dtype == dtype
        decoded[dtype] = to_uint8(pipe.decoder.decode(latents)).int()
    diff = (decoded[torch.float32] - decoded[torch.bfloat16]).abs().float()
    assert diff.mean() < 0.5 and diff.max() <= 8, (diff.mean(), diff.max())
    assert decoded[torch.float32].float().std() > 20  # real frames with walls and floor, not a blank


ORIGINAL_YAML = """
model:
  model_id: game_rft
  sample_size: 8
  channels: 16
  n_layers: 2
  n_heads: 2
  d_model: 128
  tokens_per_frame: 64
  n_buttons: 11
  n_mouse_axes: 2
  n_frames: 60
  causal: true
  uncond: false
  backbone: dit
  has_audio: false
  rope_impl: motion
  rope_ats_delta: 2.0
  local_window: 8
  global_window: null
  cfg_prob: 0.1
train:
  trainer_id: causvid
  vae_scale: 0.35
  vae_id: dcae
  target_batch_size: 256
inference: {}
"""


def test_original_schema_loads_as_is(tmp_path):
    from owl_wms.config import load_config

    (tmp_path / "dit_v4_dmd.yml").write_text(ORIGINAL_YAML)
    world = load_config(tmp_path / "dit_v4_dmd.yml")
    assert world.vae_scale == 0.35 and world.model.n_layers == 2 and world.pipeline.window_frames == 60
    save_file(random_model(world.model).core.state_dict(), str(tmp_path / "w.safetensors"))
    model = owl_wms.from_pretrained(tmp_path / "dit_v4_dmd.yml", tmp_path / "w.safetensors")
    assert model.core.transformer.blocks[1].attn.window == 8 and model.core.transformer.blocks[0].attn.window is None
    from owl_wms.config import ConfigError

    with pytest.raises(ConfigError, match="no decoder.path"):
        owl_wms.from_pretrained(tmp_path / "dit_v4_dmd.yml", tmp_path / "w.safetensors", return_decoder=True)


def test_a_missing_decoder_folder_is_named_with_the_fix(tmp_path):
    """A checkpoint without its vae/ says which config points where and what to do, not diffusers'
    hub message about an internet connection."""
    import shutil

    from owl_wms.config import ConfigError

    ckpt = tmp_path / "tiny"
    shutil.copytree(REPO / "checkpoints" / "untrained-tiny", ckpt)
    shutil.rmtree(ckpt / "vae")
    with pytest.raises(ConfigError, match=r"config.yaml: decoder.path '.*vae' does not exist.*save_pretrained"):
        owl_wms.from_pretrained(ckpt / "config.yaml", return_decoder=True)
    (ckpt / "vae").mkdir()
    with pytest.raises(ConfigError, match=r"decoder.path '.*vae' has no config.json"):
        owl_wms.from_pretrained(ckpt / "config.yaml", return_decoder=True)


# -- checkpoints as the original trainer writes them ------------------------------------------------
def trainer_checkpoint(path, cfg, online: dict, ema: dict):
    """What the original trainer saves: ``{model, ema, opt, steps}``, its model compiled around a
    DDP wrapper and its ``ema`` an ema-pytorch ``EMA`` of that (keys ``initted``, ``step``,
    ``online_model._orig_mod.module.core.*``, ``ema_model._orig_mod.module.core.*``)."""
    from ema_pytorch import EMA
    from torch import nn

    from owl_wms.model import GameRFT

    class DataParallelNames(nn.Module):  # DDP's ``module.`` naming, without a process group
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = GameRFT(cfg).float()
    model.core.load_state_dict(online)
    compiled = torch.compile(DataParallelNames(model))  # never called: only its ``_orig_mod.`` names
    averaged = EMA(compiled, beta=0.999, update_after_step=0, update_every=1)
    averaged.ema_model._orig_mod.module.core.load_state_dict(ema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.core.proj_in.weight.sum().backward()
    opt.step()  # the optimizer state holds tensors too
    model.core.load_state_dict(online)
    torch.save({"model": compiled.module.state_dict(), "ema": averaged.state_dict(), "opt": opt.state_dict(),
                "steps": 7000}, path)
    return path


@pytest.fixture(scope="module")
def trainer_file(tmp_path_factory):
    """A trainer checkpoint whose EMA weights are a golden file's and whose online weights differ."""
    from .conftest import REPO_GOLDEN, load_golden

    golden = load_golden(REPO_GOLDEN / "gw_lt_window.safetensors")
    online = {k: v * 0.5 + 0.01 for k, v in golden["weights"].items()}
    path = trainer_checkpoint(tmp_path_factory.mktemp("trainer") / "step_7000.pt", golden["cfg"], online,
                              golden["weights"])
    return path, golden, online


def test_trainer_checkpoint_holds_what_the_original_writes(trainer_file):
    raw = torch.load(trainer_file[0], weights_only=True)
    assert set(raw) == {"model", "ema", "opt", "steps"}
    groups = {k.split(".")[0] for k in raw["ema"]}
    assert groups == {"initted", "step", "online_model", "ema_model"}
    assert all(k.startswith(("ema_model._orig_mod.module.core.", "online_model._orig_mod.module.core."))
               for k in raw["ema"] if "." in k)
    with pytest.raises(RuntimeError, match="Unexpected key"):  # what a plain strict load says of it
        from owl_wms.model import GameRFT

        GameRFT(trainer_file[1]["cfg"]).core.load_state_dict(raw["ema"])


def test_trainer_checkpoint_loads_ema_by_default_and_reproduces_the_golden_decode(trainer_file):
    from inference.causvid_pipeline import CausvidPipeline
    from owl_wms.loading import build_model, load_weights, read_weights

    from .conftest import fp32_settings, tiny_world
    from .conftest import golden_decode, golden_error
    from .test_golden import TOL

    path, golden, online = trainer_file
    loaded = read_weights(path)
    assert loaded.kind == "ema" and loaded.where == "ema: ema_model.*"
    assert loaded.describe().startswith("ema (ema: ema_model.*, ")
    model = load_weights(build_model(golden["cfg"]), loaded.tensors, str(path)).float().eval()
    g = golden["t"]
    pipe = CausvidPipeline(model, None, tiny_world(golden["cfg"], golden["window"]), fp32_settings(), verbose=False)
    assert golden_error(golden_decode(pipe, g), g) <= TOL
    with torch.no_grad():
        out = model(g["full.x"], g["full.t"], g["full.mouse"], g["full.btn"])
    assert (out - g["full.out"]).abs().max().item() <= TOL


def test_trainer_checkpoint_online_weights_on_request(trainer_file):
    from owl_wms.loading import read_weights

    path, _, online = trainer_file
    loaded = read_weights(path, "online")
    assert loaded.kind == "online" and loaded.where == "model"  # the trainer's own entry, not the EMA's copy
    assert loaded.tensors.keys() == online.keys()
    assert all(torch.equal(loaded.tensors[k], online[k]) for k in online)


def test_pipeline_start_up_line_says_which_weights(tmp_path, capsys):
    """A world whose weights file is a trainer checkpoint: the start-up line names the set taken."""
    from inference.causvid_pipeline import CausvidPipeline

    cfg_path = write_config(tmp_path)
    (tmp_path / "vae").symlink_to(REPO / "checkpoints" / "untrained-tiny" / "vae")
    from owl_wms.config import load_config

    cfg = load_config(cfg_path).model
    state = small_state(cfg_path)
    trainer_checkpoint(tmp_path / "t.pt", cfg, {k: v + 1 for k, v in state.items()}, state)
    pipe = CausvidPipeline.from_checkpoint(cfg_path, tmp_path / "t.pt", clip=None)
    assert "weights=ema (ema: ema_model.*," in capsys.readouterr().out
    loaded = pipe.runner.model.core.state_dict()  # in the pipeline's compute dtype
    assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in state.items())
    CausvidPipeline.from_checkpoint(cfg_path, tmp_path / "t.pt", clip=None, weights="online")
    assert "weights=online (model, " in capsys.readouterr().out


def test_ambiguous_checkpoints_are_refused_with_what_they_hold(tmp_path):
    from owl_wms.loading import read_weights

    state = {"core.proj_in.weight": torch.zeros(2, 2), "core.t_embed.mlp.fc1.bias": torch.zeros(2)}
    ema_state = {"initted": torch.tensor(True), "step": torch.tensor(3),
                 **{f"ema_model.{k}": v for k, v in state.items()}}
    cases = [
        # EMA copies beside stray tensors: which is the model?
        ({**ema_state, "proj_in.weight": torch.zeros(2, 2)}, None,
         r"ambiguous \(EMA copies sit beside 1 other tensors \(proj_in\.\*\)\)"),
        # two keys that name the same weight once the wrappers are stripped
        ({**state, "module.core.proj_in.weight": torch.ones(2, 2)}, None,
         r"keys 'core\.proj_in\.weight' and 'module\.core\.proj_in\.weight' .* both name weight 'proj_in\.weight'"),
        # asked for weights the file does not have
        (state, "ema", r"it has no ema weights \(it has: state dict \(file\)\)"),
        ({"ema": ema_state, "steps": 5}, "online", r"it has no online weights \(it has: ema \(ema: ema_model\.\*\)\)"),
        # a state_dict entry beside the trainer's entries
        ({"model": state, "state_dict": state}, None, r"a 'state_dict' entry sits beside other weights"),
        ({"opt": {"state": {}}, "steps": 3}, None, r"no state dict of tensors found"),
    ]
    for i, (obj, choice, message) in enumerate(cases):
        path = tmp_path / f"{i}.pt"
        torch.save(obj, path)
        with pytest.raises(CheckpointError, match=message) as err:
            read_weights(path, choice)
        assert str(path) in str(err.value) and "It holds " in str(err.value)
    torch.save({"model": state, "ema": ema_state, "steps": 5}, tmp_path / "t.pt")
    with pytest.raises(CheckpointError, match=r"weights='best' is not one of \['ema', 'online'\]"):
        read_weights(tmp_path / "t.pt", "best")


def test_game_cli_takes_weights_and_refuses_a_set_the_file_lacks(tmp_path):
    import subprocess
    import sys

    cfg_path = write_config(tmp_path)
    for folder in ("vae", "clips"):
        (tmp_path / folder).symlink_to(REPO / "checkpoints" / "untrained-tiny" / folder)
    from owl_wms.config import load_config

    state = small_state(cfg_path)
    trainer_checkpoint(tmp_path / "t.pt", load_config(cfg_path).model, {k: v + 1 for k, v in state.items()}, state)
    torch.save({"ema": {f"ema_model.{k}": v for k, v in state.items()}, "steps": 3}, tmp_path / "ema_only.pt")

    def game(ckpt, *extra):
        return subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--frames", "2",
                               "--checkpoint", str(cfg_path), "--ckpt", str(ckpt), "--out", str(tmp_path / "x.mp4"),
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=time_limit(300))

    r = game(tmp_path / "t.pt", "--weights", "online")
    assert r.returncode == 0, r.stderr
    assert "weights=online (model, " in r.stdout and "rope=motion" in r.stdout
    r = game(tmp_path / "ema_only.pt", "--weights", "online")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "has no online weights (it has: ema (ema: ema_model.*))" in r.stderr and "It holds entries 'ema'" in r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_modulations_give_the_same_numbers_and_a_weight_load_writes_through(dtype):
    """Transformer.fuse_modulations (the CPU runner's): every block's conditioning projections as
    one matmul gives the separate projections' bits, keeps the state dict's names, and a weight
    load or an in-place update afterwards reaches the fused weight (its parameters view it)."""
    import copy

    from .conftest import tiny_config

    cfg = tiny_config()
    apart, other = random_model(cfg, 0).to(dtype), random_model(cfg, 1).to(dtype)
    fused = copy.deepcopy(apart)
    fused.core.transformer.fuse_modulations()
    fused.core.transformer.fuse_modulations()  # fused already: unchanged
    g = torch.Generator().manual_seed(3)
    b, n, c, s = 2, 3, cfg.channels, cfg.sample_size
    inputs = (torch.randn(b, n, c, s, s, generator=g), torch.rand(b, n, generator=g), torch.randn(b, n, 2, generator=g),
              (torch.rand(b, n, cfg.n_buttons, generator=g) > 0.5).float())
    with torch.no_grad():
        assert torch.equal(fused(*inputs), apart(*inputs))
        assert set(fused.state_dict()) == set(apart.state_dict())
        fused.load_state_dict(other.state_dict())
        assert torch.equal(fused(*inputs), other(*inputs))
        fused.core.transformer.blocks[0].gate1.fc_c.weight.mul_(2)
        other.core.transformer.blocks[0].gate1.fc_c.weight.mul_(2)
        assert torch.equal(fused(*inputs), other(*inputs))
