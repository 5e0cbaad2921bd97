"""Frame decoder: a diffusers autoencoder loaded from a local folder (no hub access)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import diffusers
import torch
from torch import nn

from .config import ConfigError, WorldConfig
from .controls import to_uint8, to_unit


def decode_sample(autoencoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """RGB [b,3,H,W] in [-1, 1] of latents on the autoencoder's device and dtype."""
    return autoencoder.decode(latents).sample.float().clamp(-1, 1)


class FrameDecoder(nn.Module):
    """``decode(latents [b,c,h,w]) -> RGB [b,3,H,W] in [-1, 1]`` around any diffusers autoencoder.

    One caller at a time: a decode on the decoding thread and a recompute's re-encode on the
    generating one take turns (a compiled module is not re-entrant)."""

    def __init__(self, autoencoder: nn.Module, latent_channels: int):
        super().__init__()
        self.autoencoder = autoencoder
        self.latent_channels = latent_channels
        self._decode = self._decode_sample
        self._frame_shape: tuple[int, int] | None = None
        self._turn = threading.RLock()

    def __getstate__(self):  # copies and pickles get a lock of their own
        return {k: v for k, v in self.__dict__.items() if k != "_turn"}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._turn = threading.RLock()

    def _decode_sample(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_sample(self.autoencoder, latents)

    def compile(self, **kwargs):
        """Decode through torch.compile (one frame's shape: a single graph after the first call)."""
        self._decode = torch.compile(self._decode_sample, dynamic=False, **kwargs)
        return self

    def use_decode(self, decode) -> None:
        """Decode latents (on the autoencoder's device and dtype) with ``decode`` from now on."""
        self._decode = decode

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"decoder input has shape {tuple(latents.shape)}; expected "
                             f"[batch, {self.latent_channels}, h, w]")
        p = next(self.autoencoder.parameters())
        with self._turn:
            return self._decode(latents.to(p.device, p.dtype))

    @torch.no_grad()
    def frame_shape(self, size: int) -> tuple[int, int]:
        """(H, W) of the frames decoded from [.., c, size, size] latents (decoded once)."""
        if self._frame_shape is None:
            self._frame_shape = tuple(self.decode(torch.zeros(1, self.latent_channels, size, size)).shape[-2:])
        return self._frame_shape

    @torch.no_grad()
    def reencode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [n, c, h, w] decoded one by one to uint8 frames (what a player sees) and encoded again."""
        with self._turn:
            return self.encode_uint8(torch.stack([to_uint8(self.decode(x[None])[0]) for x in latents]))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """RGB [b,3,H,W] in [-1,1] -> latents (the mean for KL autoencoders)."""
        p = next(self.autoencoder.parameters())
        with self._turn:
            enc = self.autoencoder.encode(images.to(p.device, p.dtype))
        out = enc.latent_dist.mean if hasattr(enc, "latent_dist") else enc.latents
        return out.float()

    @torch.no_grad()
    def encode_uint8(self, frames, chunk: int = 256) -> torch.Tensor:
        """uint8 RGB frames [n, H, W, 3] (numpy or tensor) -> latents [n, c, h, w] on the CPU."""
        frames = torch.as_tensor(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
            raise ValueError(f"frames have shape {tuple(frames.shape)} and dtype {frames.dtype}; "
                             "expected uint8 [n, H, W, 3]")
        images = to_unit(frames.permute(0, 3, 1, 2))
        return torch.cat([self.encode(c).cpu() for c in images.split(chunk)])

    forward = decode


def autoencoder_class(name: str, where: str = ""):
    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)
            and callable(getattr(cls, "encode", None)) and callable(getattr(cls, "decode", None))):
        raise ConfigError(f"{where}decoder.class={name!r} is not a diffusers autoencoder (a model with encode and decode); "
                          "use for example AutoencoderTiny, AutoencoderKL or AutoencoderDC")
    return cls


WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"  # what save_pretrained writes
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # never loaded: unpickling runs code


def check_autoencoder_folder(folder: Path, what: str, fix: str) -> None:
    """Refuse a folder whose config is not a JSON object or whose weights are not a readable
    safetensors file, naming the file and the fix, before diffusers reads anything."""
    config = folder / "config.json"
    if not config.is_file():
        why = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(f"{what} {str(folder)!r} {why}, so it is not a save_pretrained autoencoder folder; {fix}")
    try:
        parsed = json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{what}: {str(config)!r} is not valid JSON ({str(e).splitlines()[0][:120]}); "
                          f"restore the file that save_pretrained wrote, or {fix}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{what}: {str(config)!r} holds a JSON {type(parsed).__name__}, not an object of "
                          f"autoencoder settings; restore the file that save_pretrained wrote, or {fix}")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
        held = f"holds only pickled weights ({', '.join(pickled)}), which are never loaded (unpickling runs code)" \
            if pickled else f"has no {WEIGHTS_FILE}"
        raise ConfigError(f"{what} {str(folder)!r} {held}; save the autoencoder with "
                          f"save_pretrained(..., safe_serialization=True) so it writes {WEIGHTS_FILE}")
    try:
        need, have = safetensors_extent(weights)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{what}: {str(weights)!r} is not a readable safetensors file ({str(e)[:120]}); "
                          f"copy it again, or {fix}") from None
    if have < need:
        raise ConfigError(f"{what}: {str(weights)!r} is truncated: its header describes {need} bytes of tensors "
                          f"but {have} follow; copy it again, or {fix}")


def safetensors_extent(path: Path) -> tuple[int, int]:
    """(bytes of tensor data the header describes, bytes that follow the header) of a
    safetensors file; ValueError when the header is not a safetensors header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise ValueError("no safetensors header")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if not all(isinstance(e, int) for e in ends):
        raise ValueError("the header's data offsets are not integers")
    return max(ends, default=0), size - 8 - n


def load_autoencoder(folder: str | Path, cls_name: str = "AutoencoderTiny", what: str = "--vae",
                     fix: str = "give the final/ folder that scripts.train_vae wrote", where: str = ""):
    """A diffusers autoencoder from its save_pretrained folder, never from the hub and never from
    pickled weights; a missing, foreign, malformed or truncated folder is an error that names
    ``what`` pointed at it, the file and the ``fix``."""
    folder = Path(folder)
    cls = autoencoder_class(cls_name, where)
    check_autoencoder_folder(folder, what, fix)
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()  # AutoencoderTiny warns about its own saved keys
    try:
        return cls.from_pretrained(str(folder), local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise ConfigError(f"{what} {str(folder)!r} could not be loaded as {cls_name} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                          f"check decoder.class against the folder's config.json, or {fix}") from None
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)


def load_decoder(world: WorldConfig) -> FrameDecoder:
    folder = world.resolve(world.decoder.path)
    if folder is None:
        raise ConfigError(f"{world.path}: no decoder.path; add a 'decoder: {{class: ..., path: vae}}' section")
    ae = load_autoencoder(folder, world.decoder.cls, what=f"{world.path}: decoder.path",
                          fix="save the autoencoder there with save_pretrained", where=f"{world.path}: ")
    return FrameDecoder(ae.eval(), world.model.channels)
