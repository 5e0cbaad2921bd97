"""Torch's CPU threads follow the cores other processes leave free.

OpenMP threads spin while they wait for work. On a machine whose cores another busy process
also uses, a thread per core spins against the neighbour, and each of a frame's thousands of
small parallel regions waits for a thread the OS has descheduled: the frame rate collapses
(``python -m scripts.bench_shared_cores``, docs/results.md). OpenMP's passive wait policy avoids
the collapse but slows every frame on free cores.
So, when the thread count is not set by hand, ``CoreBudget`` measures (from ``/proc/stat``) how
much CPU time other processes (not this one's own workers) took since the last look, and gives torch the cores left, at
least one, re-checked about once a second from the thread that runs the model.
"""
from __future__ import annotations

import os
import time

def same_numbers_at_any_thread_count() -> None:
    """Before torch loads: MKL's strict reproducibility mode, so a float32 matmul gives the same
    bits whatever the thread count (by default MKL splits small matmuls' sums by thread, and the
    thread budget, or tensor-parallel ranks sharing the cores, would change the frames at the last
    bit; measured here at about 3% of a 64x1024x256 matmul's time). bf16 matmuls are already so."""
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def system_busy_ticks() -> int | None:
    """CPU ticks spent busy by all processes since boot (None where /proc is absent)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def own_ticks() -> int | None:
    """CPU ticks this process and its descendants spent (all threads; compile workers included):
    utime + stime + the reaped children's cutime + cstime of each process in the tree."""
    me = os.getpid()
    try:
        stats = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue  # exited meanwhile
                stats[int(entry.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))  # ppid, ticks
    except OSError:
        return None
    tree, frontier = {me}, [me]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    return sum(stats[pid][1] for pid in tree if pid in stats)


FREE_BELOW = 0.3  # the share of a core other processes may use while it still counts as free (idle noise)


def cpu_reading(clock=time.monotonic) -> tuple:
    """(clock, every process's busy ticks, this process tree's ticks), for ``others_cores``."""
    return clock(), system_busy_ticks(), own_ticks()


def others_cores(before: tuple, after: tuple) -> float | None:
    """Cores' worth of CPU time other processes took between two ``cpu_reading``s (None where
    /proc is absent)."""
    (t0, busy0, own0), (t1, busy1, own1) = before, after
    if None in (busy0, own0, busy1, own1):
        return None
    return max(0.0, ((busy1 - busy0) - (own1 - own0)) / TICKS / (t1 - t0))


class CoreBudget:
    """``cores``: what torch may use when the machine is free; ``adaptive`` False keeps it fixed
    (threads chosen by hand). ``check()`` between frames; ``limited`` says whether the last
    check gave torch fewer threads than ``cores``."""

    def __init__(self, cores: int, adaptive: bool = True, interval_s: float = 1.0, probe=None, clock=time.monotonic,
                 free_below: float = FREE_BELOW):
        """``free_below``: the share of a core other processes may use while it still counts as
        free (idle noise, or a server's own players' pages beside it)."""
        self.cores, self.interval_s, self.clock, self.free_below = max(1, cores), interval_s, clock, free_below
        self.probe = probe or (lambda: (system_busy_ticks(), own_ticks()))
        self.adaptive = adaptive and self.probe()[0] is not None
        self.threads = self.cores
        self.others = 0.0  # cores' worth of CPU time other processes took over the last interval
        self.checks = self.limited_checks = 0
        self._last = (self.clock(), *self.probe())

    @property
    def limited(self) -> bool:
        return self.threads < self.cores

    def check(self) -> int:
        """Re-measure if an interval has passed and set torch's thread count; returns it."""
        if not self.adaptive:
            return self.threads
        now = self.clock()
        if now - self._last[0] < self.interval_s:
            return self.threads
        reading = (now, *self.probe())
        self.others, self._last = others_cores(self._last, reading), reading
        # a core counts as free while others use at most free_below of it: idle noise keeps every core
        threads = max(1, min(self.cores, int(self.cores - self.others + self.free_below)))
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
        self.checks += 1
        self.limited_checks += self.limited
        return threads

    def describe(self) -> str:
        """A note for the console, or "" while the machine has been free."""
        if not self.limited_checks:
            return ""
        return (f"other processes were busy on this machine's {self.cores} cores: torch ran on {self.threads} "
                f"thread(s) at the last check, fewer than {self.cores} in {self.limited_checks} of {self.checks} "
                "checks (frame rates are limited by the busy machine)")
