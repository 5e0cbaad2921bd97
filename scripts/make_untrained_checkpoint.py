"""Create the deterministic untrained default checkpoint (model, decoder, clips).

    python -m scripts.make_untrained_checkpoint [--config configs/untrained_tiny.yaml] [--out checkpoints/untrained-tiny]

Same seed, same bytes: weights come from torch's default initialisers under a fixed seed.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from diffusers import AutoencoderTiny
from omegaconf import OmegaConf
from safetensors.torch import save_file

from inference.actions import load_actions
from owl_wms.clips import Clip
from owl_wms.config import load_config, read_config
from owl_wms.model import GameRFT

REPO = Path(__file__).resolve().parent.parent


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "untrained_tiny.yaml"))
    p.add_argument("--out", default=str(REPO / "checkpoints" / "untrained-tiny"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=3)
    p.add_argument("--future", type=int, default=1000, help="recorded future actions per clip")
    args = p.parse_args(argv)

    world = load_config(args.config)
    cfg = world.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "base" in OmegaConf.load(args.config):  # merged, so the checkpoint stands alone
        (out / "config.yaml").write_text(f"# {args.config} merged over its base\n"
                                         + OmegaConf.to_yaml(read_config(args.config), resolve=True))
    else:
        shutil.copyfile(args.config, out / "config.yaml")

    torch.manual_seed(args.seed)
    model = GameRFT(cfg)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.core.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"trained": "false", "seed": str(args.seed)})

    torch.manual_seed(args.seed + 1)
    blocks = (32, 32, 32, 32)  # 3 upsamplings: 8x8 latents -> 64x64 frames
    vae = AutoencoderTiny(latent_channels=cfg.channels, encoder_block_out_channels=blocks,
                          decoder_block_out_channels=blocks, num_encoder_blocks=(1, 1, 1, 1),
                          num_decoder_blocks=(1, 1, 1, 1))
    vae.save_pretrained(str(out / world.decoder.path))

    clip_dir = out / world.pipeline.clips
    clip_dir.mkdir(exist_ok=True)
    window = world.pipeline.window_frames
    for i in range(args.clips):
        g = torch.Generator().manual_seed(args.seed + 100 + i)
        actions = load_actions(f"random:{args.seed + i}", window + args.future)
        Clip(latents=torch.randn((window, cfg.channels, cfg.sample_size, cfg.sample_size), generator=g),
             mouse=torch.tensor([m for m, _ in actions]), buttons=torch.tensor([b for _, b in actions]).float(),
             history_frames=window).save(clip_dir / f"clip_{i:02d}.safetensors")
    n = sum(v.numel() for v in state.values())
    print(f"wrote {out}: {n / 1e6:.2f}M params, decoder, {args.clips} clips of {window}+{args.future} frames")


if __name__ == "__main__":
    main()
