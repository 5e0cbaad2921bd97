"""Stage 2: train the frame autoencoder (diffusers AutoencoderTiny) on simulator frames.

    python -m scripts.train_vae --data work/data --out work/vae [--steps 6000] [--device cpu]
    python -m scripts.train_vae --init work/vae/final --decoder-only --out work/vae_dec --steps 3000
    python -m scripts.train_vae --init checkpoints/maze-world/vae --data work/data_corridor2 --score-only
    python -m scripts.train_vae --init checkpoints/maze-world/vae --decoder-only --data D \
        --world-latents work/world_latents --out work/vae_world --steps 1500 --lr 0.0003

--decoder-only fine-tunes the decoder of a trained autoencoder with its encoder frozen (as
Stable Diffusion's ft-MSE VAE was made): the latents do not change, so a world model trained
on them keeps working with the sharper decoder.

--world-latents P (with --decoder-only) also trains the decoder on what it decodes in play: a
world's own next-frame latents, each with the simulator frame it should show (made by
scripts.world_latents); --world-share of every batch comes from them. Their last --held-out
levels are scored too: the decoded predictions' PSNR against the simulator (the world's
teacher-forced PSNR through this decoder) and their sharpness ratio.

Resumable: a training state (weights, optimizer, step, RNG) is saved every --save-every
steps and picked up on restart. The last episodes are held out; their reconstruction PSNR
is printed at every save. The result is written with save_pretrained to <out>/final.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from owl_wms.config import ConfigError
from owl_wms.controls import to_uint8, to_unit
from owl_wms.maze.evaluation import sharpness_ratio
from owl_wms.maze.training import STOPPED, RunLog, StopSignal, load_training_state, save_training_state, warmup_cosine
from owl_wms.maze.training.vae import (build_autoencoder, load_frames, load_world_latents, psnr, vae_loss,
                                        world_latent_loss)
from owl_wms.vae import load_autoencoder


def base_metrics(folder: str) -> dict | None:
    """The metrics of the run that made an --init autoencoder (None if its folder has none)."""
    path = Path(folder) / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else None


def held_out_scores(ae, frames: torch.Tensor, device: str, sharpness: bool = False,
                    latents: torch.Tensor | None = None) -> tuple[float, float | None]:
    """Reconstruction PSNR (dB) of uint8 frames [N, 3, H, W] and, with ``sharpness``, the mean
    sharpness ratio of the reconstructions (owl_wms.maze.evaluation): the fine detail the
    autoencoder keeps, which bounds how sharp any world model's frames through it can be.
    ``latents`` [N, c, h, w]: score those decoded (a world's predictions) against ``frames``
    instead. Leaves the autoencoder in eval mode."""
    ae.eval()
    with torch.no_grad():
        x = to_unit(frames).to(device)
        if latents is None:
            rec = torch.cat([ae.decode(ae.encode(c).latents).sample for c in x.split(256)])
        else:
            rec = torch.cat([ae.decode(z.to(device)).sample for z in latents.split(256)])
    kept = float(np.mean([sharpness_ratio(a.numpy(), b.numpy()) for a, b in zip(to_uint8(rec), to_uint8(x))])) \
        if sharpness else None
    return psnr(rec, x), kept


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="work/data")
    p.add_argument("--out", default="work/vae")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--channels", type=int, default=32, help="latent channels (must match model.channels of the world config)")
    p.add_argument("--width", type=int, default=32, help="channels of every encoder/decoder stage")
    p.add_argument("--init", default=None,
                   help="start from this save_pretrained folder (its architecture; --channels/--width unused)")
    p.add_argument("--decoder-only", action="store_true",
                   help="freeze the encoder, train the decoder (needs --init): the latents stay the same")
    p.add_argument("--fp32", action="store_true", help="train in float32 (default: bf16 autocast, ~2x faster on CPU)")
    p.add_argument("--held-out", type=int, default=4, help="episodes kept for validation")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score-only", action="store_true",
                   help="print the --init autoencoder's held-out reconstruction PSNR on --data and stop (trains nothing)")
    p.add_argument("--world-latents", default=None,
                   help="a folder of scripts.world_latents: also train the decoder on a world's own predictions "
                        "(needs --decoder-only)")
    p.add_argument("--world-share", type=float, default=0.5,
                   help="share of every batch drawn from --world-latents")
    p.add_argument("--detail-weight", type=float, default=0.0,
                   help="on --world-latents, add this times the squared log of each decoded frame's sharpness "
                        "ratio (owl_wms.maze.training.vae.detail_gap; 0: MSE alone)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    out = Path(args.out)
    if (args.decoder_only or args.score_only) and not args.init:
        p.error("--decoder-only and --score-only take a trained autoencoder: give its save_pretrained folder with --init")
    if args.world_latents and not args.decoder_only:
        p.error("--world-latents trains the decoder on latents the encoder made: it needs --decoder-only, so the "
                "encoder (and every world trained on its latents) stays the same")
    if args.detail_weight < 0 or (args.detail_weight and not args.world_latents):
        p.error(f"--detail-weight {args.detail_weight}: must be >= 0, and applies to --world-latents")
    if not 0 < args.world_share <= 1:
        p.error(f"--world-share {args.world_share}: must be in (0, 1]")
    try:  # before the frames are read: a wrong --init fails at once
        ae = load_autoencoder(args.init, what="--init") if args.init else build_autoencoder(args.channels, args.width)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    frames = load_frames(args.data)
    per_ep = frames.shape[0] // len(list(Path(args.data).glob("ep_*.safetensors")))
    train, val = frames[: -args.held_out * per_ep], frames[-args.held_out * per_ep:][::8]
    world = None
    if args.world_latents:
        try:
            z, real, levels = load_world_latents(args.world_latents)
        except FileNotFoundError as exc:
            raise SystemExit(f"error: --world-latents: {exc}") from None
        if z.shape[1:] != (ae.config.latent_channels, *z.shape[2:]) or real.shape[1:] != frames.shape[1:]:
            raise SystemExit(f"error: --world-latents {args.world_latents} holds latents {tuple(z.shape[1:])} and "
                             f"frames {tuple(real.shape[1:])}; --init's autoencoder has {ae.config.latent_channels} "
                             f"latent channels and --data frames {tuple(frames.shape[1:])}: make them with this "
                             f"autoencoder's world")
        if levels <= args.held_out:
            raise SystemExit(f"error: --world-latents {args.world_latents} holds {levels} levels; at least "
                             f"{args.held_out + 1} are needed (--held-out {args.held_out} are scored, not trained on)")
        cut = z.shape[0] - args.held_out * (z.shape[0] // levels)
        world = {"train": (z[:cut], real[:cut]), "val": (z[cut:][::4], real[cut:][::4])}
    ae = ae.to(args.device, memory_format=torch.channels_last)
    if args.score_only:
        score, kept = held_out_scores(ae, val, args.device, sharpness=True)
        print(f"held-out reconstruction PSNR {score:.2f} dB, sharpness ratio "
              f"{kept:.2f} ({val.shape[0]} frames of the last {args.held_out} episodes in {args.data})")
        return

    def world_scores() -> tuple[float, float]:
        return held_out_scores(ae, world["val"][1], args.device, sharpness=True, latents=world["val"][0])

    world_before = world_scores() if world else None
    out.mkdir(parents=True, exist_ok=True)
    if args.decoder_only:
        ae.encoder.requires_grad_(False)  # no graph through it: the loss's encode is inference only
    device_type = torch.device(args.device).type
    opt = torch.optim.AdamW([q for q in ae.parameters() if q.requires_grad], lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, max(1, args.steps // 20)))
    gen = torch.Generator().manual_seed(args.seed)
    state_path = out / "train_state.pt"
    step, runs = load_training_state(state_path, gen, model=ae, opt=opt, sched=sched)
    clock = RunLog(runs or [], step, args.batch, args.steps)  # a state from before run records: this run's time only

    def evaluate() -> str:
        score, _ = held_out_scores(ae, val, args.device)
        said = f"held-out PSNR {score:.2f} dB"
        if world:
            said += ", world's predictions {:.2f} dB, sharpness ratio {:.2f}".format(*world_scores())
        ae.train()
        return said

    n_world = max(1, round(args.batch * args.world_share)) if world else 0

    bar = tqdm(total=args.steps, initial=step, desc="vae", unit="step")
    with StopSignal() as stop:
        while step < args.steps and not stop.requested:
            idx = torch.randint(0, train.shape[0], (args.batch - n_world,), generator=gen)
            x = to_unit(train[idx]).to(args.device).contiguous(memory_format=torch.channels_last)
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=not args.fp32):
                loss = vae_loss(ae, x)[0] * (1 - n_world / args.batch) if n_world < args.batch else 0
                if n_world:
                    pick = torch.randint(0, world["train"][0].shape[0], (n_world,), generator=gen)
                    zw, xw = (t[pick].to(args.device) for t in world["train"])
                    loss = loss + world_latent_loss(ae, zw, to_unit(xw), args.detail_weight) * (n_world / args.batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.5f}")
            due = step % args.save_every == 0 or step == args.steps
            if due or stop.requested:
                save_training_state(state_path, step, gen, clock.runs(step), model=ae, opt=opt, sched=sched)
            if due:
                bar.write(f"step {step}: {evaluate()}")
    bar.close()
    if step < args.steps:  # stopped by a signal: the state is saved at this step
        print(f"stopped at step {step} of {args.steps}; the state is saved: run the same command again to resume")
        raise SystemExit(STOPPED)
    val_psnr, val_sharpness = held_out_scores(ae, val, args.device, sharpness=True)
    world_record = {}
    if world:
        after = world_scores()
        world_record = {"world_latents": args.world_latents, "world_share": args.world_share,
                        "detail_weight": args.detail_weight,
                        "held_out_world_psnr_db": after[0], "held_out_world_sharpness_ratio": after[1],
                        "held_out_world_psnr_db_before": world_before[0],
                        "held_out_world_sharpness_ratio_before": world_before[1]}
        print("the world's held-out predictions through the decoder: {:.2f} dB, sharpness ratio {:.2f} "
              "(before: {:.2f} dB, {:.2f})".format(*after, *world_before))
    ae.save_pretrained(str(out / "final"))
    (out / "final" / "metrics.json").write_text(json.dumps({
        "held_out_psnr_db": val_psnr, "held_out_sharpness_ratio": val_sharpness, "steps": args.steps, "train_frames": int(train.shape[0]),
        **({"init": args.init, "decoder_only": args.decoder_only, "lr": args.lr, "base": base_metrics(args.init)}
           if args.init else {}), **world_record,
        **clock.record(args.steps)}, indent=2))
    print(f"held-out reconstruction PSNR {val_psnr:.2f} dB -> {out / 'final'}")


if __name__ == "__main__":
    main()
