"""World configs: the original GameRFT YAML schema plus our pipeline/decoder keys.

A config file has the original sections (``model:``, ``train:`` with ``vae_scale``,
``inference:``) and ours beside them (``pipeline:``, ``decoder:``, ``simulator:`` for a world
trained on our maze: the ``SimConfig`` fields its episodes were made with, which fresh levels,
clips and the evaluation must use too). Relative paths in
``pipeline.clips`` and ``decoder.path`` are resolved against the config file's folder.

A config may name another as its ``base:`` (a path relative to itself) and give only what differs:
its sections are merged over the base's, key by key (a list is replaced whole), and relative
paths resolve against the file loaded, not the base. A checkpoint's config.yaml is written merged
and resolved, so a checkpoint folder never depends on a file outside it.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .controls import MOUSE_AXES, N_BUTTONS


class ConfigError(ValueError):
    """A config file is missing, malformed, or describes something we cannot build."""


# Model kinds of the original code base that this engine does not implement, and why.
OTHER_MODEL_KINDS = {
    "game_rft_audio": "it is the audio-video GameRFT (video and audio tokens in every frame); this engine "
                      "implements the video-only GameRFT (model_id: game_rft)",
    "game_mft_audio": "it is the audio-video GameMFT (a mean-flow transformer); this engine implements the "
                      "video-only GameRFT (model_id: game_rft)",
}
OTHER_BACKBONES = {
    "mmdit": "the multi-modal DiT backbone (separate audio and video streams) is not implemented; "
             "this engine runs backbone: dit",
    "uvit": "the U-ViT backbone (skip projections between early and late blocks) is not implemented; "
            "this engine runs backbone: dit",
}
ROPE_KINDS = ("motion", "ortho")
# How the mouse enters the conditioning: "sincos" is the original's (original checkpoints need it);
# "smooth" is an option for worlds trained here (owl_wms.model.SmoothMouseEmbedding)
MOUSE_EMBEDDINGS = ("sincos", "smooth")
# The original's production model (docs/architecture.md, The model), for benchmarks at full size;
# n_frames is its RoPE table length, which only ortho RoPE reads.
PRODUCTION = dict(sample_size=8, channels=128, n_layers=16, n_heads=24, d_model=1536, tokens_per_frame=64,
                  n_frames=60, n_buttons=N_BUTTONS, causal=True, rope_impl="motion", local_window=16, global_window=None)


GUIDANCE_RANGE = (0.0, 8.0)


def guidance_problem(guidance) -> str | None:
    """What is wrong with a control guidance scale (PipelineConfig.guidance), or None."""
    lo, hi = GUIDANCE_RANGE
    if is_number(guidance) and lo <= guidance <= hi:
        return None
    return f"must be a number in [{lo:g}, {hi:g}] (1: no guidance; 1.5 follows the mouse further)"


def check_guidance(guidance, name: str = "guidance") -> float:
    """A control guidance scale as a float, or a ValueError naming ``name``."""
    if problem := guidance_problem(guidance):
        raise ValueError(f"{name}={guidance!r} {problem}")
    return float(guidance)


def check_schedule(schedule, name: str = "schedule") -> tuple[float, ...]:
    """A sampler schedule as floats, refused unless it falls strictly from 1 to 0."""
    value = tuple(float(t) for t in schedule)
    if len(value) < 2 or value[0] != 1.0 or value[-1] != 0.0 or any(a <= b for a, b in zip(value, value[1:])):
        raise ValueError(f"{name}={list(value)} must fall strictly from 1.0 to 0.0, e.g. [1.0, 0.25, 0.0]")
    return value


def refuse_other_kind(model_id, source: str) -> None:
    """Refuse a model kind of the original that this engine does not implement, saying what it is."""
    if model_id in OTHER_MODEL_KINDS:
        raise ConfigError(f"{source}: model.model_id={model_id!r} is not supported: {OTHER_MODEL_KINDS[model_id]}")


@dataclass(frozen=True)
class ModelConfig:
    """The ``model:`` section of an original GameRFT config (docs/architecture.md, The model).

    Where the original reads a key with a default (``getattr(config, key, default)``), ours is
    the same: ``rope_impl`` -> ortho, ``local_idx`` -> 4, and the motion RoPE keys. Its config
    loader fills in nothing else, so every other key it reads must be in its YAML; of those,
    ours defaults the ones that cannot change the numbers silently (``causal``, ``uncond``,
    ``n_buttons``, ...) and requires ``n_frames`` where it shapes them (ortho RoPE's time axis).
    """

    sample_size: int
    channels: int
    n_layers: int
    n_heads: int
    d_model: int
    tokens_per_frame: int
    n_frames: int | None = None  # the original's RoPE table length (frames); ortho RoPE positions need it
    model_id: str = "game_rft"
    n_buttons: int = N_BUTTONS
    n_mouse_axes: int = 2
    patch_size: int = 1
    causal: bool = True
    uncond: bool = False
    backbone: str = "dit"
    has_audio: bool = False
    rope_impl: str = "ortho"
    rope_base: float = 10000.0
    rope_ats_delta: float = 2.0
    rope_dim_t: int | None = None
    rope_dim_x: int | None = None
    rope_dim_y: int | None = None
    local_window: int | None = None
    global_window: int | None = None
    local_idx: int = 4
    mouse_embed: str = "sincos"  # not an original key: absent means the original's embedding

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_local(self, layer: int) -> bool:
        return layer % self.local_idx != 0

    def layer_window(self, layer: int) -> int | None:
        """Frames a query may look back (itself included) under the frame mask of prefill and
        training; None means unlimited."""
        return self.local_window if self.is_local(layer) else self.global_window

    def decode_window(self, layer: int) -> int | None:
        """Frames a single decoded frame may look back (itself included) over the cache: the
        original builds no mask while decoding, so a global layer sees every cached frame
        whatever ``global_window`` says, and only local layers are cut to ``local_window``."""
        return self.local_window if self.is_local(layer) else None

    def validate(self, source: str = "config") -> "ModelConfig":
        def bad(key, value, fix):
            raise ConfigError(f"{source}: model.{key}={value!r} is not supported: {fix}")

        refuse_other_kind(self.model_id, source)
        if self.model_id != "game_rft":
            bad("model_id", self.model_id, "only 'game_rft' (the video GameRFT) is implemented")
        if self.backbone in OTHER_BACKBONES:
            bad("backbone", self.backbone, OTHER_BACKBONES[self.backbone])
        if self.backbone != "dit":
            bad("backbone", self.backbone, "only 'dit' is implemented")
        if self.has_audio:
            bad("has_audio", self.has_audio, "audio tokens are not supported (a video-only GameRFT has "
                                             "has_audio: false)")
        if not self.causal:
            bad("causal", self.causal, "the streaming pipeline needs a frame-causal model (causal: true)")
        for key in ("sample_size", "channels", "n_layers", "n_heads", "d_model", "tokens_per_frame", "n_frames"):
            value = getattr(self, key)
            if key == "n_frames" and value is None:  # optional: only ortho RoPE reads it (checked below)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(key, value, "must be a positive integer")
        if self.patch_size != 1:
            bad("patch_size", self.patch_size, "GameRFT tokens are single latent pixels (patch_size: 1)")
        if self.d_model % self.n_heads:
            bad("n_heads", self.n_heads, f"d_model {self.d_model} must be divisible by n_heads")
        if self.tokens_per_frame != self.sample_size**2:
            bad("tokens_per_frame", self.tokens_per_frame,
                f"patch size is 1, so it must equal sample_size**2 = {self.sample_size ** 2}")
        if self.rope_impl not in ROPE_KINDS:
            bad("rope_impl", self.rope_impl, f"choose one of {list(ROPE_KINDS)} (absent means 'ortho', as in "
                                             "the original)")
        if self.rope_impl == "ortho":
            if self.head_dim % 8:
                bad("n_heads", self.n_heads, f"ortho RoPE splits the head dim into four axes of even size, so "
                                             f"head_dim = d_model / n_heads = {self.head_dim} must be a multiple of 8")
            if self.n_frames is None or self.n_frames < 2:
                bad("n_frames", self.n_frames, "ortho RoPE places frame k at time -1 + 2k/(n_frames - 1), so it "
                                               "needs the n_frames the model was trained with (>= 2)")
        if self.mouse_embed not in MOUSE_EMBEDDINGS:
            bad("mouse_embed", self.mouse_embed, f"choose one of {list(MOUSE_EMBEDDINGS)} ('sincos', the "
                                                 "original's, when absent)")
        if self.n_buttons != N_BUTTONS or self.n_mouse_axes != len(MOUSE_AXES):
            bad("n_buttons/n_mouse_axes", (self.n_buttons, self.n_mouse_axes), "the controls are 2 mouse axes and 11 buttons")
        if self.local_idx < 1:
            bad("local_idx", self.local_idx, "must be >= 1")
        for key in ("local_window", "global_window"):
            value = getattr(self, key)
            if value is not None and value < 1:
                bad(key, value, "a window is a positive number of frames, or null for unlimited")
        if self.local_window is None and any(self.is_local(i) for i in range(self.n_layers)):
            bad("local_window", None, "the model has local layers (layer % local_idx != 0), which need a "
                                      "local_window in frames")
        return self

    @classmethod
    def from_mapping(cls, section: Any, source: str = "config") -> "ModelConfig":
        data = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
        refuse_other_kind(data.get("model_id"), source)  # before the key checks: say what the model is
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - data.keys())
        if missing:
            raise ConfigError(f"{source}: model section lacks required keys {missing}")
        # Original configs carry training-only keys (cfg_prob, gradient_checkpointing, ...); they
        # do not affect inference.
        return cls(**{k: v for k, v in data.items() if k in names}).validate(source)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PipelineConfig:
    window_frames: int = 60
    history_alpha: float = 0.25
    # Denoising schedule t_0 = 1 > t_1 > ... > 0; history is noised at history_alpha.
    schedule: tuple[float, ...] = (1.0, 0.25, 0.0)
    # Control guidance at the first step: v_rest + guidance * (v - v_rest), v_rest the prediction
    # with the mouse at rest and the same keys. Above 1 the view follows the mouse further, at one
    # more model call a frame; 1: none.
    guidance: float = 1.0
    clips: str | None = None


@dataclass(frozen=True)
class DecoderConfig:
    cls: str = "AutoencoderTiny"
    path: str | None = None
    trained: bool = True


@dataclass(frozen=True)
class WorldConfig:
    """Everything a config file says, parsed once."""

    model: ModelConfig
    vae_scale: float
    pipeline: PipelineConfig
    decoder: DecoderConfig
    inference: dict = field(default_factory=dict)
    controls: dict = field(default_factory=dict)  # front-end key bindings and mouse sensitivity
    simulator: dict = field(default_factory=dict)  # the maze simulator's settings (owl_wms/maze/worlds.py)
    name: str = "world"
    trained: bool = True
    path: Path | None = None

    def with_guidance(self, guidance: float) -> "WorldConfig":
        """This world sampled with another control guidance (PipelineConfig.guidance)."""
        return dataclasses.replace(self, pipeline=dataclasses.replace(self.pipeline, guidance=check_guidance(guidance)))

    def resolve(self, relative: str | None) -> Path | None:
        if relative is None:
            return None
        p = Path(relative)
        if not p.is_absolute() and self.path is not None:
            p = self.path.parent / p
        return p


def is_number(v) -> bool:
    """A finite int or float (not a bool)."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def is_whole(v) -> bool:
    """An int (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _flag(section: dict, key: str, name: str, path) -> bool:
    value = section.get(key, True)
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: {name}.{key}={value!r} must be true or false")
    return value


def _section(raw, name: str, path) -> dict:
    """A config section as a plain dict (empty when absent), refused unless it is a mapping."""
    section = raw.get(name)
    if section is None:
        return {}
    if not isinstance(section, DictConfig):
        raise ConfigError(f"{path}: the {name}: section must be a mapping of keys to values, got {section!r}")
    return OmegaConf.to_container(section, resolve=True)


def load_world(checkpoint: str | Path) -> WorldConfig:
    """The config of a checkpoint folder (its config.yaml) or a config file."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file() and checkpoint.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"{str(checkpoint)!r} is a file of a checkpoint, not its config: pass the checkpoint's "
                          f"folder ({str(checkpoint.parent)!r}) or its config.yaml")
    if checkpoint.is_dir() and not (checkpoint / "config.yaml").is_file():
        raise ConfigError(f"folder {str(checkpoint)!r} is not a checkpoint: it holds no config.yaml; pass a checkpoint "
                          "folder (config.yaml and model.safetensors, for example checkpoints/maze-world) or a config file")
    if not checkpoint.exists():
        close = difflib.get_close_matches(checkpoint.name, [p.name for p in checkpoint.parent.iterdir()], n=1) \
            if checkpoint.parent.is_dir() else []
        raise ConfigError(f"checkpoint {str(checkpoint)!r} does not exist"
                          + (f" (did you mean {str(checkpoint.parent / close[0])!r}?)" if close else "")
                          + "; pass a checkpoint folder (config.yaml and model.safetensors, for example "
                            "checkpoints/maze-world) or a config file")
    return load_config(checkpoint / "config.yaml" if checkpoint.is_dir() else checkpoint)


