"""FPS of the interactive front end with the overlay on and off, measured side by side.

    python -m scripts.bench_play [--frames 200]

Runs ``python -m inference.game_cv --max-frames N`` twice (overlay on, then off) in a real
window: on $DISPLAY if set, else on a private Xvfb it starts (Debian package xvfb).
Prints the machine, torch version and each run's total and pipeline FPS.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import torch

from scripts.common import machine


def private_display() -> tuple[subprocess.Popen, str]:
    """An Xvfb on a free display; returns once it accepts clients (-displayfd writes its number
    then: a fixed display and a fixed sleep could leave the game without a server under load)."""
    read_fd, write_fd = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write_fd), "-screen", "0", "800x600x24", "-nolisten", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_fd,))
    os.close(write_fd)
    with os.fdopen(read_fd) as ready:
        number = ready.readline().strip()
    if not number.isdigit():
        xvfb.kill()
        raise SystemExit(f"error: Xvfb did not start (exit code {xvfb.poll()}); check that it runs on this machine")
    return xvfb, f":{number}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--scale", type=int, default=4)
    args = p.parse_args(argv)
    if args.frames < 1 or args.scale < 1:
        raise SystemExit(f"error: --frames {args.frames} --scale {args.scale}: both must be 1 or more")
    env = {k: v for k, v in os.environ.items() if k != "SDL_VIDEODRIVER"}
    xvfb = None
    if not env.get("DISPLAY"):
        if not shutil.which("Xvfb"):
            raise SystemExit("error: no $DISPLAY and no Xvfb; install the Debian package xvfb or run on a desktop")
        xvfb, env["DISPLAY"] = private_display()
    print(f"command: python -m scripts.bench_play {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__}; machine: {machine()}; display {env['DISPLAY']}")
    try:
        for overlay in (True, False):
            cmd = [sys.executable, "-m", "inference.game_cv", "--max-frames", str(args.frames), "--scale",
                   str(args.scale)] + ([] if overlay else ["--no-overlay"])
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((x for x in r.stdout.splitlines() if x.startswith("played")), None)
            if r.returncode != 0 or line is None:
                raise SystemExit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
            total, pipe = re.search(r"total ([\d.]+) FPS, pipeline ([\d.]+) FPS", line).groups()
            print(f"overlay {'on ' if overlay else 'off'}: total {total} FPS, pipeline {pipe} FPS ({args.frames} frames)")
    finally:
        if xvfb is not None:
            xvfb.terminate()


if __name__ == "__main__":
    main()
