"""Stage 3: encode every episode with the trained autoencoder; measure vae_scale.

    python -m scripts.encode_latents --data work/data --vae work/vae/final --out work/latents

Writes ``<out>/ep_*.safetensors`` (raw latents [n, c, 8, 8] + the episode's actions and other
per-frame records) and
``<out>/stats.json`` with ``vae_scale`` = the latents' standard deviation, so latents divided
by it have unit variance, and the episodes' options (policy, corridor) from their manifest,
which export_checkpoint writes into the checkpoint's config. Resumable: encoded episodes are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from owl_wms.maze.data import episode_options
from owl_wms.maze.training import file_stage_clock
from owl_wms.config import ConfigError
from owl_wms.vae import FrameDecoder, load_autoencoder


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="work/data")
    p.add_argument("--vae", default="work/vae/final")
    p.add_argument("--vae-class", default="AutoencoderTiny")
    p.add_argument("--out", default="work/latents")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    episodes = sorted(Path(args.data).glob("ep_*.safetensors"))
    if not episodes:
        raise SystemExit(f"error: no episodes in {args.data}; run scripts.generate_data first")
    try:
        ae = load_autoencoder(args.vae, args.vae_class).to(args.device).eval()
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    coder = FrameDecoder(ae, ae.config.latent_channels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = json.loads((out / "stats.json").read_text()) if (out / "stats.json").is_file() else {}
    todo = [ep for ep in episodes if not (out / ep.name).exists()]
    stage_time = file_stage_clock(before, len(episodes), len(todo))
    for ep in tqdm(todo, desc="encode", unit="ep", initial=len(episodes) - len(todo), total=len(episodes)):
        final = out / ep.name
        with safe_open(str(ep), "pt") as f:
            meta = f.metadata()
        t = load_file(str(ep))
        lat = coder.encode_uint8(t["frames"])
        tmp = final.with_suffix(".tmp")
        # the episode's other per-frame records (actions, wall_ahead) travel with its latents
        save_file({"latents": lat.contiguous(), **{k: v for k, v in t.items() if k != "frames"}}, str(tmp), metadata=meta)
        os.replace(tmp, final)
    sample = torch.cat([load_file(str(p))["latents"] for p in sorted(out.glob("ep_*.safetensors"))[:64]])
    manifest = Path(args.data) / "manifest.json"
    made = episode_options(json.loads(manifest.read_text()) if manifest.is_file() else {})
    stats = {"vae_scale": float(sample.std()), "mean": float(sample.mean()), "channels": int(sample.shape[1]),
             "data": str(args.data), **made, **stage_time()}
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(f"encoded {len(episodes)} episodes; vae_scale={stats['vae_scale']:.4f}")


if __name__ == "__main__":
    main()
