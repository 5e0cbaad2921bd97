"""Checkpoint loading for original GameRFT state dicts and our own safetensors."""
from __future__ import annotations

import json
import pickle
import pickletools
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from .config import ModelConfig, WorldConfig, load_config
from .model import GameRFT

# The world this repository ships and loads when no checkpoint is named.
SHIPPED_WORLD = Path(__file__).resolve().parent.parent / "checkpoints" / "maze-world"


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


WEIGHT_CHOICES = ("ema", "online")
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "core.")  # torch.compile, DDP, the GameRFT wrapper
EMA_BOOKKEEPING = ("initted", "step")  # ema-pytorch's buffers beside its two model copies


@dataclass(frozen=True)
class Weights:
    """One set of model weights read from a checkpoint, and where in the file it was."""

    tensors: dict[str, torch.Tensor]
    kind: str  # "ema", "online" or "state dict" (one set, not named as either)
    where: str  # the entry and key prefix, e.g. "ema: ema_model.*"; "file" for a plain state dict

    def describe(self) -> str:
        where = "" if self.where == "file" else f"{self.where}, "
        return f"{self.kind} ({where}{len(self.tensors)} tensors)"


def weights_beside(config_path) -> Path:
    """The weights a config file names by default: ``model.safetensors`` in its folder."""
    return Path(config_path).parent / "model.safetensors"


def shipped_checkpoint_of(config_path) -> Path | None:
    """The checkpoint folder beside the shipped world that holds the world ``config_path`` names,
    the same model, with its weights (a config without weights is usually the recipe such a
    folder was made from)."""
    try:
        world = load_config(config_path)
        folder = SHIPPED_WORLD.parent / world.name
        config = folder / "config.yaml"
        if Path(config_path).resolve() == config.resolve() or not config.is_file():
            return None
        if load_config(config).model != world.model:
            return None
    except Exception:  # noqa: BLE001 - a config that does not parse names no folder; its own error comes later
        return None
    weights = weights_beside(config)
    return folder if weights.is_file() or shard_index(weights) is not None else None


def check_weights_present(path: Path, config_path=None) -> None:
    """Before anything loads: ``path`` (a file, or a sharded file's index) exists. ``config_path``:
    the config whose default weights ``path`` is (the error then says to pass a file)."""
    if path.is_file() or shard_index(path) is not None or path.is_dir():
        return  # a folder: _read_file names it
    if config_path is not None:
        folder = shipped_checkpoint_of(config_path)
        raise CheckpointError(f"config {str(config_path)!r} has no weights beside it ({str(path)!r} does not exist); "
                              + (f"the checkpoint folder {str(folder)!r} holds this world with its weights: pass "
                                 "that folder as the checkpoint (--checkpoint), or " if folder is not None else "")
                              + "pass the weights file with --ckpt (Python: ckpt_path=), or a checkpoint folder that "
                                "holds config.yaml and model.safetensors")
    raise CheckpointError(f"checkpoint file {str(path)!r} does not exist (nor a sharded {path.name}.index.json "
                          "beside it); pass the path of a .safetensors, its .safetensors.index.json, or a .pt file")


def weights_path(ckpt_path, config_path) -> Path:
    """The weights file to read, checked to be there: ``ckpt_path``, or (None) the weights beside
    the config file ``config_path``."""
    if ckpt_path is None:
        path = weights_beside(config_path)
        check_weights_present(path, config_path)
        return path
    path = Path(ckpt_path)
    check_weights_present(path)
    return path


def _read_file(path: Path):
    index = shard_index(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint file {str(path)!r} is a folder; pass the weights file in it, e.g. "
                              f"{str(path / 'model.safetensors')!r}")
    check_weights_present(path)
    try:
        if index is not None:
            return _load_shards(index)
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)  # never unpickle arbitrary objects
    except pickle.UnpicklingError as exc:  # torch's message suggests weights_only=False: never taken here
        if not refused_as_unsafe(exc):
            raise CheckpointError(f"checkpoint file {str(path)!r} could not be read: it is damaged or not a torch "
                                  f"file{unpickler_reason(exc)}") from None
        raise CheckpointError(f"checkpoint file {str(path)!r} holds pickled objects other than tensors, which are "
                              f"never loaded (they could run code){unpickler_reason(exc)}; save the "
                              "weights as a state dict of tensors (safetensors: safetensors.torch.save_file)") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} could not be read: {exc}") from exc


