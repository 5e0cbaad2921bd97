"""Pipeline snapshots: the cache, offsets, lifecycle, recompute anchor, noise generator and
replay position, as tensors + metadata, in memory or in a safetensors file (two stages: the
cache comes from and goes back to the generating rank). A snapshot loads
only into a pipeline of the same world, model, window, schedule, guidance and settings, and then
continues with identical frames."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

STATE_FORMAT = "owl-pipeline-state/2"
# Settings a snapshot may differ in: the generator state and the bias travel in the snapshot.
VOLATILE = {"seed", "threads", "profile_kv", "profile_kv_first", "profile_kv_every", "tp_check_every", "tp_timeout_s",
            "tp_reduce", "kv_cache_attention_bias"}
PARTS = ("noise", "lifecycle", "anchor", "replay", "cache")


def identity(pipe) -> str:
    """What a snapshot must match: world, model config, window, schedule, guidance and settings."""
    s = {k: str(v) for k, v in vars(pipe.settings).items() if k not in VOLATILE}
    guided = [pipe.guidance] if pipe.guidance != 1 else []  # unguided snapshots keep their identity
    text = json.dumps([pipe.world.name, pipe.cfg.to_dict(), pipe.window, list(pipe.schedule), pipe.alpha, s, *guided],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def get_state(pipe) -> dict:
    """A snapshot of ``pipe`` (copies): {"tensors": {...}, "meta": {...}}, each of its parts'
    ``state()`` under the part's name."""
    if pipe.tp is not None:
        raise RuntimeError("snapshots of a tensor-parallel pipeline are not supported (each rank holds "
                           "only its heads); snapshot a single-process run")
    cache = pipe.stages.cache_state() if pipe.stages is not None else pipe.cache.state_dict()  # two stages: the mesh's
    parts = {"noise": ({"rng": pipe.noise.state()}, {}), "lifecycle": ({}, pipe.lifecycle.state()),
             "anchor": pipe.recompute_anchor.state(), "replay": pipe.replay.state(), "cache": cache}
    tensors = {f"{name}.{k}": v.detach().clone() for name, (ts, _) in parts.items() for k, v in ts.items()}
    meta = {"format": STATE_FORMAT, "identity": identity(pipe), "world": pipe.world.name,
            "parts": {name: m for name, (_, m) in parts.items()}}
    return {"tensors": tensors, "meta": meta}


@torch.no_grad()
def load_state(pipe, state: dict | str | Path):
    """Restore a snapshot from ``get_state`` or a file written by ``save_state``: each part
    restores its own state, all of them or none."""
    if not isinstance(state, dict):
        state = read_state(state)
    tensors, meta = state["tensors"], state["meta"]
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"snapshot format {meta.get('format')!r} is not {STATE_FORMAT!r}")
    if meta["identity"] != identity(pipe):
        raise ValueError(f"snapshot was taken from world {meta['world']!r} with other model or settings "
                         f"(identity {meta['identity']}, this pipeline {identity(pipe)}); load it into a "
                         "pipeline built from the same checkpoint and settings")
    said = meta.get("parts")
    missing = [name for name in PARTS if not isinstance(said, dict) or not isinstance(said.get(name), dict)]
    if missing or "noise.rng" not in tensors:
        raise ValueError(f"snapshot of format {STATE_FORMAT!r} lacks the state of {', '.join(missing) or 'the noise'}: "
                         "the file is damaged; save the snapshot again")
    # All or nothing: a snapshot that matches this pipeline but holds a damaged part (a tensor
    # missing or of another shape, say) is refused part way; the state it had goes back in, whole.
    before = get_state(pipe)
    try:
        restore(pipe, split_parts(tensors, said))
    except DamagedPart as exc:
        restore(pipe, split_parts(before["tensors"], before["meta"]["parts"]))
        raise ValueError(f"snapshot refused: its {exc.part} state does not fit this pipeline ({exc.reason}); the "
                         "pipeline keeps the state it had; the file is damaged: save the snapshot again") from exc


def restore(pipe, parts: dict) -> None:
    """Every part of a snapshot into ``pipe``."""
    if pipe.stages is not None:  # two stages: the mesh's cache and lifecycle first, refused there or restored
        pipe.stages.load_cache_state(*parts["cache"], parts["lifecycle"][1])
        restore_parts(pipe, parts, HOST_PARTS)
    else:
        restore_parts(pipe, parts, ("cache", *HOST_PARTS))


HOST_PARTS = ("anchor", "replay", "lifecycle", "noise")  # restored in this order, after the cache


class DamagedPart(Exception):
    def __init__(self, part: str, exc: BaseException):
        super().__init__(part)
        self.part, self.reason = part, f"{type(exc).__name__}: {exc}"


def split_parts(tensors: dict, said: dict) -> dict[str, tuple[dict, dict]]:
    """A snapshot's tensors and metadata by part: {part: (tensors without the prefix, meta)}."""
    return {name: ({k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}, said[name])
            for name in PARTS}


def restore_parts(pipe, parts: dict, names: tuple[str, ...]) -> None:
    """Each named part restores its own state; the first that cannot raises ``DamagedPart``."""
    restorers = {"cache": lambda ts, meta: pipe.cache.load_state_dict(ts, meta),
                 "anchor": pipe.recompute_anchor.restore, "replay": pipe.replay.restore,
                 "lifecycle": lambda ts, meta: pipe.lifecycle.load_state(meta),
                 "noise": lambda ts, meta: pipe.noise.restore(ts["rng"])}
    for name in names:
        try:
            restorers[name](*parts[name])
        except Exception as exc:
            raise DamagedPart(name, exc) from exc


def save_state(pipe, path: str | Path) -> Path:
    """Write ``get_state(pipe)`` to a safetensors file (atomically: a crash leaves no partial file)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save the snapshot to {str(path)!r}: folder {str(path.parent)!r} "
                                "does not exist")
    state = get_state(pipe)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in state["tensors"].items()}, str(tmp),
                  metadata={"owl_state": json.dumps(state["meta"])})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_state(path: str | Path) -> dict:
    """A snapshot file written by ``save_state``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"snapshot {str(path)!r} does not exist")
    with safe_open(str(path), "pt") as f:
        meta = (f.metadata() or {}).get("owl_state")
    if meta is None:
        raise ValueError(f"{str(path)!r} is a safetensors file but not a pipeline snapshot (no owl_state metadata)")
    return {"tensors": load_file(str(path)), "meta": json.loads(meta)}
