"""What the benchmark, A/B and check scripts share: the machine's name, the KV presets, the
README's headless command's rate, and a server with websocket players on loopback. Scripts
import this module, never each other."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

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


# CPU features that change which dtype is fast: bf16 matmuls run in hardware only with these
FAST_BF16_FLAGS = (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_bf16"))


def machine() -> str:
    """The CPU model with the vector extensions torch's kernels use (and GPU, if any) and the
    thread count, for benchmark headers: e.g. "AMD EPYC (AVX512, AVX512-BF16), 2 threads"."""
    cpu, flags, named = platform.processor() or platform.machine(), set(), False
    try:
        for line in open("/proc/cpuinfo"):  # the first processor's lines are every core's
            if line.startswith("model name"):
                cpu, named = line.split(":", 1)[1].strip(), True
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            if named and flags:
                break
    except OSError:
        pass
    features = [torch.backends.cpu.get_cpu_capability()] + [name for name, flag in FAST_BF16_FLAGS if flag in flags]
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({', '.join(features)}), {torch.get_num_threads()} threads{gpu}"


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
    walk_turn actions): FPS, median ms, KV bytes, the warm-up's seconds and torch.compile graphs
    (loading, the history's prefill and the first frames: a compiled mode's compiles happen
    there), and the graphs made after the warm-up (0: no recompiles in steady state)."""
    from torch._dynamo.utils import counters

    from inference.actions import load_actions
    from inference.causvid_pipeline import CausvidPipeline

    rows = []
    actions = load_actions("walk_turn", frames + warmup)
    for name, env in modes.items():
        settings = path_settings({}, {**env, "OWL_DEVICE": device, "OWL_COMPILE": "1" if compiled else "0"})
        start, began = counters["stats"]["unique_graphs"], time.perf_counter()
        pipe = CausvidPipeline.from_checkpoint(checkpoint, settings=settings, verbose=False)
        times = []
        graphs, warmup_s = start, 0.0
        for i in range(frames + warmup):
            if i == warmup:
                graphs, warmup_s = counters["stats"]["unique_graphs"], time.perf_counter() - began
            mouse, buttons = actions[i]
            _, seconds = pipe(torch.tensor(mouse), torch.tensor(buttons, dtype=torch.float32))
            if i >= warmup:
                times.append(seconds)
        rows.append({"mode": name, "compiled": compiled, "fps": len(times) / sum(times),
                     "median_ms": statistics.median(times) * 1000, "kv_mib": pipe.kv_bytes / 2**20,
                     "warmup_s": warmup_s, "warmup_graphs": graphs - start,
                     "recompiles": counters["stats"]["unique_graphs"] - graphs,
                     "flags": " ".join(f"{k}={v}" for k, v in env.items()) or "(defaults)"})
        r = rows[-1]  # as it is measured, so a run cut short still shows its rows
        print(f"  measured {name:<24} {'compiled' if compiled else 'eager':<8} {r['fps']:7.2f} FPS "
              f"{r['median_ms']:8.1f} ms  {r['kv_mib']:7.2f} MiB  warm-up {r['warmup_s']:.1f} s, "
              f"{r['warmup_graphs']} graphs  recompiles {r['recompiles']}", flush=True)
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


# -- a server and its players on loopback (bench_serve, bench_shared_cores) ------------------------
SEND_HZ = 20.0  # controls messages a second from each player


