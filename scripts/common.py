"""What the benchmark, A/B and check scripts share: the machine's name, the KV presets and the
shipped world's depth. Scripts import this module, never each other."""
from __future__ import annotations

import gc
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

from inference.cores import same_numbers_at_any_thread_count
from inference.heap import keep_freed_memory

same_numbers_at_any_thread_count()  # as the apps run, before torch's first matmul
HEAP_KEPT = keep_freed_memory()  # as the apps run (False where the environment tunes malloc)
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def minor_faults() -> int:
    """Minor page faults this process has taken (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
PRESETS = REPO / "configs" / "kv_presets.yaml"
SHIPPED = REPO / "checkpoints" / "maze-world"


def machine() -> str:
    """The CPU model (and GPU, if any) and the thread count, for benchmark headers."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {torch.get_num_threads()} threads{gpu}"


def optional(value, spec: str) -> str:
    """``value`` formatted by ``spec``, or "-" where nothing was measured (None)."""
    return "-" if value is None else format(value, spec)


def synchronizer(device: str):
    """What waits for ``device``'s queued work before a clock is read (a CPU has none queued)."""
    return torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)


def require_at_least(*checks: tuple[str, int, int]):
    """Exit with a one-line error at the first (flag, value, least) whose value is below least."""
    for flag, value, least in checks:
        if value < least:
            raise SystemExit(f"error: {flag} {value} is below {least}; use {least} or more")


def load_presets() -> dict[str, dict[str, str]]:
    """configs/kv_presets.yaml: preset name -> OWL_* flags (values as strings)."""
    from omegaconf import OmegaConf

    return {name: {k: str(v) for k, v in (flags or {}).items()}
            for name, flags in OmegaConf.to_container(OmegaConf.load(PRESETS)).items()}


def world_rows(modes: dict, checkpoint, frames: int, device: str, compiled: bool = False, warmup: int = 4) -> list[dict]:
    """Each mode (name -> OWL_* flags) on the shipped world (real pipeline, denoise + decode,
    walk_turn actions): FPS, median ms, KV bytes, and the torch.compile graphs made after the
    warm-up frames (0: no recompiles in steady state)."""
    from torch._dynamo.utils import counters

    from inference.actions import load_actions
    from inference.causvid_pipeline import CausvidPipeline

    rows = []
    actions = load_actions("walk_turn", frames + warmup)
    for name, env in modes.items():
        settings = path_settings({}, {**env, "OWL_DEVICE": device, "OWL_COMPILE": "1" if compiled else "0"})
        pipe = CausvidPipeline.from_checkpoint(checkpoint, settings=settings, verbose=False)
        times, graphs = [], 0
        for i in range(frames + warmup):
            if i == warmup:
                graphs = counters["stats"]["unique_graphs"]
            mouse, buttons = actions[i]
            _, seconds = pipe(torch.tensor(mouse), torch.tensor(buttons, dtype=torch.float32))
            if i >= warmup:
                times.append(seconds)
        rows.append({"mode": name, "compiled": compiled, "fps": len(times) / sum(times),
                     "median_ms": statistics.median(times) * 1000, "kv_mib": pipe.kv_bytes / 2**20,
                     "recompiles": counters["stats"]["unique_graphs"] - graphs,
                     "flags": " ".join(f"{k}={v}" for k, v in env.items()) or "(defaults)"})
        r = rows[-1]  # as it is measured, so a run cut short still shows its rows
        print(f"  measured {name:<24} {'compiled' if compiled else 'eager':<8} {r['fps']:7.2f} FPS "
              f"{r['median_ms']:8.1f} ms  {r['kv_mib']:7.2f} MiB  recompiles {r['recompiles']}", flush=True)
        del pipe
        gc.collect()
    return rows


# What a user's shell would not set: the thread choices are the command's own.
THREAD_FLAGS = ("OWL_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def path_settings(inference, flags: dict):
    """A benchmark path's settings: ``inference`` under the path's own OWL_* ``flags`` and this
    shell's OWL_THREADS (the thread count asked for must hold for every path), threads applied."""
    from inference.flags import resolve_settings, with_threads

    threads = {"OWL_THREADS": os.environ["OWL_THREADS"]} if os.environ.get("OWL_THREADS", "").strip() else {}
    return with_threads(resolve_settings(inference, {**threads, **flags}))


def headless_fps(frames: int, out: str, env: dict) -> float:
    """The README's headless command's pipeline FPS after the first frame, with ``env`` on top of
    this shell's (less its thread choices)."""
    cmd = [sys.executable, "-m", "inference.game_cv", "--headless", "--frames", str(frames), "--out", out]
    base = {k: v for k, v in os.environ.items() if k not in THREAD_FLAGS}
    r = subprocess.run(cmd, capture_output=True, text=True, env={**base, **env})
    m = re.search(r"pipeline ([\d.]+) FPS \(([\d.]+) after", r.stdout)
    if r.returncode or m is None:
        raise SystemExit(f"error: {' '.join(cmd)} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-800:]}")
    return float(m.group(2))
