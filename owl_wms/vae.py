"""Frame decoder: a diffusers autoencoder loaded from a local folder (no hub access)."""
from __future__ import annotations

from pathlib import Path

import diffusers
import torch
from torch import nn

from .config import ConfigError, WorldConfig
from .controls import to_unit


class FrameDecoder(nn.Module):
    """``decode(latents [b,c,h,w]) -> RGB [b,3,H,W] in [-1, 1]`` around any diffusers autoencoder."""

    def __init__(self, autoencoder: nn.Module, latent_channels: int):
        super().__init__()
        self.autoencoder = autoencoder
        self.latent_channels = latent_channels
        self._decode = self._decode_sample

    def _decode_sample(self, latents: torch.Tensor) -> torch.Tensor:
        return self.autoencoder.decode(latents).sample.float().clamp(-1, 1)

    def compile(self, **kwargs):
        """Decode through torch.compile (one frame's shape: a single graph after the first call)."""
        self._decode = torch.compile(self._decode_sample, dynamic=False, **kwargs)
        return self

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"decoder input has shape {tuple(latents.shape)}; expected "
                             f"[batch, {self.latent_channels}, h, w]")
        p = next(self.autoencoder.parameters())
        return self._decode(latents.to(p.device, p.dtype))

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """RGB [b,3,H,W] in [-1,1] -> latents (the mean for KL autoencoders)."""
        p = next(self.autoencoder.parameters())
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


def autoencoder_class(name: str):
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ConfigError(f"decoder.class={name!r} is not a diffusers autoencoder; use for example "
                          "AutoencoderTiny, AutoencoderKL or AutoencoderDC")
    return cls


def load_autoencoder(folder: str | Path, cls_name: str = "AutoencoderTiny", what: str = "--vae",
                     fix: str = "give the final/ folder that scripts.train_vae wrote"):
    """A diffusers autoencoder from its save_pretrained folder, never from the hub; a missing or
    foreign folder is an error that names ``what`` pointed at it and the ``fix``."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        why = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(f"{what} {str(folder)!r} {why}, so it is not a save_pretrained autoencoder folder; {fix}")
    cls = autoencoder_class(cls_name)
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()  # AutoencoderTiny warns about its own saved keys
    try:
        return cls.from_pretrained(str(folder), local_files_only=True)
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)


def load_decoder(world: WorldConfig) -> FrameDecoder:
    folder = world.resolve(world.decoder.path)
    if folder is None:
        raise ConfigError(f"{world.path}: no decoder.path; add a 'decoder: {{class: ..., path: vae}}' section")
    ae = load_autoencoder(folder, world.decoder.cls, what=f"{world.path}: decoder.path",
                          fix="save the autoencoder there with save_pretrained")
    return FrameDecoder(ae.eval(), world.model.channels)
