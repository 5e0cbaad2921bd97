"""A/B runs: the same rollout under several KV-cache modes, compared in one report.

    python -m scripts.ab_kv --variant fp8_kv --variant fp8_v_only --variant int8_kv \\
        --variant sharing --variant ring_inplace --variant "mine:OWL_KV_BITS=4,OWL_K_FP8=0" \\
        --world-seed 1000200 --frames 64 --out eval/ab

Variants are presets from configs/kv_presets.yaml or inline ``name:FLAG=V,FLAG=V`` sets. The
bf16 roll baseline always runs first. Every variant runs in its own process (flags, compile
caches and memory cannot leak) on identical inputs: checkpoint, history (a clip or a fresh
simulator level), actions and noise seed. Starting from a simulator level also compares
with the simulator's frames under the same actions.

Writes <out>/report.md, metrics.csv, psnr_ssim.png, latency.png, memory.png and one
side-by-side mp4 per variant (baseline | variant | 4x difference). Exits 1 when a variant
crashed; the report still covers the others and says which failed and why.
"""
from __future__ import annotations

import argparse
import csv
import difflib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from inference.cores import FREE_BELOW, cpu_reading, others_cores
from inference.flags import KNOWN, flag_message, resolve_settings, with_threads
from scripts.common import PRESETS, REPO, load_presets, machine

# the shipped world's own cache first (its config's int8 in-place ring), then six other modes
DEFAULT_VARIANTS = ["int8_inplace", "fp8_kv", "fp8_v_only", "int8_kv", "int4_v_only", "sharing", "ring_inplace"]
WARMUP = 2  # frames before timing and recompile counting
BUSY_CORES = FREE_BELOW  # other processes' CPU, in cores, past which a variant's speed is not comparable


