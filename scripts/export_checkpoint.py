"""Stage 5: assemble a shippable checkpoint folder from the training outputs.

    python -m scripts.export_checkpoint --vae work/vae/final --latents work/latents --world work/world \\
        --out checkpoints/maze-world [--config C] [--eval eval/eval.json]

The model config defaults to the one the world's training record names (train_world keeps it).

Writes config.yaml (with the measured vae_scale), the EMA weights in bf16 (model.safetensors,
or 16 MB shards with model.safetensors.index.json),
vae/ (save_pretrained), clips/ (history windows from fresh simulator levels, encoded, with
--future recorded policy actions each) and MODEL.md with the figures the stages measured.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from omegaconf import OmegaConf

from owl_wms.config import ConfigError, load_config, parse_config, read_config
from owl_wms.loading import CheckpointError, load_weights
from owl_wms.maze.data import EPISODE_OPTIONS, OPEN_WALL, episode_options, level_clip
from owl_wms.maze.training import DEFAULT_WORLD_CONFIG, WORLD_RECORD
from owl_wms.maze.worlds import SIM_KEYS, sim_config
from owl_wms.model import GameRFT

from .common import machine

SHARD_BYTES = 16 * 2**20
CLIP_SEED = 2_000_000  # clip levels: neither training (0..) nor evaluation (1,000,000..) seeds


def share(value: float | None) -> str:
    """A turn-following share for MODEL.md ("none seen" where the evaluation met no such frame)."""
    return "none seen" if value is None else f"{value:.2f}"


def train_world_commands(train: dict) -> list[dict]:
    """The train_world commands behind a run record, each as (from_step, batch, --steps, other
    recipe flags): consecutive runs with the same flags are one command, stopped and resumed."""
    merged = []
    key = lambda c: (c["batch"], c["steps"], c["options"])  # noqa: E731
    for r in train.get("runs") or [{"batch": train["batch"], "from_step": 0, "to_step": train["steps"]}]:
        command = {"from_step": r["from_step"], "batch": r["batch"], "steps": r.get("target", r["to_step"]),
                   "options": r.get("options", "")}
        if not merged or key(merged[-1]) != key(command):
            merged.append(command)
    return merged


def vae_commands(vae: dict) -> tuple[list[str], str]:
    """The train_vae commands behind a VAE's metrics, and the folder export takes: a plain run,
    or a run whose decoder was then fine-tuned (``--init ... --decoder-only``)."""
    base = vae.get("base") if vae.get("init") else vae
    if base is None:
        raise SystemExit(f"the VAE was fine-tuned from {vae['init']!r}, whose folder has no metrics.json: "
                         "MODEL.md cannot say how that VAE was trained")
    lines = [f"python -m scripts.train_vae --steps {base['steps']}   # diffusers AutoencoderTiny, save_pretrained"]
    if not vae.get("init"):
        return lines, "work/vae/final"
    only = " --decoder-only" if vae.get("decoder_only") else ""
    return lines + [f"python -m scripts.train_vae --init work/vae/final{only} --out work/vae_decoder --steps "
                    f"{vae['steps']} --lr {vae['lr']:g}   # sharper decoder; encoder and latents unchanged"], \
        "work/vae_decoder/final"


def minutes(rec: dict | None) -> str:
    """A stage's recorded wall time (all its runs, if it was stopped and resumed)."""
    if rec and "seconds_all_runs" in rec:
        n = len(rec["runs"])
        return f"{rec['seconds_all_runs'] / 60:.1f} min in {n} run{'s' if n > 1 else ''}"
    return f"{rec['seconds_this_run'] / 60:.1f} min" if rec and "seconds_this_run" in rec else "not recorded"


def vae_row(vae: dict) -> str:
    """MODEL.md's account of the VAE's training: steps, frames and time of each run."""
    base = vae.get("base") if vae.get("init") else vae
    text = f"{base['steps']} steps on {base['train_frames']} frames, {minutes(base)}"
    if vae.get("init"):
        text += (f"; then {vae['steps']} steps of decoder-only fine-tuning, {minutes(vae)}, "
                 f"from {base['held_out_psnr_db']:.2f} dB")
    if vae.get("restored"):
        text += f"; {vae['restored']}"
    return text