MAX_BASE_DEPTH = 8


def read_config(path: str | Path, _chain: tuple[Path, ...] = ()) -> DictConfig:
    """A config file's raw sections, merged over its ``base:`` chain."""
    path = Path(path)
    named_by = f"config file {str(_chain[-1])!r}: base: {str(path)!r}" if _chain else f"config file {str(path)!r}"
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte
        raise ConfigError(f"{named_by} cannot be read ({exc}); name a YAML config file") from None
    if not is_file:
        what = "is a folder, not a config file" if is_dir else "does not exist"
        if _chain:
            raise ConfigError(f"{named_by} {what}; name a config file relative to {str(_chain[-1])!r}'s folder")
        raise ConfigError(f"{named_by} {what}; pass the path of a YAML config "
                          "(for example checkpoints/<world>/config.yaml)")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # omegaconf raises several yaml/parse error types
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(raw, DictConfig):
        if _chain:
            raise ConfigError(f"{named_by} is not a mapping of sections (model:, pipeline:, ...); name a world config")
        raise ConfigError(f"config file {str(path)!r} has no 'model:' section")
    if "base" not in raw:
        return raw
    base = OmegaConf.to_container(raw, resolve=False)["base"]  # as written: an interpolation is not followed
    if not isinstance(base, str) or not base or "${" in base:
        raise ConfigError(f"config file {str(path)!r}: base={base!r} must name a config file, relative to this one "
                          "(a plain path, not an interpolation)")
    base_path = path.parent / base
    chain = (*_chain, path)
    try:
        looped = any(base_path.resolve() == seen.resolve() for seen in chain)
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a name too long, a NUL byte
        raise ConfigError(f"config file {str(path)!r}: base {base!r} cannot be followed ({exc}); "
                          "name a config file relative to this one") from None
    if looped:
        raise ConfigError(f"config file {str(path)!r}: base {base!r} leads back to itself "
                          f"({' -> '.join(str(p) for p in (*chain, base_path))}); break the loop")
    if len(chain) > MAX_BASE_DEPTH:
        raise ConfigError(f"config file {str(path)!r}: more than {MAX_BASE_DEPTH} bases deep; "
                          "write the settings into a nearer base")
    under = read_config(base_path, chain)
    try:
        return OmegaConf.merge(under, OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "base"]))
    except (OmegaConfBaseException, TypeError) as exc:  # e.g. a list over a mapping of the base
        raise ConfigError(f"config file {str(path)!r} cannot be merged over its base {str(base_path)!r}: "
                          f"{str(exc).splitlines()[0]}; give each section the kind (a mapping, a list) "
                          "it has in the base") from None


