"""Training a diffusers autoencoder on simulator frames (64x64 RGB -> 8x8 latents)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderTiny
from safetensors import safe_open

from ..evaluation import high_frequency_energy


def load_world_latents(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A world's predicted latents [N, c, h, w] (as the decoder receives them) and the simulator's
    uint8 frames [N, 3, H, W] they should show (scripts.world_latents), and how many levels."""
    paths = sorted(Path(folder).glob("ep_*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no levels (ep_*.safetensors) in {str(folder)!r}; run scripts.world_latents first")
    latents, frames = [], []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            latents.append(f.get_tensor("latents"))
            frames.append(f.get_tensor("frames"))
    return torch.cat(latents), torch.cat(frames).permute(0, 3, 1, 2).contiguous(), len(paths)


def load_frames(folder: str | Path, limit: int | None = None) -> torch.Tensor:
    """All episode frames in a folder as uint8 [N, 3, H, W]."""
    paths = sorted(Path(folder).glob("ep_*.safetensors"))[:limit]
    if not paths:
        raise FileNotFoundError(f"no episodes (ep_*.safetensors) in {str(folder)!r}; run scripts.generate_data first")
    chunks = []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            chunks.append(f.get_tensor("frames"))
    return torch.cat(chunks).permute(0, 3, 1, 2).contiguous()


def build_autoencoder(latent_channels: int, width: int = 64) -> AutoencoderTiny:
    blocks = (width,) * 4  # three 2x stages: 64x64 frames <-> 8x8 latents
    return AutoencoderTiny(latent_channels=latent_channels, encoder_block_out_channels=blocks,
                           decoder_block_out_channels=blocks, num_encoder_blocks=(1, 2, 2, 2),
                           num_decoder_blocks=(2, 2, 2, 1))


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2)."""
    mse = F.mse_loss(a.float().clamp(-1, 1), b.float().clamp(-1, 1)).item()
    return 10 * math.log10(4 / max(mse, 1e-12))


def vae_loss(ae: AutoencoderTiny, x: torch.Tensor, latent_noise: float = 0.1):
    """Reconstruction MSE; latents are jittered so the decoder tolerates imperfect predictions."""
    z = ae.encode(x).latents
    z_in = z + latent_noise * z.detach().std() * torch.randn_like(z)
    rec = ae.decode(z_in).sample
    return F.mse_loss(rec, x) + 1e-4 * z.pow(2).mean(), rec


def detail_gap(rec: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """How far each decoded frame's high-frequency energy is from its real frame's, as the squared
    log of their ratio (the sharpness ratio ``eval_world`` scores; 0 when as sharp), averaged.
    MSE alone pays a decoder to draw the mean of what a latent may show, a blur; this pays it to
    draw as much detail as the frame has, wherever MSE puts it."""
    return (high_frequency_energy(rec).clamp_min(1e-6).log() - high_frequency_energy(x).clamp_min(1e-6).log()).pow(2).mean()


def world_latent_loss(ae: AutoencoderTiny, z: torch.Tensor, x: torch.Tensor, detail: float = 0.0) -> torch.Tensor:
    """MSE of the decoded world predictions ``z`` against the simulator frames ``x`` they should
    show, plus ``detail`` x ``detail_gap`` (0: MSE alone)."""
    rec = ae.decode(z).sample
    loss = F.mse_loss(rec, x)
    return loss + detail * detail_gap(rec, x) if detail else loss
