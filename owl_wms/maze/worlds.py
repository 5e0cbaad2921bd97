"""A world's maze levels as pipeline starts: the simulator a world was trained on (its config's
``simulator:`` section at the decoder's frame size) and a fresh level's encoded history."""
from __future__ import annotations

import dataclasses

from ..clips import Clip
from ..config import ConfigError, WorldConfig
from .data import level_clip
from .simulator import SimConfig

SIM_KEYS = sorted(f.name for f in dataclasses.fields(SimConfig) if f.name not in ("width", "height"))


def sim_config(world: WorldConfig, height: int, width: int) -> SimConfig:
    """The simulator ``world`` was trained on, rendering frames of ``height`` x ``width``."""
    source = str(world.path) if world.path is not None else f"world {world.name!r}"
    unknown = sorted(set(world.simulator) - set(SIM_KEYS))
    if unknown:
        raise ConfigError(f"{source}: unknown simulator keys {unknown}; known: {SIM_KEYS} (the frame size is "
                          "the decoder's, not a simulator key)")
    try:
        return SimConfig(height=height, width=width, **world.simulator)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: simulator section {world.simulator} is invalid: {exc}") from exc


def check_simulator(world: WorldConfig) -> None:
    """Refuse a world whose ``simulator:`` section the maze cannot build (at start-up, not at the
    first level)."""
    sim_config(world, 64, 64)


def pipeline_sim_config(pipe) -> SimConfig:
    """The simulator of ``pipe``'s world at its decoded frame size."""
    return sim_config(pipe.world, *pipe.frame_shape)


def load_level(pipe, seed: int, future: int = 1000) -> Clip:
    """Start ``pipe`` from a fresh simulator level: a history window rendered with the exploring
    policy and encoded with the pipeline's autoencoder, plus ``future`` policy actions kept for
    ground-truth replay. Returns the clip."""
    if pipe.decoder is None:
        raise RuntimeError("starting from a simulator level needs the autoencoder (no decoder loaded)")
    clip, _ = level_clip(pipe.decoder, seed, pipe.window, future, pipeline_sim_config(pipe), name=f"world-{seed}")
    return pipe.load_clip(clip)