def data_commands(options: dict) -> tuple[list[str], str, str]:
    """The commands that make a world model's episodes and latents (``options``: a manifest or
    its episode options), and the ``--latents`` / ``--data`` arguments naming their folders. The
    default episodes are the VAE's own, so they need only encoding and their folders are the defaults."""
    changed = {k: v for k, v in episode_options(options).items() if v != EPISODE_OPTIONS[k]}
    if not changed:
        return ["python -m scripts.encode_latents       # latents + measured vae_scale"], "", ""
    flags = " ".join(f"--{k} {v}" for k, v in changed.items())
    name = "_".join(str(v) if k == "policy" else f"{k}{v}" for k, v in changed.items())
    return [f"python -m scripts.generate_data {flags} --out work/data_{name}   # the world model's episodes",
            f"python -m scripts.encode_latents --data work/data_{name} --out work/latents_{name}   "
            "# latents + measured vae_scale"], f" --latents work/latents_{name}", f" --data work/data_{name}"


def base_data(train: dict, data: dict) -> dict:
    """The episode options a fine-tune's base world learned from: its export's record of them, or,
    for a base exported before records kept them, the fine-tune's own."""
    return train["base"].get("data", {}).get("options", data)


def world_commands(train: dict, data: dict, vae_arg: str, world_dir: str = "work/world",
                   made: list[str] | None = None) -> list[str]:
    """The commands behind a world's training record: its episodes' and latents' (``data``: their
    options) unless ``made`` already holds them, then its train_world runs; a fine-tune (``--init``)
    is preceded by the commands of the world it started from, on that world's own episodes, and
    that world's export."""
    made = [] if made is None else made
    lines = []
    if train.get("init"):
        base = train.get("base")
        if base is None:
            raise SystemExit(f"the world model was fine-tuned from {train['init']!r}, whose folder has no "
                             f"{WORLD_RECORD}: MODEL.md cannot say how that world was trained")
        base_dir, base_options = base.get("out", "work/world"), base_data(train, data)
        lines += world_commands(base, base_options, vae_arg, base_dir, made)
        _, latents, data_arg = data_commands(base_options)
        lines += [f"python -m scripts.export_checkpoint{latents}{data_arg}{vae_arg}"
                  f"{'' if base_dir == 'work/world' else f' --world {base_dir}'} --out {train['init']}"
                  "   # the world to fine-tune"]
    data_lines, latents, _ = data_commands(data)
    lines += [c for c in data_lines if c not in made]
    made += data_lines
    out = "" if world_dir == "work/world" else f" --out {world_dir}"
    for i, r in enumerate(train_world_commands(train)):
        options = f" {r['options']}" if r["options"] else ""
        what = (("# fine-tune" if train.get("init") else "# rectified flow + diffusion forcing") if i == 0 else
                f"# resumes at step {r['from_step']} on the cosine schedule stretched to {r['steps']} steps")
        lines += [f"python -m scripts.train_world{latents}{out} --batch {r['batch']} --steps {r['steps']}{options}   {what}"]
    return lines


def chain_commands(data: dict, train: dict, vae: dict, world_dir: str = "work/world") -> list[str]:
    """MODEL.md's recipe. The VAE always learns from the default episodes (exploring policy,
    one-unit corridors); a world model trained on other episodes (``data``: the manifest of
    its episodes, whose non-default options name its data and latents folders) gets its own,
    and so does the base world of a fine-tune (its record's ``data``)."""
    vae_lines, vae_dir = vae_commands(vae)
    vae_arg = "" if vae_dir == "work/vae/final" else f" --vae {vae_dir}"
    lines = ["python -m scripts.generate_data        # simulator episodes (exploring policy)", *vae_lines]
    lines += world_commands(train, data, vae_arg, world_dir)
    _, latents, data_arg = data_commands(data)
    export = f"python -m scripts.export_checkpoint{latents}{data_arg}{vae_arg}" + \
        ("" if world_dir == "work/world" else f" --world {world_dir}")
    return lines + [f"{export}   # checkpoints/maze-world",
                    "OWL_DTYPE=fp32 python -m scripts.eval_world --checkpoint checkpoints/maze-world --euler-steps 16 "
                    "--out eval/maze-world   # fp32: the same figures on every CPU",
                    f"{export} --eval eval/maze-world/eval.json   # MODEL.md with the evaluation"]


