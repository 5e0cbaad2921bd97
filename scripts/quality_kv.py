"""Quality of every KV cache mode on the shipped world: same level, actions and noise.

    python -m scripts.quality_kv [--frames 300] [--seed-offset 0] [--out eval/kv_quality]

Starts from a held-out simulator level (its real history, encoded), follows the level's
recorded actions for ``--frames`` frames under each mode, and compares every decoded frame
with the bf16 roll rollout and with the simulator. Writes quality.json, quality.md and a PNG.
Per-frame PSNR of identical frames is infinite; means cap it at 100 dB.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from inference.causvid_pipeline import DEFAULT_CHECKPOINT, CausvidPipeline
from inference.flags import resolve_settings, with_threads
from owl_wms.config import load_world
from owl_wms.maze.data import HELD_OUT_SEED
from owl_wms.maze.evaluation import Episode, frame_metrics
from owl_wms.settings import without_kv

from .common import machine

VARIANTS = {
    "bf16": {},
    "bf16 inplace": {"OWL_RING_MODE": "inplace"},
    "int8 K+V": {"OWL_KV_STORAGE": "int8"},
    "int8 K+V inplace": {"OWL_KV_STORAGE": "int8", "OWL_RING_MODE": "inplace"},
    "int8 K/channel V/token": {"OWL_KV_STORAGE": "int8", "OWL_KV_SCALE": "channel"},
    "int8 per-head (running max)": {"OWL_KV_STORAGE": "int8", "OWL_KV_SCALE": "head"},
    "fp8 V-only": {"OWL_FP8_KV": "1", "OWL_K_FP8": "0"},
    "fp8 K+V": {"OWL_FP8_KV": "1"},
    "fp8_e5m2 K+V": {"OWL_KV_STORAGE": "fp8_e5m2"},
    "fp8 K+V late half": {"OWL_FP8_KV": "1", "OWL_KV_LATE_LAYERS": "half"},
    "int8 K+V late half": {"OWL_KV_STORAGE": "int8", "OWL_KV_LATE_LAYERS": "half"},
    "int4 V-only": {"OWL_KV_STORAGE": "int4", "OWL_K_FP8": "0"},
    "int4 K+V": {"OWL_KV_STORAGE": "int4"},
    "sharing 2": {"OWL_KV_SHARE": "2"},
    "int8 + sharing 2": {"OWL_KV_STORAGE": "int8", "OWL_KV_SHARE": "2"},
}
BARS = ("int8 K+V", "fp8 V-only")  # >= 35 dB vs bf16 (frames 1-32), vs-simulator within 0.5 dB (1-64)


def capped_mean(values) -> float:
    return float(np.mean(np.minimum(np.asarray(values, dtype=np.float64), 100.0)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="default: the shipped world")
    p.add_argument("--frames", type=int, default=300)
    p.add_argument("--seed-offset", type=int, default=100, help="level seed = held-out base + offset")
    p.add_argument("--variants", nargs="*", default=None, help=f"subset of: {', '.join(VARIANTS)}")
    p.add_argument("--out", default="eval/kv_quality")
    args = p.parse_args(argv)
    names = args.variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if names[0] != "bf16":
        names = ["bf16", *[n for n in names if n != "bf16"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    world = load_world(args.checkpoint or DEFAULT_CHECKPOINT)
    base = CausvidPipeline.from_checkpoint(world, clip=None, verbose=False,
                                           settings=with_threads(resolve_settings(world.inference)))
    seed = HELD_OUT_SEED + args.seed_offset
    ep = Episode(base, seed, args.frames)
    real = ep.frames[ep.start:]
    rows, frames = [], {}
    for name in names:
        env = VARIANTS[name]
        pipe = CausvidPipeline(base.model, base.decoder, base.world, resolve_settings(without_kv(base.world.inference), env),
                               verbose=False)
        pipe.load_clip(ep.clip)
        got = []
        for k in tqdm(range(args.frames), desc=name, unit="frame", leave=False):
            _, m, b = ep.future(k)
            got.append(pipe(m, b)[0].numpy())
        frames[name] = got
        vs_sim = [frame_metrics(g, r)[0] for g, r in zip(got, real)]
        vs_base = [frame_metrics(g, r)[0] for g, r in zip(got, frames["bf16"])]
        below = next((i + 1 for i, v in enumerate(vs_base) if v < 30), None)
        rows.append({"variant": name, "flags": " ".join(f"{k}={v}" for k, v in env.items()) or "(defaults)",
                     "psnr_vs_bf16_1_32": capped_mean(vs_base[:32]), "psnr_vs_bf16_all": capped_mean(vs_base),
                     "first_frame_below_30db": below, "psnr_vs_sim_1_64": capped_mean(vs_sim[:64]),
                     "psnr_vs_sim_all": capped_mean(vs_sim), "kv_mib": pipe.kv_bytes / 2**20,
                     "per_frame_vs_bf16": vs_base, "per_frame_vs_sim": vs_sim})
        print(f"{name:<28} vs bf16 1-32 {rows[-1]['psnr_vs_bf16_1_32']:6.2f} dB  vs sim 1-64 "
              f"{rows[-1]['psnr_vs_sim_1_64']:6.2f} dB  KV {rows[-1]['kv_mib']:.2f} MiB", flush=True)

    ref = rows[0]["psnr_vs_sim_1_64"]
    lines = [f"# KV cache modes on {base.world.name}: quality ({args.frames} frames, level seed {seed})", "",
             "Command: `" + " ".join(["python -m scripts.quality_kv", *sys.argv[1:]]) + "`",
             f"Machine: {machine()}; torch {torch.__version__}. PSNR means cap identical frames at 100 dB.", "",
             "| variant | flags | PSNR vs bf16, 1-32 | vs bf16, all | first < 30 dB | PSNR vs sim, 1-64 | Δ vs bf16's | "
             "vs sim, all | KV MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = ""
        if r["variant"] in BARS:
            ok = r["psnr_vs_bf16_1_32"] >= 35 and abs(r["psnr_vs_sim_1_64"] - ref) <= 0.5
            mark = " ✅" if ok else " ❌"
        lines.append(f"| {r['variant']}{mark} | `{r['flags']}` | {r['psnr_vs_bf16_1_32']:.2f} | "
                     f"{r['psnr_vs_bf16_all']:.2f} | {r['first_frame_below_30db'] or '-'} | "
                     f"{r['psnr_vs_sim_1_64']:.2f} | {r['psnr_vs_sim_1_64'] - ref:+.2f} | {r['psnr_vs_sim_all']:.2f} | "
                     f"{r['kv_mib']:.2f} |")
    lines += ["", f"Bars (✅/❌): {', '.join(BARS)} must reach ≥ 35 dB vs bf16 over frames 1-32 and stay within "
              "0.5 dB of bf16's PSNR vs the simulator over frames 1-64."]
    (out / "quality.md").write_text("\n".join(lines) + "\n")
    (out / "quality.json").write_text(json.dumps({"seed": seed, "frames": args.frames, "machine": machine(),
                                                  "rows": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        x = range(1, len(r["per_frame_vs_sim"]) + 1)
        if r["variant"] != "bf16":
            axes[0].plot(x, np.minimum(r["per_frame_vs_bf16"], 100), label=r["variant"], lw=1)
        axes[1].plot(x, r["per_frame_vs_sim"], label=r["variant"], lw=1)
    axes[0].set(xlabel="frame", ylabel="PSNR vs bf16 rollout (dB)", title="drift from the bf16 cache")
    axes[1].set(xlabel="frame", ylabel="PSNR vs simulator (dB)", title="fidelity to the simulator")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=110)
    print(f"wrote {out / 'quality.md'}, quality.json, quality.png")


if __name__ == "__main__":
    main()