# -- variants ----------------------------------------------------------------------------------
def parse_variant(spec: str, presets: dict) -> tuple[str, dict]:
    if ":" in spec:
        name, _, flags = spec.partition(":")
        env = {}
        for item in filter(None, flags.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip().startswith("OWL_"):
                raise SystemExit(f"error: --variant {spec!r}: {item!r} is not FLAG=VALUE with an OWL_* flag; "
                                 "write name:OWL_FP8_KV=1,OWL_K_FP8=0")
            key = key.strip()
            if key not in KNOWN:  # a variant that silently ran the baseline would win every quality table
                near = difflib.get_close_matches(key, list(KNOWN), n=1)
                raise SystemExit(f"error: --variant {spec!r}: {key} is not a known OWL_* flag"
                                 + (f" (did you mean {near[0]}?)" if near else "") + f"; known flags: {', '.join(KNOWN)}")
            env[key] = value.strip()
        return name.strip() or "variant", env
    if spec not in presets:
        raise SystemExit(f"error: --variant {spec!r} is neither a preset ({', '.join(presets)}) nor name:FLAG=V,...")
    return spec, dict(presets[spec])


# -- health (no reference) ---------------------------------------------------------------------
def health(frame: np.ndarray) -> dict:
    """Mean brightness (0..1), sharpness (variance of the Laplacian of grey), colour histogram."""
    f = frame.astype(np.float32) / 255
    grey = f.mean(-1)
    lap = grey[1:-1, 1:-1] * 4 - grey[:-2, 1:-1] - grey[2:, 1:-1] - grey[1:-1, :-2] - grey[1:-1, 2:]
    hist = np.concatenate([np.histogram(f[..., c], bins=16, range=(0, 1))[0] for c in range(3)]).astype(np.float64)
    return {"brightness": float(f.mean()), "sharpness": float(lap.var()), "hist": hist / hist.sum()}


def unhealthy(h: dict, ref: dict) -> bool:
    """Black, blown-out or flat frames relative to the history the rollout started from. The
    bounds leave room for a scene that changes as the player moves (measured on the shipped
    world: brightness within 0.6-2.1x of the history, sharpness >= 0.12x); the colour
    histogram distance is reported, not judged, since walking into another room moves it."""
    return (h["brightness"] < 0.3 * ref["brightness"] or h["brightness"] > 3.0 * ref["brightness"]
            or h["sharpness"] < 0.03 * ref["sharpness"])


# -- worker (one variant, its own process) -------------------------------------------------------
def worker(spec_path: Path):
    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    try:
        from safetensors.torch import save_file
        from torch._dynamo.utils import counters
        from tqdm import tqdm

        from inference.causvid_pipeline import CausvidPipeline
        from owl_wms.config import load_world
        from owl_wms.controls import to_uint8
        from owl_wms.engine.profiler import peak_memory_mb
        from owl_wms.maze.worlds import load_level
        from owl_wms.settings import without_kv

        world = load_world(spec["checkpoint"])
        # The variant's OWL_* flags alone choose the cache plan (not the config's default plan).
        settings = with_threads(resolve_settings(without_kv(world.inference)))
        settings = settings.replace(profile_kv=True, profile_kv_first=0, profile_kv_every=10**9)
        pipe = CausvidPipeline.from_checkpoint(world, settings=settings, clip=None, verbose=False)
        if spec.get("world_seed") is not None:
            load_level(pipe, spec["world_seed"], future=0)
        else:
            pipe.load_clip(spec["clip"])
        history = pipe.decoder.decode(pipe.clip.latents[-4:].to(pipe.device) * pipe.vae_scale)
        np.save(out / "history.npy", to_uint8(history).numpy())
        frames, velocities, timings = [], [], []
        graphs = None
        for i, (mouse, buttons) in enumerate(tqdm(spec["actions"], desc=spec["name"], unit="frame", file=sys.stderr)):
            if i == WARMUP:
                graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            pipe.profiler.start()
            frame = pipe.decode(pipe.generate(mouse, buttons))
            pipe.profiler.mark("decoder")
            pipe.profiler.frame(pipe.kv_bytes)
            timings.append({"total": (time.perf_counter() - t0) * 1000, **pipe.profiler.last})
            frames.append(frame.numpy())
            velocities.append(pipe.last_velocity.float().cpu())
        np.save(out / "frames.npy", np.stack(frames))
        save_file({"velocity": torch.cat(velocities).contiguous()}, str(out / "velocity.safetensors"))
        (out / "result.json").write_text(json.dumps({
            "settings": pipe.settings.describe(), "kv_bytes": pipe.kv_bytes,
            "recompiles": counters["stats"]["unique_graphs"] - (graphs or 0), "peak_mem_mb": peak_memory_mb(
                pipe.settings.device), "timings": timings}, indent=1))
    except BaseException as e:  # noqa: BLE001 - every failure is reported by the parent
        (out / "error.txt").write_text(f"{type(e).__name__}: {flag_message(e)}\n\n{traceback.format_exc()}")
        raise SystemExit(1)


# -- parent ------------------------------------------------------------------------------------
def run_variant(name, env, spec, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("error.txt", "result.json"):
        (folder / stale).unlink(missing_ok=True)
    (folder / "spec.json").write_text(json.dumps({**spec, "name": name}))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OWL_")}
    # The worker runs where the user does (relative paths in the spec mean the same) and finds
    # this repo's modules from anywhere.
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    child_env = {**clean, **env, "OWL_SEED": str(spec["seed"]), "PYTHONPATH": path}
    before = cpu_reading()
    with open(folder / "log.txt", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "scripts.ab_kv", "--worker", str(folder / "spec.json")],
                            env=child_env, stdout=log, stderr=None).returncode
    # cores' worth of CPU other processes took while the variant ran (its worker is reaped: own_ticks counts it)
    others = others_cores(before, cpu_reading())
    if rc != 0 or not (folder / "result.json").is_file():
        err = (folder / "error.txt").read_text() if (folder / "error.txt").is_file() else (folder / "log.txt").read_text()
        return {"name": name, "env": env, "error": err.strip().splitlines()[0] if err.strip() else f"exit code {rc}",
                "detail": err}
    res = json.loads((folder / "result.json").read_text())
    from safetensors.torch import load_file

    res.update(name=name, env=env, others_cores=others, frames=np.load(folder / "frames.npy"),
               history=np.load(folder / "history.npy"),
               velocity=load_file(str(folder / "velocity.safetensors"))["velocity"])
    return res


def frame_metrics_batch(a: np.ndarray, b: np.ndarray):
    from owl_wms.maze.evaluation import frame_metrics

    return [frame_metrics(x, y) for x, y in zip(a, b)]


def analyse(res: dict, base: dict, real: np.ndarray | None):
    n = len(res["frames"])
    vs_base = frame_metrics_batch(res["frames"], base["frames"])
    vs_sim = frame_metrics_batch(res["frames"], real) if real is not None else [(np.nan, np.nan)] * n
    drift = (res["velocity"] - base["velocity"]).flatten(1).norm(dim=1).tolist()
    hist = [health(h) for h in res["history"]]
    ref = {"brightness": float(np.mean([h["brightness"] for h in hist])),
           "sharpness": float(np.mean([h["sharpness"] for h in hist])), "hist": np.mean([h["hist"] for h in hist], 0)}
    hs = [health(f) for f in res["frames"]]
    res["per_frame"] = [{
        "frame": i + 1, "psnr_vs_base": vs_base[i][0], "ssim_vs_base": vs_base[i][1], "psnr_vs_sim": vs_sim[i][0],
        "ssim_vs_sim": vs_sim[i][1], "velocity_drift": drift[i], "brightness": hs[i]["brightness"],
        "sharpness": hs[i]["sharpness"], "hist_dist": float(np.abs(hs[i]["hist"] - ref["hist"]).sum()),
        "unhealthy": int(unhealthy(hs[i], ref)),
        **{f"ms_{k}": v for k, v in res["timings"][i].items()}} for i in range(n)]
    below = next((r["frame"] for r in res["per_frame"] if r["psnr_vs_base"] < 30), None)
    steady = res["timings"][WARMUP:] or res["timings"]
    timed = [t["total"] for t in steady]
    mean = lambda key: float(np.mean([min(r[key], 100.0) for r in res["per_frame"]]))  # noqa: E731
    res["summary"] = {
        "psnr_vs_base": mean("psnr_vs_base"), "ssim_vs_base": mean("ssim_vs_base"), "first_below_30db": below,
        "psnr_vs_sim": mean("psnr_vs_sim"), "ssim_vs_sim": mean("ssim_vs_sim"),
        "drift_mean": float(np.mean(drift)), "drift_last": drift[-1], "unhealthy_frames": sum(
            r["unhealthy"] for r in res["per_frame"]), "brightness": mean("brightness"), "sharpness": mean("sharpness"),
        "hist_dist": mean("hist_dist"),
        "median_ms": statistics.median(timed), "p95_ms": float(np.percentile(timed, 95)),
        "step1_ms": statistics.median(t.get("step1", np.nan) for t in steady),
        "step2_ms": statistics.median(t.get("step2", np.nan) for t in steady),
        "decoder_ms": statistics.median(t.get("decoder", np.nan) for t in steady),
        "kv_mib": res["kv_bytes"] / 2**20, "peak_mem_mb": res["peak_mem_mb"], "recompiles": res["recompiles"],
        "others_cores": res["others_cores"]}


MANIFEST = "ab_kv_outputs.txt"  # what a run wrote into --out, removed by the next run into the same folder


def clear_previous_run(out: Path) -> int:
    """Remove what an earlier run listed in ``out``'s manifest (nothing else); returns how many."""
    import shutil

    manifest = out / MANIFEST
    if not manifest.is_file():
        return 0
    removed = 0
    for name in manifest.read_text().split():
        path = out / name
        if "/" in name or name in ("", ".", "..") or not path.exists():
            continue
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        removed += 1
    manifest.unlink()
    return removed


def verdict(r: dict) -> str:
    """One line on how a variant compares with the baseline, and why where the cause is known."""
    s, env = r["summary"], r["env"]
    if r["name"] == "baseline":
        return "the reference every other variant is compared with"
    if s["unhealthy_frames"]:
        return f"{s['unhealthy_frames']} unhealthy frames (black, blown-out or flat): the cache is broken"
    psnr = s["psnr_vs_base"]
    level = ("identical frames" if psnr >= 100 else "indistinguishable from the baseline" if psnr >= 45 else
             "close to the baseline" if psnr >= 35 else "visibly different from the baseline")
    causes = []
    if env.get("OWL_KV_SHARE", "1") != "1":
        causes.append("cross-layer sharing hands a layer another layer's keys and values, which a model not "
                      "fine-tuned for it never saw: expected to lose on this model")
    codecs = " ".join(str(v) for k, v in env.items() if k in ("OWL_KV_STORAGE", "OWL_KV_FMT_K", "OWL_KV_FMT_V",
                                                               "OWL_KV_BITS"))
    if psnr < 45 and ("int4" in codecs or "e5m2" in codecs or env.get("OWL_KV_BITS") == "4"):
        causes.append("few mantissa or integer bits: the rounding error grows over a rollout")
    if psnr < 45 and not causes and s["first_below_30db"] is not None:
        causes.append(f"a chaotic rollout: frame {s['first_below_30db']} is the first under 30 dB, after which "
                      "the two dream different futures of the same level")
    return level + (f" ({psnr:.1f} dB); " + "; ".join(causes) if causes else f" ({min(psnr, 100):.1f} dB)")


def write_report(out: Path, results: list, failed: list, header: list[str]):
    ok = results
    lines = [*header, "", "## Verdicts", ""]
    lines += [f"- **{r['name']}**: {verdict(r)}" for r in results]
    lines.append("")

    def table(title, cols, best=None):
        lines.extend([f"## {title}", "", "| variant | " + " | ".join(c[0] for c in cols) + " |",
                      "|---|" + "---|" * len(cols)])
        cands = [r for r in ok if r["name"] != "baseline"]
        winner = None
        if best and len(cands) > 1:  # a lone variant wins nothing
            key, sign = best
            winner = max(cands, key=lambda r: sign * (r["summary"][key] if r["summary"][key] == r["summary"][key]
                                                      else -1e9))["name"]
        for r in ok:
            mark = " 🏆" if r["name"] == winner else ""
            cells = []
            for _, key, fmt in cols:
                v = r["summary"][key]
                cells.append("-" if v is None or (isinstance(v, float) and v != v) else format(v, fmt))
            lines.append(f"| {r['name']}{mark} | " + " | ".join(cells) + " |")
        lines.append("")

    table("Quality (means over frames; identical frames count as 100 dB)",
          [("PSNR vs baseline", "psnr_vs_base", ".2f"), ("SSIM vs baseline", "ssim_vs_base", ".4f"),
           ("first frame < 30 dB", "first_below_30db", ""), ("PSNR vs simulator", "psnr_vs_sim", ".2f"),
           ("SSIM vs simulator", "ssim_vs_sim", ".4f"), ("velocity drift (mean L2)", "drift_mean", ".4f"),
           ("velocity drift (last)", "drift_last", ".4f")], best=("psnr_vs_base", 1))
    table("Health (no reference: black, blown-out or flat frames against the starting history)",
          [("unhealthy frames", "unhealthy_frames", "d"), ("brightness", "brightness", ".3f"),
           ("sharpness", "sharpness", ".5f"), ("colour histogram distance", "hist_dist", ".3f")])
    table("Speed (ms per frame after warm-up)",
          [("median", "median_ms", ".1f"), ("p95", "p95_ms", ".1f"), ("step 1", "step1_ms", ".1f"),
           ("step 2", "step2_ms", ".1f"), ("decoder", "decoder_ms", ".1f"), ("recompiles", "recompiles", "d"),
           ("other processes' cores", "others_cores", ".2f")],
          best=("median_ms", -1))
    # (the no-cache baseline keeps the history's inputs, not K/V, and pays for it in time)
    table("Memory", [("history MiB (K/V data + scales; no cache: its inputs)", "kv_mib", ".2f"),
                     ("peak memory MiB", "peak_mem_mb", ".0f")], best=("kv_mib", -1))
    lines += ["## Variants", ""]
    for r in results + failed:
        flags = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "(defaults: bf16 roll)"
        lines.append(f"- **{r['name']}**: `{flags}`" + (f" - settings: `{r['settings']}`" if "settings" in r else ""))
    if failed:
        lines += ["", "## Failed variants", ""]
        lines += [f"- **{r['name']}** crashed: `{r['error']}` (full log in `{r['name']}/`)" for r in failed]
    lines += ["", "Files: metrics.csv (per frame, per variant), psnr_ssim.png, latency.png, memory.png, "
              "<variant>.mp4 (baseline | variant | 4x difference)."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def write_csv(out: Path, results: list):
    rows = [{"variant": r["name"], **p} for r in results for p in r["per_frame"]]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_plots(out: Path, results: list):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    simulated = any(p["psnr_vs_sim"] == p["psnr_vs_sim"] for r in results for p in r["per_frame"])
    fig, ax = plt.subplots(1, 3 if simulated else 2, figsize=(15 if simulated else 10, 4))
    for r in results:
        x = [p["frame"] for p in r["per_frame"]]
        ax[0].plot(x, [min(p["psnr_vs_base"], 100) for p in r["per_frame"]], label=r["name"])
        ax[1].plot(x, [p["ssim_vs_base"] for p in r["per_frame"]], label=r["name"])
        if simulated:
            ax[2].plot(x, [p["psnr_vs_sim"] for p in r["per_frame"]], label=r["name"])
    for a, t in zip(ax, ("PSNR vs baseline (dB, capped at 100)", "SSIM vs baseline", "PSNR vs simulator (dB)")):
        a.set(xlabel="frame", title=t)
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "psnr_ssim.png", dpi=100)
    names = [r["name"] for r in results]
    for fname, keys, ylabel in (("latency.png", ("step1_ms", "step2_ms", "decoder_ms"), "ms per frame (median)"),
                                ("memory.png", ("kv_mib",), "KV cache MiB")):
        fig, a = plt.subplots(figsize=(max(6, len(names) * 1.2), 4))
        bottom = np.zeros(len(names))
        for k in keys:
            vals = np.array([r["summary"][k] for r in results], dtype=float)
            a.bar(names, vals, bottom=bottom, label=k)
            bottom += np.nan_to_num(vals)
        a.set(ylabel=ylabel)
        a.legend(fontsize=7)
        plt.setp(a.get_xticklabels(), rotation=30, ha="right")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=100)
    plt.close("all")


