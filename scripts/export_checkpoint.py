"""Stage 5: assemble a shippable checkpoint folder from the training outputs.

    python -m scripts.export_checkpoint --config configs/maze_world.yaml --vae work/vae/final \\
        --latents work/latents --world work/world --out checkpoints/maze-world [--eval eval/eval.json]

Writes config.yaml (with the measured vae_scale), model.safetensors (EMA weights, bf16),
vae/ (save_pretrained), clips/ (history windows from fresh simulator levels, encoded, with
--future recorded policy actions each) and MODEL.md with the figures the stages measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from owl_wms.config import load_config
from owl_wms.data import level_clip

CLIP_SEED = 2_000_000  # clip levels: neither training (0..) nor evaluation (1,000,000..) seeds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/maze_world.yaml")
    p.add_argument("--vae", default="work/vae/final")
    p.add_argument("--latents", default="work/latents")
    p.add_argument("--world", default="work/world")
    p.add_argument("--out", default="checkpoints/maze-world")
    p.add_argument("--clips", type=int, default=4)
    p.add_argument("--future", type=int, default=1000)
    p.add_argument("--eval", default=None, help="eval.json from scripts.eval_world, quoted in MODEL.md")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = json.loads((Path(args.latents) / "stats.json").read_text())
    raw = OmegaConf.load(args.config)
    raw.train.vae_scale = stats["vae_scale"]
    OmegaConf.save(raw, out / "config.yaml")
    world = load_config(out / "config.yaml")

    state = torch.load(Path(args.world) / "ema_core.pt", weights_only=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"trained": "true"})
    vae_dir = world.resolve(world.decoder.path)
    shutil.rmtree(vae_dir, ignore_errors=True)
    shutil.copytree(args.vae, vae_dir, ignore=shutil.ignore_patterns("metrics.json"))

    from owl_wms.vae import load_decoder

    coder = load_decoder(world)
    clip_dir = world.resolve(world.pipeline.clips)
    shutil.rmtree(clip_dir, ignore_errors=True)
    clip_dir.mkdir(parents=True)
    c, s = world.model.channels, world.model.sample_size
    size = coder.decode(torch.zeros(1, c, s, s)).shape[-1]  # frame size the decoder produces
    for i in range(args.clips):
        clip, _ = level_clip(coder, CLIP_SEED + i, world.pipeline.window_frames, args.future, size)
        clip.save(clip_dir / f"clip_{i:02d}.safetensors")

    train = json.loads((Path(args.world) / "train_metrics.json").read_text())
    vae_metrics = json.loads((Path(args.vae) / "metrics.json").read_text())
    ev = json.loads(Path(args.eval).read_text()) if args.eval else None
    n_params = sum(v.numel() for v in state.values())
    lines = [
        f"# {world.name}", "",
        f"A GameRFT world model ({n_params / 1e6:.1f}M parameters, {world.model.n_layers} layers, d_model "
        f"{world.model.d_model}) trained on our maze simulator. Produced by the stages in scripts/.", "",
        "| figure | value |", "|---|---|",
        f"| VAE held-out reconstruction PSNR | {vae_metrics['held_out_psnr_db']:.2f} dB |",
        f"| VAE training frames / steps | {vae_metrics['train_frames']} / {vae_metrics['steps']} |",
        f"| vae_scale (latent std) | {stats['vae_scale']:.4f} |",
        f"| world model steps x batch x frames | {train['steps']} x {train['batch']} x {train['frames']} |",
        f"| world model final loss | {train['final_loss']:.4f} |",
        f"| world model wall time (last run) | {train['seconds_this_run'] / 60:.1f} min |",
        f"| machine | {platform.processor() or platform.machine()}, torch {torch.__version__} |",
    ]
    if ev:
        lines += [f"| teacher-forced PSNR / SSIM | {ev['teacher_forced_psnr']:.2f} dB / {ev['teacher_forced_ssim']:.3f} |",
                  f"| autoregressive PSNR at frame 16 | {ev['ar_psnr_at_16']} |",
                  f"| action sensitivity gap | {ev['action_gap_db']:.2f} dB |",
                  "", f"Evaluation command: `{ev['command']}`"]
    (out / "MODEL.md").write_text("\n".join(lines) + "\n")
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    print(f"exported {out} ({size_mb:.1f} MB)")


if __name__ == "__main__":
    main()