def load_config(path: str | Path) -> WorldConfig:
    path = Path(path)
    return parse_config(read_config(path), path)


def parse_config(raw: DictConfig, path: Path) -> WorldConfig:
    """A config's sections as ``read_config`` gives them (``path``: the file, for messages and paths), checked."""
    if "model" not in raw:
        raise ConfigError(f"config file {str(path)!r} has no 'model:' section")
    try:
        return _parse_world(raw, path)
    except OmegaConfBaseException as exc:  # a bad interpolation, a key of the wrong kind
        raise ConfigError(f"config file {str(path)!r}: {str(exc).splitlines()[0]}") from None


def _parse_world(raw: DictConfig, path: Path) -> WorldConfig:
    if not isinstance(raw.model, DictConfig):
        raise ConfigError(f"{path}: the model: section must be a mapping of keys to values, got {raw.model!r}")
    model = ModelConfig.from_mapping(raw.model, source=str(path))
    given = _section(raw, "train", path).get("vae_scale", 1.0)
    try:  # a number, or a number written as text
        vae_scale = float(given) if not isinstance(given, bool) else given
    except (TypeError, ValueError):
        vae_scale = given
    if not is_number(vae_scale) or not vae_scale > 0:
        raise ConfigError(f"{path}: train.vae_scale={given!r} must be a positive number (latents are divided "
                          "by it; the encoder's measured scale, 1.0 if unknown)")
    pipe = _section(raw, "pipeline", path)
    unknown = set(pipe) - {f.name for f in dataclasses.fields(PipelineConfig)}
    if unknown:
        raise ConfigError(f"{path}: unknown pipeline keys {sorted(unknown)}; "
                          f"known: {[f.name for f in dataclasses.fields(PipelineConfig)]}")
    window = pipe.get("window_frames", PipelineConfig.window_frames)
    if not is_whole(window) or not 2 <= window <= 10_000:
        raise ConfigError(f"{path}: pipeline.window_frames={window!r} must be a whole number in [2, 10000]")
    alpha = pipe.get("history_alpha", PipelineConfig.history_alpha)
    if not is_number(alpha) or not 0 <= alpha < 1:
        raise ConfigError(f"{path}: pipeline.history_alpha={alpha!r} must be a number in [0, 1)")
    if "schedule" in pipe:
        sched = pipe["schedule"]
        if not isinstance(sched, list) or not all(is_number(x) for x in sched):
            raise ConfigError(f"{path}: pipeline.schedule={sched!r} must be a list of numbers, e.g. [1.0, 0.25, 0.0]")
        pipe["schedule"] = tuple(float(x) for x in sched)
    if not isinstance(pipe.get("clips", ""), (str, type(None))):
        raise ConfigError(f"{path}: pipeline.clips={pipe['clips']!r} must be a folder name")
    pipeline = PipelineConfig(**pipe)
    try:
        check_schedule(pipeline.schedule, "pipeline.schedule")
        pipeline = dataclasses.replace(pipeline, guidance=check_guidance(pipeline.guidance, "pipeline.guidance"))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    dec = _section(raw, "decoder", path)
    if not isinstance(dec.get("class", ""), str) or not isinstance(dec.get("path", ""), (str, type(None))):
        raise ConfigError(f"{path}: decoder.class and decoder.path must be names, got {dec!r}")
    decoder = DecoderConfig(cls=dec.get("class", "AutoencoderTiny"), path=dec.get("path"),
                            trained=_flag(dec, "trained", "decoder", path))
    inference, meta, controls = (_section(raw, name, path) for name in ("inference", "world", "controls"))
    simulator = parse_simulator(raw.get("simulator"), str(path))
    return WorldConfig(model=model, vae_scale=vae_scale, pipeline=pipeline, decoder=decoder,
                       inference=inference, controls=controls, simulator=simulator,
                       name=str(meta.get("name", path.parent.name)), trained=_flag(meta, "trained", "world", path), path=path)


def parse_simulator(section: Any, source: str) -> dict:
    """The ``simulator:`` section as a mapping of plain values; the maze checks its keys where it
    builds a level (owl_wms/maze/worlds.py)."""
    sim = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else section or {}
    if not isinstance(sim, dict) or any(isinstance(v, (dict, list)) for v in sim.values()):
        raise ConfigError(f"{source}: the simulator section must map names to plain values, got {sim!r}")
    return dict(sim)