def write_videos(out: Path, results: list, fps: float):
    from inference.video import Mp4Writer

    base = results[0]["frames"]
    for r in results[1:]:
        with Mp4Writer(out / f"{r['name']}.mp4", fps=fps, scale=2) as w:
            for a, b in zip(base, r["frames"]):
                diff = np.clip(np.abs(a.astype(np.int16) - b.astype(np.int16)) * 4, 0, 255).astype(np.uint8)
                w.write(np.concatenate([a, b, diff], axis=1))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(Path(argv[1]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=None,
                   help=f"preset name ({PRESETS.name}) or name:FLAG=V,FLAG=V (repeat); default: "
                        f"{' '.join(DEFAULT_VARIANTS)}")
    p.add_argument("--checkpoint", default=None, help="default: the shipped world")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--world-seed", type=int, default=None, help="start from this simulator level (default 1000200)")
    start.add_argument("--clip", default=None, help="start from a clip (index or path) instead")
    p.add_argument("--actions", default="walk_turn", help="built-in script (idle, forward, turn, walk_turn, random[:seed]) "
                   "or a JSONL action file")
    p.add_argument("--frames", type=int, default=None, help="frames per variant (default 64, or the action file's length)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (identical for every variant)")
    p.add_argument("--fps", type=float, default=15.0)
    p.add_argument("--out", default="eval/ab")
    args = p.parse_args(argv)

    from inference.actions import load_actions
    from inference.causvid_pipeline import DEFAULT_CHECKPOINT
    from owl_wms.clips import check_clip, is_clip_index
    from owl_wms.config import load_world
    from tqdm import tqdm


    checkpoint = str(Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT)
    world = load_world(checkpoint)
    if args.clip is not None:
        try:
            check_clip(world, args.clip)
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"error: --clip {args.clip}: {e}") from None
    presets = load_presets()
    variants = [("baseline", {})]
    for spec in args.variant or DEFAULT_VARIANTS:
        name, env = parse_variant(spec, presets)
        if name == "baseline" and not env:
            continue
        if name in {v[0] for v in variants}:
            raise SystemExit(f"error: variant name {name!r} appears twice; give inline variants distinct names")
        variants.append((name, env))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create the output folder {str(out)!r} ({e.strerror}); choose another --out")
    if not os.access(out, os.W_OK):
        raise SystemExit(f"error: output folder {str(out)!r} is not writable; choose another --out")
    if cleared := clear_previous_run(out):
        print(f"cleared the {cleared} outputs an earlier run left in {out}", flush=True)
    world_seed = args.world_seed if args.clip is None else None
    if args.clip is None and world_seed is None:
        world_seed = 1_000_200
    if args.frames is not None and args.frames < 1:
        raise SystemExit(f"error: --frames {args.frames}: must be >= 1")
    try:
        items = load_actions(args.actions, args.frames)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    # pipeline events in action files do not apply here
    actions = [[list(map(float, m)), list(map(float, b))] for m, b in (x for x in items if not isinstance(x, dict))]
    args.frames = len(actions)
    clip = int(args.clip) if args.clip is not None and is_clip_index(args.clip) else args.clip
    spec = {"checkpoint": checkpoint, "world_seed": world_seed, "clip": clip, "actions": actions, "seed": args.seed}

    results, failed = [], []
    for i, (name, env) in enumerate(tqdm(variants, desc="variants", unit="variant")):
        res = run_variant(name, env, spec, out / name)
        if "error" in res:
            if name == "baseline":
                raise SystemExit(f"error: the baseline crashed, nothing to compare: {res['error']}")
            failed.append(res)
            tqdm.write(f"variant {name} crashed: {res['error']}")
            continue
        results.append(res)
    real = None
    if world_seed is not None:  # what the simulator shows under the same history and actions
        from owl_wms.maze.data import rollout_episode
        from owl_wms.maze.worlds import sim_config

        frames, _, _ = rollout_episode(world_seed, world.pipeline.window_frames, then=actions,
                                       config=sim_config(world, *results[0]["frames"].shape[1:3]))
        real = frames[world.pipeline.window_frames:]
    for r in results:
        analyse(r, results[0], real)
    cmd = " ".join(["python -m scripts.ab_kv", *argv])
    start_text = f"simulator level {world_seed}" if world_seed is not None else f"clip {clip}"
    header = [f"# A/B: KV cache modes on {world.name}", "",
              f"- command: `{cmd}`", f"- machine: {machine()}; torch {torch.__version__}",
              f"- checkpoint `{checkpoint}`, start: {start_text}, actions `{args.actions}`, {args.frames} frames, "
              f"noise seed {args.seed}; each variant in its own process",
              "- quality is against the baseline's frames" + (" and the simulator's" if real is not None else
                                                              " (no simulator for a clip: its columns show -)")]
    busy = [r["name"] for r in results if (r["others_cores"] or 0) > BUSY_CORES]
    if busy:
        header.append(f"- **the machine was busy**: other processes used more than {BUSY_CORES} of a core while "
                      f"{', '.join(busy)} ran, so the speed figures are not comparable; rerun on an idle machine")
    write_report(out, results, failed, header)
    write_csv(out, results)
    write_plots(out, results)
    write_videos(out, results, args.fps)
    written = ["report.md", "metrics.csv", "psnr_ssim.png", "latency.png", "memory.png",
               *(name for name, _ in variants), *(f"{r['name']}.mp4" for r in results[1:])]
    (out / MANIFEST).write_text("\n".join(written) + "\n")
    print(f"\n{'variant':<22} {'PSNR/base':>9} {'first<30':>8} {'PSNR/sim':>8} {'drift':>8} {'bad':>4} "
          f"{'median ms':>9} {'hist MiB':>8}" + ("" if real is not None else "   (no simulator for a clip)"))
    for r in results:
        s = r["summary"]
        sim = f"{s['psnr_vs_sim']:.2f}" if real is not None else "-"
        print(f"{r['name']:<22} {s['psnr_vs_base']:>9.2f} {str(s['first_below_30db'] or '-'):>8} "
              f"{sim:>8} {s['drift_mean']:>8.4f} {s['unhealthy_frames']:>4d} "
              f"{s['median_ms']:>9.1f} {s['kv_mib']:>8.2f}")
        print(f"  {verdict(r)}")
    for r in failed:
        print(f"{r['name']:<22} CRASHED: {r['error']}")
    if busy:
        print(f"note: the machine was busy while {', '.join(busy)} ran (other processes' cores in the report): "
              "the speed figures are not comparable; rerun on an idle machine")
    print(f"report: {out / 'report.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