def data_record(manifest: dict, stats: dict, episodes: dict) -> dict:
    """What a world's export keeps of its episodes and latents: their options, size, stage
    times and vae_scale."""
    times = ("seconds_this_run", "seconds_all_runs", "runs")
    return {"options": episodes, "episodes": manifest.get("episodes"), "frames": manifest.get("frames"),
            "generate": {k: manifest[k] for k in times if k in manifest},
            "encode": {k: stats[k] for k in times if k in stats}, "vae_scale": stats["vae_scale"]}


def data_rows(data: dict, train: dict) -> tuple[str, str]:
    """MODEL.md's data and encode rows: the world's episodes (``data``: ``data_record``), then
    those of a fine-tune's base world where they differ."""
    def rows(d: dict) -> tuple[str, str]:
        corridor = d["options"]["corridor"]
        return (f"{d['episodes'] or '?'} episodes x {d['frames'] or '?'} frames, {d['options']['policy']} policy, "
                f"corridors {corridor} grid unit{'s' if corridor > 1 else ''} wide, "
                f"{d['options'].get('look', 'brick')} walls, {minutes(d['generate'])}",
                f"vae_scale (latent std) {d['vae_scale']:.4f}, {minutes(d['encode'])}")
    data_row, encode_row = rows(data)
    base = (train.get("base") or {}).get("data") if train.get("init") else None  # None: a base with no record
    if base and base["options"] != data["options"]:
        base_data_row, base_encode_row = rows(base)
        data_row = f"{base_data_row} (the base world's); {data_row} (the fine-tune's)"
        encode_row = (f"{base_encode_row} (the base world's, which the fine-tune keeps); "
                      f"{encode_row} (the fine-tune's episodes)")
    return data_row, encode_row


def world_row(train: dict) -> str:
    """MODEL.md's account of the world model's training: every run of the chain, from the first
    world to the last fine-tune (each record keeps the one it started from as ``base``)."""
    chain = [train]
    while chain[-1].get("init") and chain[-1].get("base"):
        chain.append(chain[-1]["base"])
    first, *tunes = reversed(chain)
    text = (f"{first['steps']} steps x batch {first['batch']} x {first['frames']} frames, final loss "
            f"{first['final_loss']:.4f}, {minutes(first)}")
    for before, tune in zip([first, *tunes], tunes):
        frames = f" x {tune['frames']} frames" if tune.get("frames") != before.get("frames") else ""
        text += (f"; then {tune['steps']} steps of fine-tuning x batch {tune['batch']}{frames}, final loss "
                 f"{tune['final_loss']:.4f}, {minutes(tune)}")
    return text


