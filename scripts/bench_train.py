"""Seconds per world-model training step: eager, ``--compile``, and eager with attention as
one masked SDPA call per layer (the reference for the chunked attention), measured in one run.

    python -m scripts.bench_train [--config configs/maze_world.yaml] [--batch 4] [--steps 10] [--device cuda]

The step is train_world's own (``owl_wms.maze.training.world.train_step``: bf16 autocast,
rectified-flow loss, clipped AdamW, schedule, EMA) on random latents of the config's shape,
so it runs on a fresh clone; as train_world does, the batch is drawn on the host and moved to
``--device``. The variants' steps alternate, so drift in the machine's speed
touches every side of each ratio; the first step (with the compile) is reported apart from
the steady-state medians.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from owl_wms.attention import query_chunk_tokens
from owl_wms.config import load_config
from owl_wms.maze.training.world import sample_times, train_step, world_trainer

from .common import REPO, machine, synchronizer


class Trainer:
    """train_world's model, optimiser and step, on random latents of the config's shape."""

    def __init__(self, world, batch: int, compiled: bool, dense: bool = False, device: str = "cpu"):
        torch.manual_seed(0)
        self.world, self.batch, self.dense, self.device = world, batch, dense, device
        self.model, self.ema, self.opt, self.sched = world_trainer(world.model, 6e-4, 1000, device, compile=compiled)
        self.gen = torch.Generator().manual_seed(0)
        self.sync = synchronizer(device)

    def step(self) -> float:
        m, n, gen, b = self.world.model, self.world.pipeline.window_frames, self.gen, self.batch
        t0 = time.perf_counter()
        x = torch.randn(b, n, m.channels, m.sample_size, m.sample_size, generator=gen)
        mouse, buttons = torch.randn(b, n, 2, generator=gen), (torch.rand(b, n, m.n_buttons, generator=gen) < 0.2)
        t = sample_times(b, n, gen, 0.5, self.world.pipeline.history_alpha, self.world.pipeline.schedule)
        x, mouse, buttons = (a.to(self.device) for a in (x, mouse, buttons.float()))
        with query_chunk_tokens(0) if self.dense else contextlib.nullcontext():
            train_step(self.model, self.ema, self.opt, self.sched, x, mouse, buttons, t, gen, 0.995).item()
        self.sync()
        return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "maze_world.yaml"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="steps per variant; the first 3 are warm-up")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device}: torch sees no CUDA device here; use --device cpu")
    if args.batch < 1:
        raise SystemExit(f"error: --batch {args.batch} trains on nothing; use 1 or more")
    if args.steps < 4:
        raise SystemExit(f"error: --steps {args.steps} leaves no measured step after 3 warm-up steps; use 4 or more")
    world = load_config(args.config)
    print(f"torch {torch.__version__}; machine: {machine()}; device {args.device}; {args.config}, batch {args.batch} x "
          f"{world.pipeline.window_frames} frames")
    variants = {"eager": Trainer(world, args.batch, False, device=args.device),
                "compiled": Trainer(world, args.batch, True, device=args.device),
                "eager, one masked attention call": Trainer(world, args.batch, False, dense=True, device=args.device)}
    first = {name: tr.step() for name, tr in variants.items()}  # the compiled one includes compiling
    for _ in range(2):
        for tr in variants.values():
            tr.step()
    rounds = [{name: tr.step() for name, tr in variants.items()} for _ in range(args.steps - 3)]  # interleaved
    print(f"first step: eager {first['eager']:.1f} s, compiled {first['compiled']:.1f} s (with the compile)")
    print("median s/step: " + ", ".join(f"{name} {statistics.median(r[name] for r in rounds):.3f}"
                                        for name in variants))
    for name in ("compiled", "eager, one masked attention call"):
        print(f"{name} / eager step time (median of interleaved rounds): "
              f"{statistics.median(r[name] / r['eager'] for r in rounds):.3f}")


if __name__ == "__main__":
    main()