def refused_as_unsafe(exc: Exception) -> bool:
    """torch's weights-only unpickler refused a real pickle instruction (a global, an object),
    not bytes that are no pickle at all (a damaged file)."""
    text = str(exc)
    if "Unsupported global" in text:
        return True
    found = re.search(r"Unsupported operand (\d+)", text)
    return found is not None and int(found.group(1)) in {ord(op.code) for op in pickletools.opcodes}


def unpickler_reason(exc: Exception) -> str:
    """The line of torch's weights-only refusal that names what was refused (": ..."), if any."""
    _, marker, rest = str(exc).partition("WeightsUnpickler error:")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    return f": {lines[0][:160]}" if marker and lines else ""


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _group(keys) -> dict[str, int]:
    """Keys counted by their first name component (``ema_model.*``: 312)."""
    groups: dict[str, int] = {}
    for k in keys:
        head = k.split(".", 1)[0] + (".*" if "." in k else "")
        groups[head] = groups.get(head, 0) + 1
    return groups


def describe_contents(obj) -> str:
    """What a checkpoint holds, for error messages: entries, key groups, tensor counts."""
    def one(value) -> str:
        if _is_tensor_dict(value):
            return "{" + ", ".join(f"{k}: {n}" if n > 1 or k.endswith("*") else k
                                   for k, n in _group(value).items()) + "}"
        if isinstance(value, dict):
            return f"a dict of {len(value)} non-tensor entries"
        if isinstance(value, torch.Tensor):
            return f"a tensor {tuple(value.shape)}"
        return f"{type(value).__name__} {value!r}"[:60]

    if _is_tensor_dict(obj):
        return f"one dict of {len(obj)} tensors {one(obj)}"
    if isinstance(obj, dict):
        return "entries " + "; ".join(f"{k!r}: {one(v)}" for k, v in obj.items())
    return f"a {type(obj).__name__}"


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
    return key


def _candidates(obj) -> tuple[list[tuple[str, str, dict]], list[str]]:
    """The weight sets a checkpoint holds, as (kind, where, raw tensors), and what makes it
    ambiguous (reasons; empty when the sets are well defined)."""
    sets, problems = [], []

    def from_tensors(entry: str | None, sd: dict, plain_kind: str, online_copy: bool = True):
        label = f"{entry}: " if entry else ""
        ema = {k[len("ema_model."):]: v for k, v in sd.items() if k.startswith("ema_model.")}
        online = {k[len("online_model."):]: v for k, v in sd.items() if k.startswith("online_model.")}
        if not ema and not online:
            sets.append((plain_kind, entry or "file", sd))
            return
        # An ema-pytorch EMA state dict: two model copies and its step counters, nothing else.
        other = sorted(k for k in sd if not k.startswith(("ema_model.", "online_model.")) and k not in EMA_BOOKKEEPING)
        if other:
            problems.append(f"{label}EMA copies sit beside {len(other)} other tensors ({', '.join(_group(other))})")
        if ema:
            sets.append(("ema", f"{label}ema_model.*", ema))
        if online and online_copy:
            sets.append(("online", f"{label}online_model.*", online))

    if _is_tensor_dict(obj):
        from_tensors(None, obj, "state dict")
    elif isinstance(obj, dict):
        # The original trainer's {model, ema, opt, steps}; other wrappers keep weights under
        # "state_dict". Entries that are not weights (optimizer, scheduler, counters) are skipped.
        # The trainer's "model" entry and the EMA's online copy are the same weights: the entry
        # stands for both.
        has_model = _is_tensor_dict(obj.get("model"))
        for entry, kind in (("ema", "ema"), ("model", "online"), ("state_dict", "state dict")):
            if _is_tensor_dict(obj.get(entry)):
                from_tensors(entry, obj[entry], kind, online_copy=not (entry == "ema" and has_model))
        if any(k == "state dict" for k, _, _ in sets) and len(sets) > 1:
            problems.append("a 'state_dict' entry sits beside other weights")
    return sets, problems


