"""Bit-identical frames across a change: render a 32-frame headless rollout of the shipped world
for the default settings, every preset of configs/kv_presets.yaml and a 2-rank tensor-parallel
run, save the uint8 frames, and later compare a new rendering with them frame for frame.

    python -m scripts.check_frames save before/        # on the old code
    python -m scripts.check_frames compare before/     # on the new code: every case must be identical

Every case runs the real command line (python -m inference.game_cv --headless ... --save-frames),
so the comparison covers settings, loading, the engine, the cache and decoding.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from scripts.common import PRESETS, load_presets

FRAMES = 32


def cases() -> dict[str, tuple[dict, int]]:
    """name -> (OWL_* flags, tensor-parallel ranks)."""
    out = {"default": ({}, 1)}
    out.update({name: (flags, 1) for name, flags in load_presets().items() if name != "baseline"})
    out["tp2"] = ({}, 2)
    return out


def render(name: str, flags: dict, ranks: int, folder: Path, dtype: str | None = None) -> Path:
    frames = folder / f"{name}.npy"
    cli = ["--headless", "--frames", str(FRAMES), "--out", str(folder / f"{name}.mp4"), "--save-frames", str(frames)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m",
               "inference.game_cv", *cli, "--tp", str(ranks)]
    else:
        cmd = [sys.executable, "-m", "inference.game_cv", *cli]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWL_")}
    env.update(flags, OWL_DEVICE="cpu", **({"OWL_DTYPE": dtype} if dtype else {}))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not frames.is_file():
        raise SystemExit(f"error: case {name!r} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return frames


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.check_frames", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("save", "compare"))
    p.add_argument("folder", help="where the reference frames are saved / read")
    p.add_argument("--only", nargs="*", default=None, help=f"case names (default: all; presets from {PRESETS.name})")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="every case in this dtype (default: auto)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    todo = {k: v for k, v in cases().items() if args.only is None or k in args.only}
    if args.mode == "save":
        folder.mkdir(parents=True, exist_ok=True)
        for name, (flags, ranks) in todo.items():
            print(f"{name}: saved {render(name, flags, ranks, folder, args.dtype)}", flush=True)
        return 0
    if not folder.is_dir():
        raise SystemExit(f"error: {folder} holds no reference frames; run: python -m scripts.check_frames save {folder}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (flags, ranks) in todo.items():
            ref = folder / f"{name}.npy"
            if not ref.is_file():
                print(f"{name}: no reference frames ({ref})")
                failed += 1
                continue
            a, b = np.load(ref), np.load(render(name, flags, ranks, Path(tmp), args.dtype))
            same = a.shape == b.shape and np.array_equal(a, b)
            diff = "" if same or a.shape != b.shape else f", max |diff| {np.abs(a.astype(int) - b).max()}"
            print(f"{name}: {'identical' if same else 'DIFFERENT'} ({len(b)} frames {b.shape[1:]}{diff})", flush=True)
            failed += not same
    print(f"{len(todo) - failed} of {len(todo)} cases bit-identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