def db(ev: dict, key: str) -> str:
    """An evaluation figure in dB with its standard error over levels where the report has one; a
    shorter evaluation (fewer frames) leaves some unmeasured."""
    value, error = ev[key], ev.get("standard_error", {}).get(key)
    if value is None:
        return "not measured"
    return f"{value:.2f} dB" + (f" ± {error:.2f}" if error is not None and math.isfinite(error) else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="the world's config (default: the one its training record names, else " + DEFAULT_WORLD_CONFIG + ")")
    p.add_argument("--vae", default="work/vae/final")
    p.add_argument("--latents", default="work/latents")
    p.add_argument("--world", default="work/world")
    p.add_argument("--data", default=None,
                   help="the world model's episodes, for MODEL.md (default: the folder the latents record, "
                        "else data/ beside --latents)")
    p.add_argument("--out", default="checkpoints/maze-world")
    p.add_argument("--clips", type=int, default=4)
    p.add_argument("--future", type=int, default=1000)
    p.add_argument("--eval", default=None, help="eval.json from scripts.eval_world, quoted in MODEL.md")
    args = p.parse_args(argv)

    out = Path(args.out)
    stats = json.loads((Path(args.latents) / "stats.json").read_text())
    train = json.loads((Path(args.world) / "train_metrics.json").read_text())
    # the episodes: those the latents say they were encoded from, else data/ beside them
    data_dir = Path(args.data or stats.get("data") or Path(args.latents).parent / "data")
    manifest = json.loads((data_dir / "manifest.json").read_text()) if (data_dir / "manifest.json").is_file() else {}
    episodes = episode_options(stats if "corridor" in stats else manifest)  # latents from before the record: the data's
    if manifest and episode_options(manifest) != episodes:
        raise SystemExit(f"error: the latents in {args.latents} were encoded from episodes made with {episodes}, but "
                         f"{data_dir} holds episodes made with {episode_options(manifest)}; pass the --data they came from")
    args.config = args.config or train.get("config", DEFAULT_WORLD_CONFIG)
    try:  # merged over its base and checked: the checkpoint's config stands alone
        raw = read_config(args.config)
        model = parse_config(raw, Path(args.config)).model
    except ConfigError as exc:
        raise SystemExit(f"error: --config: {exc}") from None
    # the scale the model was trained with: the latents' own, or a fine-tune's --init world's
    raw.train.vae_scale = train.get("vae_scale", stats["vae_scale"])
    # the simulator the episodes came from, so fresh levels, clips and the evaluation match them
    made = {k: v for k, v in episodes.items() if k in SIM_KEYS}
    stated = OmegaConf.to_container(raw.get("simulator") or OmegaConf.create({}))
    clash = {k: (stated[k], v) for k, v in made.items() if k in stated and stated[k] != v}
    if clash:
        raise SystemExit(f"error: {args.config} says simulator {', '.join(f'{k}: {a}' for k, (a, _) in clash.items())}, "
                         f"but the episodes in {data_dir} were made with "
                         f"{', '.join(f'--{k} {b}' for k, (_, b) in clash.items())}; fix the config or pass --data")
    raw.simulator = {**stated, **made}
    state = torch.load(Path(args.world) / "ema_core.pt", weights_only=True)
    try:  # before anything is written: a config unlike the weights would make a checkpoint that cannot load
        load_weights(GameRFT(model), state, str(Path(args.world) / "ema_core.pt"))
    except CheckpointError as exc:
        raise SystemExit(f"error: --config {args.config}: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(
        f"# Written by scripts.export_checkpoint from {args.config} (train.vae_scale measured by scripts.encode_latents;\n"
        f"# simulator: the maze of the episodes behind {Path(args.latents) / 'stats.json'}).\n"
        "# inference: the default cache plan, chosen from scripts.quality_kv / bench_kv (docs/kv_modes.md).\n"
        + OmegaConf.to_yaml(raw, resolve=True))
    world = load_config(out / "config.yaml")

    # Shards of at most 16 MB (model-0000i-of-0000n.safetensors + model.safetensors.index.json,
    # the diffusers layout) keep every tracked file small; a small model stays one model.safetensors.
    # An earlier export's weights go first: its shards would outlive a smaller model's single file.
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    save_torch_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, out, max_shard_size=SHARD_BYTES,
                          metadata={"trained": "true"})
    # a fine-tune of this world cites it, with the episodes it learned from (MODEL.md's recipe and rows)
    data = data_record(manifest, stats, episodes)
    (out / WORLD_RECORD).write_text(json.dumps({**train, "data": data}, indent=2))
    vae_dir = world.resolve(world.decoder.path)
    # metrics.json (the VAE's training record) goes along: a later export can take this folder as
    # --vae, even re-exporting into the same checkpoint (then it is already in place, not wiped)
    if Path(args.vae).resolve() != vae_dir.resolve():
        shutil.rmtree(vae_dir, ignore_errors=True)
        shutil.copytree(args.vae, vae_dir)

    from owl_wms.vae import load_decoder

    coder = load_decoder(world)
    clip_dir = world.resolve(world.pipeline.clips)
    shutil.rmtree(clip_dir, ignore_errors=True)
    clip_dir.mkdir(parents=True)
    c, s = world.model.channels, world.model.sample_size
    sim = sim_config(world, *coder.decode(torch.zeros(1, c, s, s)).shape[-2:])  # at the decoder's frame size
    for i in range(args.clips):
        clip, _ = level_clip(coder, CLIP_SEED + i, world.pipeline.window_frames, args.future, sim)
        clip.save(clip_dir / f"clip_{i:02d}.safetensors")

    vae_metrics = json.loads((Path(args.vae) / "metrics.json").read_text())
    ev = json.loads(Path(args.eval).read_text()) if args.eval else None
    n_params = sum(v.numel() for v in state.values())
    data_row, encode_row = data_rows(data, train)

    lines = [
        f"# {world.name}", "",
        f"A GameRFT world model ({n_params / 1e6:.1f}M parameters, {world.model.n_layers} layers, d_model "
        f"{world.model.d_model}, {world.model.n_heads} heads, {world.model.channels}-channel "
        f"{world.model.sample_size}x{world.model.sample_size} latents, window {world.pipeline.window_frames} frames) "
        "trained from scratch on our maze simulator (owl_wms/maze/simulator.py). Recreate it with:", "",
        "```",
        *chain_commands(episodes, train, vae_metrics, args.world),
        "```", "",
        "Every stage is seeded and resumable and takes `--device` (cuda when present). Wall times below are",
        "each stage's runs on the machine named (all of them for a stage stopped and resumed), while other",
        "work shared its 2 cores.", "",
        "| figure | value |", "|---|---|",
        f"| machine | {machine()}, torch {torch.__version__} |",
        f"| data | {data_row} |",
        f"| VAE held-out reconstruction PSNR | {vae_metrics['held_out_psnr_db']:.2f} dB "
        f"({vae_row(vae_metrics)}) |",
        f"| encode | {encode_row} |",
        f"| world model | {world_row(train)} |",
    ]
    if ev:
        euler = next((k for k in ev if k.startswith("teacher_forced_psnr_euler")), None)
        lines += [f"| teacher-forced next-frame PSNR / SSIM (two-step sampler) | {db(ev, 'teacher_forced_psnr')} / "
                  f"{ev['teacher_forced_ssim']:.3f} (target >= 24 dB) |"]
        if euler:
            lines += [f"| teacher-forced PSNR, {euler.removeprefix('teacher_forced_psnr_euler')}-step Euler | "
                      f"{ev[euler]:.2f} dB (two-step minus Euler: {ev['teacher_forced_psnr'] - ev[euler]:+.2f} dB) |"]
        lines += [f"| autoregressive PSNR at frame 16 | {db(ev, 'ar_psnr_at_16')} (target >= 18 dB) |",
                  *([f"| layout score at frame 64 (PSNR of 4x4-block means: where things are, blur not counted) | "
                     f"{db(ev, 'layout_psnr_at_64')} |"] if ev.get("layout_psnr_at_64") is not None else []),
                  *([f"| walk and turn ({ev['walk_and_turn']['frames']} frames of the walk_turn script beside the "
                     f"simulator): the least sharp frame's sharpness ratio (high-frequency energy, model over "
                     f"simulator) | {ev['walk_and_turn']['sharpness_ratio_min']:.2f} "
                     f"({ev['walk_and_turn']['frames_below_sharp_enough']} frames below {ev['sharp_enough']:g}; "
                     f"turn in place: {ev['turn_in_place']['sharpness_ratio_min']:.2f}) |"]
                    if "walk_and_turn" in ev else []),
                  f"| action sensitivity gap, frames {ev['gap_range'][0]}-{ev['gap_range'][1]} | "
                  f"{db(ev, 'action_gap_db')}"
                  + (f", lowest level {min(ev['per_level']['action_gap_db']):+.2f} dB"
                     if "action_gap_db" in ev.get("per_level", {}) else "") + " (target >= 1.5 dB) |",
                  *([f"| diagnostic: repeat the last real frame (no model), teacher-forced | "
                     f"{ev['copy_previous_psnr']:.2f} dB |",
                     f"| diagnostic: action response, PSNR between predictions under true and foreign actions "
                     f"(same history and noise; higher = controls matter less) | {ev['action_response_psnr']:.2f} dB |"]
                    if "action_response_psnr" in ev else []),
                  *([f"| diagnostic: turn following, the model's view slide under a held turn (mouse "
                     f"{ev['turn_dx']:+g}, then {-ev['turn_dx']:+g}) as a share of the simulator's | "
                     f"{ev['turn_following']:.2f} ({ev['turn_shift_model']:.2f} vs {ev['turn_shift_sim']:.2f} "
                     "columns/frame)"
                     + (f"; one step from the simulator's frames (teacher-forced) {ev['turn_following_teacher_forced']:.2f}"
                        if "turn_following_teacher_forced" in ev else "")
                     + (f"; in the open {share(ev['turn_following_open'])} (one step "
                        f"{share(ev['turn_following_teacher_forced_open'])}), facing a wall nearer than "
                        f"{OPEN_WALL:g} {share(ev['turn_following_near_wall'])} (one step "
                        f"{share(ev['turn_following_teacher_forced_near_wall'])})"
                        if "turn_following_open" in ev else "") + " |"] if "turn_following" in ev else []),
                  *([f"| diagnostic: walking forward from the real history with the mouse at rest, exactly (0, 0), "
                     f"against barely moving, (0.3, 0.1), PSNR vs simulator over {ev['rest_frames']} frames | "
                     f"{ev['rest_walk_psnr']:.2f} dB against {ev['nudged_walk_psnr']:.2f} dB |"]
                    if "rest_walk_psnr" in ev else []),
                  f"| held-out level seeds | {ev['seeds'][0]}..{ev['seeds'][-1]} (training used 0..{manifest.get('episodes', 256) - 1})"
                  f"{'; ± is one standard error of the mean over these levels' if 'standard_error' in ev else ''} |",
                  "", f"Evaluation command: `{ev['command']}`"
                  + (f" ({ev['settings']}; {ev['machine']})" if "settings" in ev else "")
                  + "; per-frame curve: `eval_curve.png`."]
        curve, sheet, turns, walk, spin = (Path(args.eval).with_name(n) for n in (
            "psnr_curve.png", "rollouts.png", "turns.png", "walk_and_turn.png", "turn_in_place.png"))
        if curve.is_file():
            shutil.copyfile(curve, out / "eval_curve.png")
        rows = (", ".join(ev["sheet_rows"]) + ", one row each, top to bottom") if "sheet_rows" in ev \
            else "simulator above, model below"  # an evaluation from before the teacher-forced row
        if sheet.is_file():
            shutil.copyfile(sheet, out / "eval_rollouts.png")
            lines += [f"Rollouts of the first held-out levels, one frame in "
                      f"{ev.get('sheet_every', 4)} ({rows}): `eval_rollouts.png`."]
        if turns.is_file():
            shutil.copyfile(turns, out / "eval_turns.png")
            lines += [f"The turn diagnostic on the same levels, walking forward with the mouse held at "
                      f"{ev['turn_dx']:+g} and then {-ev['turn_dx']:+g} ({ev.get('turn_frames', 16)} frames each, "
                      f"one in {ev['turn_sheet_every']}; {rows}): `eval_turns.png`."]
        for image, name, what in ((walk, "eval_walk_and_turn.png", "walking, then turning right while walking"),
                                  (spin, "eval_turn_in_place.png", "turning right in place")):
            if image.is_file():
                shutil.copyfile(image, out / name)
                lines += [f"The same levels played by a script, {what}, one frame in {ev.get('sheet_every', 4)} "
                          f"(the simulator above the model): `{name}`."]
    (out / "MODEL.md").write_text("\n".join(lines) + "\n")
    size_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    print(f"exported {out} ({size_mb:.1f} MB)")


if __name__ == "__main__":
    main()