def read_weights(path: str | Path, choice: str | None = None) -> Weights:
    """The model weights of a checkpoint: a plain state dict (safetensors, shards or .pt), the
    original trainer's ``{model, ema, opt, steps}`` whose ``ema`` is an ema-pytorch state dict
    (``initted``, ``step``, ``online_model.*``, ``ema_model.*``), or a dict wrapping one under
    ``ema``, ``model`` or ``state_dict``. Wrapper prefixes (``_orig_mod.``, ``module.``,
    ``core.``) are stripped.

    ``choice``: "ema" or "online" (the model the trainer optimised); None takes the EMA weights
    where the file has them, as the original does, else its only set. A file whose weights cannot
    be told apart is refused with a list of what it holds.
    """
    path = Path(path)
    if choice is not None and choice not in WEIGHT_CHOICES:
        raise CheckpointError(f"weights={choice!r} is not one of {list(WEIGHT_CHOICES)} (or none: EMA if present)")
    obj = _read_file(path)
    sets, problems = _candidates(obj)

    def refuse(reason: str):
        raise CheckpointError(f"checkpoint file {str(path)!r}: {reason}. It holds {describe_contents(obj)}")

    if problems:
        refuse("its weights are ambiguous (" + "; ".join(problems) + ")")
    if not sets:
        refuse("no state dict of tensors found (expected one, or the entries 'ema', 'model' or 'state_dict')")
    by_kind: dict[str, list] = {}
    for kind, where, sd in sets:
        by_kind.setdefault(kind, []).append((where, sd))
    if choice is None:
        kind = "ema" if "ema" in by_kind else next(iter(by_kind)) if len(by_kind) == 1 else None
        if kind is None:
            refuse(f"it holds several weight sets ({', '.join(by_kind)}) and none is EMA; choose one")
    else:
        kind = choice
        if kind not in by_kind:
            have = ", ".join(f"{k} ({w[0][0]})" for k, w in by_kind.items())  # e.g. "ema (ema: ema_model.*)"
            refuse(f"it has no {kind} weights (it has: {have}); choose one of those")
    if len(by_kind[kind]) > 1:
        refuse(f"it holds several {kind} weight sets ({', '.join(w for w, _ in by_kind[kind])})")
    where, raw = by_kind[kind][0]
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    for k, v in raw.items():
        name = _strip(k)
        if name in tensors:
            refuse(f"keys {sources[name]!r} and {k!r} of {where} both name weight {name!r}")
        tensors[name], sources[name] = v, k
    return Weights(tensors, kind, where)


def read_state_dict(path: str | Path, choice: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``read_weights`` (the EMA weights by default)."""
    return read_weights(path, choice).tensors


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
    broken = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v.float()).all()]
    if broken:
        raise CheckpointError(f"checkpoint {source} holds non-finite weights (NaN or inf) in {len(broken)} tensors, "
                              f"e.g. {broken[:3]}; it would render garbage: use an earlier checkpoint of the run")
    model.core.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    return model


def build_model(cfg: ModelConfig) -> GameRFT:
    return GameRFT(cfg)


def from_pretrained(cfg_path, ckpt_path=None, return_decoder: bool = False, weights: str | None = None):
    """Model (and decoder) from a config and a checkpoint, like the original's entry point.

    ``ckpt_path`` defaults to ``model.safetensors`` beside the config; ``weights`` as in
    ``read_weights`` (EMA where the file has them).
    """
    world: WorldConfig = load_config(cfg_path)
    ckpt_path = weights_path(ckpt_path, cfg_path)
    model = load_weights(build_model(world.model), read_state_dict(ckpt_path, weights), str(ckpt_path)).eval()
    if not return_decoder:
        return model
    from .vae import load_decoder

    return model, load_decoder(world)
