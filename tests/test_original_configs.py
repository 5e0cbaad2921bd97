"""The original's own configs: copies of the ``model:`` sections of its YAMLs (tests/data/original_configs,
from Wayfarer-Labs/owl-wms branch laptop_inference_v2_bf16, commit 39983ec) and the state-dict names
and shapes its code builds from them (state_dict_shapes.json, read off the original on the meta device)."""
import json

import pytest
import torch

from owl_wms.config import ConfigError, load_config
from owl_wms.model import GameRFT

from .conftest import REPO

DATA = REPO / "tests" / "data" / "original_configs"
SHAPES = json.loads((DATA / "state_dict_shapes.json").read_text())
VIDEO = ["dit_v2", "dit_v3", "dit_v4", "dit_v4_5B", "dit_v4_dmd", "dit_v4_prune", "dit_v4_sf"]


@pytest.mark.parametrize("name", VIDEO)
def test_original_config_builds_the_original_state_dict(name):
    cfg = load_config(DATA / f"{name}.yaml").model
    with torch.device("meta"):
        model = GameRFT(cfg)
    ours = {k: list(v.shape) for k, v in model.core.state_dict().items()}
    assert ours == SHAPES[name]
    assert sum(p.numel() for p in model.parameters()) == SHAPES["_params"][name]


def test_original_configs_mean_what_they_meant_to_the_original():
    v2, v4, prune = (load_config(DATA / f"{n}.yaml").model for n in ("dit_v2", "dit_v4", "dit_v4_prune"))
    assert v2.rope_impl == v4.rope_impl == "motion" and v2.global_window == 256 and v4.global_window is None
    # Decoding, global layers see the whole cache whatever global_window says; local layers 16 frames.
    assert [v2.decode_window(i) for i in (0, 1, 4)] == [None, 16, None]
    assert [v2.layer_window(i) for i in (0, 1)] == [256, 16]
    assert prune.local_idx == 2 and [prune.is_local(i) for i in range(4)] == [False, True, False, True]


def test_a_config_without_rope_impl_means_ortho(tmp_path):
    text = (DATA / "dit_v4.yaml").read_text()
    (tmp_path / "c.yaml").write_text("\n".join(ln for ln in text.splitlines() if "rope_impl" not in ln))
    cfg = load_config(tmp_path / "c.yaml").model
    assert cfg.rope_impl == "ortho"
    (tmp_path / "d.yaml").write_text("\n".join(ln for ln in text.splitlines()
                                               if "rope_impl" not in ln and "n_frames" not in ln))
    with pytest.raises(ConfigError, match=r"model.n_frames=None .*ortho RoPE .*n_frames the model was trained with"):
        load_config(tmp_path / "d.yaml")


@pytest.mark.parametrize("name,reason", [
    ("mmdit_v1", r"model_id='game_rft_audio' is not supported: it is the audio-video GameRFT"),
    ("mmdit_v2", r"model_id='game_rft_audio' is not supported: it is the audio-video GameRFT"),
    ("av_v4_8x8", r"model_id='game_rft_audio' is not supported: it is the audio-video GameRFT"),
])
def test_other_model_kinds_are_refused_with_the_reason(name, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(DATA / f"{name}.yaml")


@pytest.mark.parametrize("edit,reason", [
    (("model_id: game_rft", "model_id: game_rft\n  backbone: mmdit"), r"backbone='mmdit' .*multi-modal DiT"),
    (("has_audio: false", "has_audio: true"), r"has_audio=True .*audio tokens"),
    (("causal: true", "causal: false"), r"causal=False .*frame-causal"),
    (("n_buttons: 11", "n_buttons: 8"), r"n_buttons/n_mouse_axes=\(8, 2\)"),
    (("rope_impl: motion", "rope_impl: alibi"), r"rope_impl='alibi' .*\['motion', 'ortho'\]"),
    (("n_heads: 24", "n_heads: 7"), r"n_heads=7 .*divisible"),
])
def test_unsupported_keys_name_the_key_value_and_reason(tmp_path, edit, reason):
    text = (DATA / "dit_v4.yaml").read_text()
    if edit[0].startswith("model_id"):
        text = text.replace("  backbone: dit\n", "")
    assert edit[0] in text
    (tmp_path / "c.yaml").write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(ConfigError, match=reason):
        load_config(tmp_path / "c.yaml")