class ServerProcess:
    def __init__(self, args: list[str], env: dict, log: str | None = None, launch: list[str] | None = None,
                 cwd=None):
        """``python -m inference.serve --port 0 ARGS``, its output kept in ``lines`` (and written to
        the file ``log``); ``launch``: what starts the module instead of this python (torchrun)."""
        self.launched = bool(launch)
        self.proc = subprocess.Popen([*(launch or [sys.executable]), "-m", "inference.serve", "--port", "0", *args],
                                     cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=self.launched)
        self.lines: list[str] = []
        self.log = log
        self.drain = threading.Thread(target=self._drain, daemon=True)
        self.drain.start()
        self.url = None

    def _drain(self):
        with open(self.log or os.devnull, "w") as f:
            for line in self.proc.stdout:
                self.lines.append(line)
                f.write(line)
                f.flush()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 300) -> str:
        """The URL the server printed, once it serves; SystemExit with its output if it stopped or
        took longer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = [m.group(1) for line in list(self.lines) if (m := re.search(r"serving at (http://\S+?)/ ", line))]
            if found:
                self.url = found[0]
                return self.url
            time.sleep(0.05)
        if self.proc.poll() is not None:
            self.drain.join(10)  # all it printed before it stopped
        raise SystemExit("error: a server did not start:\n" + self.output)

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/healthz", timeout=10) as r:
            return json.loads(r.read())

    def wait_empty(self, timeout: float = 60) -> None:
        """Until the last round's players have left (their sessions close as their sockets do)."""
        deadline = time.monotonic() + timeout
        while self.health()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop it with ``sig`` (launched: Ctrl-C to torchrun and its ranks, as a terminal sends
        it; rank 0 stops the others), killed after 40 s; its exit status."""
        if self.proc.poll() is None:
            if self.launched:
                os.killpg(self.proc.pid, signal.SIGINT)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                if self.launched:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.kill()
        return self.proc.wait()


class Round:
    """One round's clock: it starts once every player has had its first frame (joins take
    seconds on a busy machine and are not what a round measures), then `warmup` unmeasured
    seconds, `seconds` measured, and at most `drain` more to hear the last controls answered."""

    def __init__(self, players: int, seconds: float, warmup: float, drain: float = 5.0, join_timeout: float = 300.0):
        self.players, self.seconds, self.warmup, self.drain = players, seconds, warmup, drain
        self.seen: set[int] = set()
        self.join_deadline = time.perf_counter() + join_timeout
        self.start: float | None = None

    def joined(self, player: int) -> None:
        if player not in self.seen:
            self.seen.add(player)
            if len(self.seen) == self.players and self.start is None:
                self.start = time.perf_counter()

    def _start(self) -> float | None:
        if self.start is None and time.perf_counter() > self.join_deadline:
            self.start = self.join_deadline
        return self.start

    def end(self) -> float:
        start = self._start()
        return float("inf") if start is None else start + self.warmup + self.seconds

    def over(self) -> bool:
        return time.perf_counter() >= self.end()

    def drained(self) -> bool:
        return time.perf_counter() >= self.end() + self.drain

    def wait(self) -> float:
        """How long to wait for the next message before looking at the clock again."""
        now, end = time.perf_counter(), self.end()
        return max(0.01, min(0.5, (end if now < end else end + self.drain) - now))

    def measures(self, t: float, until_end: bool = True) -> bool:
        start = self._start()
        return start is not None and start + self.warmup <= t and (not until_end or t < self.end())


async def player(url: str, seed: int, clock: Round) -> dict:
    import websockets

    from inference.web.protocol import read_frame

    arrivals, latencies, sent = [], [], {}
    async with websockets.connect(url.replace("http://", "ws://") + "/ws", max_size=2**22) as ws:
        await ws.send(json.dumps({"type": "hello", "version": 1, "seed": seed}))

        async def send():
            seq, rng = 0, np.random.default_rng(seed)
            while not clock.over():
                seq += 1
                buttons = [int(b) for b in rng.random(11) < 0.2]
                sent[seq] = time.perf_counter()
                await ws.send(json.dumps({"type": "controls", "mouse": [float(rng.normal() * 3), 0.0],
                                          "buttons": buttons, "seq": seq}))
                await asyncio.sleep(1 / SEND_HZ)

        sender = asyncio.create_task(send())
        try:
            # Past the round's end, read on until the controls sent in it have been used (at most
            # `drain` seconds): stopping at the end would drop the slowest answers and bias the latency low.
            while not clock.over() or (sent and not clock.drained()):
                try:
                    message = await asyncio.wait_for(ws.recv(), clock.wait())
                except asyncio.TimeoutError:
                    continue
                except websockets.ConnectionClosed as closed:  # (full, say): the round reports no frames
                    print(f"warning: player {seed}'s socket closed: {closed}", flush=True)
                    break
                if not isinstance(message, bytes):
                    continue
                now = time.perf_counter()
                clock.joined(seed)
                _, used, _, _ = read_frame(message)
                if clock.measures(now):
                    arrivals.append(now)
                if used is not None:
                    for s in [s for s in sent if s <= used]:
                        if clock.measures(sent[s], until_end=False):
                            latencies.append(now - sent[s])
                        del sent[s]
        finally:
            clock.joined(seed)  # a player that leaves never holds the others' round back
            sender.cancel()
    return {"arrivals": arrivals, "latencies": latencies}


async def round_of(url: str, n: int, seconds: float, warmup: float) -> list[dict]:
    """n players at once: `warmup` seconds after the last one's first frame, `seconds` measured."""
    clock = Round(n, seconds, warmup)
    return await asyncio.gather(*[player(url, 100 + i, clock) for i in range(n)])


def summary(results: list[dict], seconds: float) -> dict:
    intervals = np.concatenate([np.diff(r["arrivals"]) for r in results if len(r["arrivals"]) > 1] or [[np.nan]])
    latencies = np.concatenate([r["latencies"] for r in results] or [[np.nan]])
    frames = sum(len(r["arrivals"]) for r in results)
    return {"aggregate_fps": frames / seconds, "player_fps_min": min(len(r["arrivals"]) / seconds for r in results),
            "interval_ms_p50": float(np.nanpercentile(intervals, 50) * 1000),
            "interval_ms_p95": float(np.nanpercentile(intervals, 95) * 1000),
            "latency_ms_p50": float(np.nanpercentile(latencies, 50) * 1000),
            "latency_ms_p95": float(np.nanpercentile(latencies, 95) * 1000)}
