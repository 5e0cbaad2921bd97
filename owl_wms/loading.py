"""Checkpoint loading for original GameRFT state dicts and our own safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .config import ModelConfig, WorldConfig, load_config
from .model import GameRFT

PREFIXES = ("_orig_mod.", "module.", "ema_model.", "core.")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not match its config."""


def shard_index(path: Path) -> Path | None:
    """The index of a sharded safetensors checkpoint (diffusers/transformers layout:
    ``model.safetensors.index.json`` beside ``model-0000i-of-0000n.safetensors``) that ``path``
    names, either as the index itself or as the single file it replaces."""
    if path.name.endswith(".safetensors.index.json"):
        return path
    index = path.with_name(path.name + ".index.json")
    return index if path.suffix == ".safetensors" and not path.exists() and index.is_file() else None


def _load_shards(index: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads(index.read_text())["weight_map"]
    sd = {}
    for shard in sorted(set(weight_map.values())):
        sd.update(load_file(str(index.parent / shard)))
    if sd.keys() != weight_map.keys():
        raise ValueError(f"the shards hold {len(sd)} tensors but the index lists {len(weight_map)}")
    return sd


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    index = shard_index(path)
    if not path.is_file() and index is None:
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist (nor a sharded "
                              f"{path.name}.index.json beside it); pass the path of a .safetensors, its "
                              ".safetensors.index.json, or a .pt file")
    try:
        if index is not None:
            sd = _load_shards(index)
        elif path.suffix == ".safetensors":
            sd = load_file(str(path))
        else:  # never unpickle arbitrary objects
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} could not be read: {exc}") from exc
    for wrapper in ("ema", "model", "state_dict"):
        if isinstance(sd, dict) and isinstance(sd.get(wrapper), dict):
            sd = sd[wrapper]
            break
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"checkpoint file {str(path)!r} does not hold a state dict of tensors")
    return {strip_prefixes(k): v for k, v in sd.items()}


def strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
    return key


def load_weights(model: GameRFT, state: dict[str, torch.Tensor], source: str = "checkpoint") -> GameRFT:
    """Strict load into ``model.core`` with an error that lists every mismatch."""
    expected = model.core.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [(k, tuple(expected[k].shape), tuple(state[k].shape)) for k in sorted(set(expected) & set(state))
              if expected[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        lines = [f"checkpoint {source} does not match the model config:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
        for k, e, g in shapes[:20]:
            lines.append(f"  shape mismatch {k}: expected {list(e)}, got {list(g)}")
        lines.append("  fix: pass the config the checkpoint was trained with")
        raise CheckpointError("\n".join(lines))
    model.core.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    return model


def build_model(cfg: ModelConfig) -> GameRFT:
    return GameRFT(cfg)


def from_pretrained(cfg_path, ckpt_path=None, return_decoder: bool = False):
    """Model (and decoder) from a config and a checkpoint, like the original's entry point.

    ``ckpt_path`` defaults to ``model.safetensors`` beside the config.
    """
    world: WorldConfig = load_config(cfg_path)
    ckpt_path = Path(ckpt_path) if ckpt_path is not None else Path(cfg_path).parent / "model.safetensors"
    model = load_weights(build_model(world.model), read_state_dict(ckpt_path), str(ckpt_path)).eval()
    if not return_decoder:
        return model
    from .vae import load_decoder

    return model, load_decoder(world)
