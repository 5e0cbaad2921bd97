"""The frame call and the decoder compiled in a child process while frames run eagerly, and kept
for the next start.

torch.compile traces with FX, and FX's tracer replaces ``torch.nn.Module.__call__`` for the
whole process while it traces: a model called on another thread meanwhile runs through the
tracer and fails ("module is not installed as a submodule") or is traced into the wrong graph.
So the compile runs in a spawned child process, over the same modules (their weights shared in
memory, not copied), at a lower CPU priority, and saves each graph with torch's ahead-of-time
compile (``aot_compile``) into the compile cache folder, under a key of everything the graph
depends on. The app's process only loads saved graphs (no tracing there): a later start with
the same key loads them at once, without a compile. A graph runs wherever its guards hold, and
the call runs eagerly elsewhere. A kept graph keeps only the guards on its input tensors and the
global state (``tensor_guards``): everything else it was traced with is in its key.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..ring import RingCache
from ..vae import decode_sample


def frame_call(core, x, t, mouse, buttons, kv_cache):
    """A generated frame's model call over the ring: what compiles into one graph."""
    return core(x, t, mouse, buttons, kv_cache=kv_cache)


def tensor_guards(entries) -> list[bool]:
    """Which of a graph's guards it keeps: those on the tensors it is called with (the inputs and
    the cache's buffers: shapes, strides, dtype, device) and on global state (grad mode and the
    like). The rest hold for every call with the graph's key (CompileJob.path): the modules' and
    the cache's Python attributes come from the code, the settings and the cache plan, and the
    weights are read at each call. Checking all of them cost a host-bound frame call several
    per cent of its time."""
    return [e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
            or (e.guard_type == "TENSOR_MATCH" and not isinstance(e.value, torch.nn.Parameter)) for e in entries]


@dataclass
class CompileJob:
    """What to compile: the frame call for each batch size of ``rows`` at each CPU thread count
    of ``counts`` (a CPU graph is built for one count), and the decoder for each batch size at
    the first count."""
    core: torch.nn.Module
    autoencoder: torch.nn.Module | None
    cache_cfg: object
    plans: list
    device: str
    dtype: torch.dtype
    rows: tuple[int, ...]
    counts: tuple[int, ...]
    options: dict
    ring_attention: str  # the frame call's ring kernel (Settings.ring_attention): traced into its graph
    # the app process's Inductor settings (save_config_portable): the compile process builds with
    # them, not with its defaults, and both name the graphs by them
    inductor_config: dict

    def items(self) -> list[tuple[str, int, int]]:
        """(kind, batch size, threads) of each graph, in the order they are built."""
        out = []
        for threads in self.counts:
            for n in self.rows:
                out.append(("frame", n, threads))
                if self.autoencoder is not None and threads == self.counts[0]:
                    out.append(("decode", n, threads))
        return out

    def path(self, kind: str, n: int, threads: int) -> Path:
        """Where the graph is kept: named by a digest of what it depends on (the code of this
        package, the module's class and library, torch and Inductor's settings, the CPU's vector
        instructions, the shapes and settings), not the weights, which it takes as inputs."""
        from importlib.metadata import version

        from torch._inductor.cpu_vec_isa import pick_vec_isa

        digest = hashlib.sha256(package_digest())
        module = self.core if kind == "frame" else self.autoencoder
        shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.state_dict().items()]
        library = type(module).__module__.split(".")[0]
        # the cache's shape and plan and the ring's kernel are the frame call's alone: one decoder
        # graph serves every KV mode. The decoder's own settings (a diffusers config: activations,
        # group counts, upsampling) shape its graph without showing in its weights' shapes.
        cfg = self.cache_cfg
        built_for = ((cfg, self.plans, self.ring_attention) if kind == "frame"
                     else (sorted(dict(getattr(module, "config", {})).items()), cfg.channels, cfg.sample_size))
        digest.update(repr((torch.__version__, sorted(self.inductor_config.items()), str(pick_vec_isa()),
                            type(module).__module__, type(module).__qualname__,
                            version(library) if library != "owl_wms" else "", self.device, str(self.dtype),
                            *built_for, self.options, kind, n, threads, shapes)).encode())
        return graph_folder() / f"{kind}-{digest.hexdigest()[:32]}.bin"


@functools.cache
def package_digest() -> bytes:
    """A digest of this package's code, which a graph's trace took in."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.digest()


def graph_folder() -> Path:
    """Where kept graphs live: beside Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "owl-graphs"


def prune_graphs(folder: Path, unused_days: float = 30.0) -> int:
    """Delete the files of ``folder`` no start has used for ``unused_days``: kept graphs (each
    change of the code or the settings names new ones) and what a save cut short left; returns
    how many."""
    cutoff, removed = time.time() - unused_days * 86400, 0
    for path in folder.glob("*") if folder.is_dir() else ():
        try:
            if path.is_file() and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except OSError:  # another start removed or is writing it
            pass
    return removed


class Precompiled:
    """A graph loaded from its file, called with its module: None where its guards do not hold
    for the inputs (then the caller runs eagerly)."""

    def __init__(self, path: Path, module: torch.nn.Module):
        with open(path, "rb") as f:
            self.fn = torch.compiler.load_compiled_function(f, external_data={"module": module})
        self.fn.disable_guard_check()  # checked here, so a miss falls back instead of raising
        self.module = module

    def __call__(self, *args, **kwargs):
        if not self.fn.guard_check(self.module, *args, **kwargs):
            return None
        return self.fn(self.module, *args, **kwargs)


class DecodeByBatch:
    """The decoder's compiled graph for each batch size it was compiled for; eager for others."""

    def __init__(self, autoencoder: torch.nn.Module, graphs: dict[int, Precompiled]):
        self.autoencoder, self.graphs = autoencoder, graphs

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        graph = self.graphs.get(latents.shape[0])
        out = graph(latents) if graph is not None else None
        return decode_sample(self.autoencoder, latents) if out is None else out


def reason(exc: BaseException) -> str:
    """An exception in one line for the log: its type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


COMPILE_PROCESS = "owl-compile"
_ENDING = threading.Event()  # the app is exiting: no compile process starts any more
_STARTING = threading.Lock()  # held while a compile process starts


def end_compile_processes() -> None:
    """An app that exits ends its compile process first (quietly: by SIGTERM) and starts no other.
    A start under way on the loader thread finishes first: cut short, it would leave a child that
    prints spawn's unpickling traceback after the app has gone."""
    import multiprocessing

    _ENDING.set()
    if _STARTING.acquire(timeout=10):  # (a start writes a few bytes down a pipe: milliseconds)
        _STARTING.release()
    for child in multiprocessing.active_children():
        if child.name == COMPILE_PROCESS:
            end_with_its_compilers(child)
            child.join(2)


def end_with_its_compilers(process) -> None:
    """SIGTERM to the compile process and the C++ compilers it runs: it leads its own process
    group (become_compile_process), which they are in; before it does, to itself alone."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        process.terminate()


def _exit_with_parent() -> None:
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:  # the app ended without ending us (os._exit, a kill)
            os._exit(0)


def become_compile_process() -> None:
    """The compile process's first steps. Ctrl-C ends the app, which ends it (and the C++
    compilers it started: they are in its process group); it ends itself when the app is gone.
    Progress bars (torch's FX tracer draws one) lock with a thread lock instead of tqdm's default,
    a named semaphore, which a compile process the app terminates would leave behind (Python's
    resource tracker then warns of it when the app exits)."""
    from tqdm import tqdm

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    tqdm.set_lock(threading.RLock())
    os.setpgrp()  # a group of its own, its compilers' too: the app ends them all at once


@torch.no_grad()
def compile_graphs(jobs, conn) -> None:
    """The child: receives the job and its ``items`` on ``jobs``, compiles and saves each graph,
    telling the parent on ``conn`` as each is written."""
    from torch._inductor import config as inductor

    become_compile_process()
    try:
        job, items = jobs.recv()
    except (EOFError, OSError, pickle.UnpicklingError):  # the app ended while it sent the job: nothing to do
        return
    finally:
        jobs.close()
    inductor.load_config(job.inductor_config)
    cfg = job.cache_cfg
    try:
        for kind, n, threads in items:
            torch.set_num_threads(threads)
            path = job.path(kind, n, threads)
            path.parent.mkdir(parents=True, exist_ok=True)
            if kind == "frame":
                scratch = RingCache(cfg, job.plans, n, job.device, job.dtype)
                x = torch.zeros(n, 1, cfg.channels, cfg.sample_size, cfg.sample_size, device=job.device, dtype=job.dtype)
                module, fn = job.core, frame_call
                example = ((job.core, x, x.new_ones(n, 1), x.new_zeros(n, 1, 2), x.new_zeros(n, 1, cfg.n_buttons)),
                           {"kv_cache": scratch})
            else:
                p = next(job.autoencoder.parameters())
                latents = torch.zeros(n, cfg.channels, cfg.sample_size, cfg.sample_size, device=p.device, dtype=p.dtype)
                module, fn, example = job.autoencoder, decode_sample, ((job.autoencoder, latents), {})
            options = {**job.options, "guard_filter_fn": tensor_guards}
            graph = torch.compile(fn, fullgraph=True, dynamic=False, options=options).aot_compile(example)
            graph.save_compiled_function(str(path), external_data={"module": module})  # written atomically
            if not tell(conn, ("built", kind, n, threads)):
                return
    except Exception as exc:  # noqa: BLE001 - the app's frames go on eagerly; it says why
        tell(conn, ("error", reason(exc), 0, 0))
    conn.close()


def start_without_ctrl_c(process) -> None:
    """Starts ``process`` with Ctrl-C blocked (a signal mask outlives exec): the terminal's Ctrl-C
    reaches the whole process group, and the app, not a child importing torch, handles it. Python's
    resource tracker starts first: starting it unblocks Ctrl-C in the calling thread, which would
    undo the block (multiprocessing.resource_tracker.ensure_running)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def tell(conn, message) -> bool:
    """Sends the app a message; False when the app has ended (nobody is left to tell)."""
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, EOFError):
        return False


class BackgroundCompile:
    """Loads the job's graphs on a thread of the app's process once the first frame is made:
    those kept by an earlier start at once, the others as a child process builds them.
    ``on_graph(rows, threads, graph)`` installs a frame graph, ``on_ready(decode)`` runs once
    the first thread count's graphs (and the decoder's) are in, ``log`` says what happened."""

    def __init__(self, job: CompileJob, on_graph, on_ready, log=print):
        self.job, self.on_graph, self.on_ready, self.log = job, on_graph, on_ready, log
        self.first_frame = threading.Event()  # frames_began() sets it
        self.done = threading.Event()  # every graph is in (or the compile gave up)
        self.process = None
        self.started = time.perf_counter()
        self.decodes: dict[int, Precompiled] = {}
        self.loaded: set[tuple[str, int, int]] = set()
        self.thread = threading.Thread(target=self._run, daemon=True, name="owl-compile-loader")
        self.thread.start()

    def frames_began(self) -> None:
        """The app has its first frame: loading and compiling may start (else they start after 30 s)."""
        self.first_frame.set()

    def _load(self, item: tuple[str, int, int]) -> bool:
        kind, n, threads = item
        path = self.job.path(*item)
        if not path.exists():
            return False
        try:
            graph = Precompiled(path, self.job.core if kind == "frame" else self.job.autoencoder)
        except Exception:  # noqa: BLE001 - a kept graph from another build: build it again
            path.unlink(missing_ok=True)
            return False
        os.utime(path)  # last used now: prune_graphs keeps it
        if kind == "frame":
            self.on_graph(n, threads, graph)
        else:
            self.decodes[n] = graph
        self.loaded.add(item)
        first = [i for i in self.job.items() if i[2] == self.job.counts[0]]
        if item[2] == self.job.counts[0] and all(i in self.loaded for i in first):
            job = self.job
            self.on_ready(DecodeByBatch(job.autoencoder, self.decodes) if job.autoencoder is not None else None)
            rest = job.counts[1:]
            self.log(f"[owl] compile: the compiled frame call took over after {time.perf_counter() - self.started:.0f} s "
                     f"(batch sizes {', '.join(map(str, job.rows))}; {threads} threads"
                     + (f"; {', '.join(map(str, rest))} threads follow)" if rest else ")"))
        return True

    def _run(self) -> None:
        self.first_frame.wait(30)  # the first frame first: it comes as fast as without a compile
        try:
            missing = [item for item in self.job.items() if not self._load(item)]
            if missing:
                self._build(missing)
        except Exception as exc:  # noqa: BLE001 - frames go on eagerly; say why once
            self.log(f"[owl] compile: the background compile failed ({reason(exc)}); {self.in_use()}")
        finally:
            self.done.set()
            prune_graphs(graph_folder())

    def _build(self, items) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        with _STARTING:  # an exiting app waits for the start (end_compile_processes)
            if _ENDING.is_set():  # the app is exiting
                return
            conn, child_conn = ctx.Pipe(duplex=False)
            child_jobs, jobs = ctx.Pipe(duplex=False)
            # The job goes through a pipe of its own once the child runs, not with the start: the
            # start then writes a few bytes, and an app that exits while the job is on its way
            # leaves a child that ends quietly (a start cut short leaves one that prints spawn's
            # unpickling traceback).
            self.process = ctx.Process(target=compile_graphs, args=(child_jobs, child_conn), daemon=True,
                                       name=COMPILE_PROCESS)
            start_without_ctrl_c(self.process)
        child_conn.close()
        child_jobs.close()
        try:
            try:  # the frames being played come first (never below the app's own priority)
                os.setpriority(os.PRIO_PROCESS, self.process.pid, max(10, os.getpriority(os.PRIO_PROCESS, 0)))
            except (OSError, AttributeError):
                pass
            # the modules' weights move to shared memory as they are sent: the child reads, not copies, them
            tell(jobs, (self.job, items))  # a child that ended before reading it says so below, by EOF
            jobs.close()
            while True:
                try:
                    what, kind, n, threads = conn.recv()
                except EOFError:
                    self.process.join(5)
                    if self.process.exitcode and not _ENDING.is_set():  # (the app ending ends it: no news)
                        self.log(f"[owl] compile: the compile process ended with exit code {self.process.exitcode}; "
                                 f"{self.in_use()}")
                    return
                if what == "error":
                    self.log(f"[owl] compile: stopped ({kind}); {self.in_use()}")
                elif not self._load((kind, n, threads)):
                    self.log(f"[owl] compile: the {kind} graph built for batch size {n} did not load; {self.in_use()}")
        finally:
            if self.process.is_alive():  # left early: nobody would read what it builds
                end_with_its_compilers(self.process)
            conn.close()

    def in_use(self) -> str:
        return (f"the {len(self.loaded)} graphs in so far stay in use, the other calls eager" if self.loaded
                else "frames stay eager")

    def progress(self) -> str:
        """What is in so far, for a status line: "2/3 graphs, 41 s"."""
        return f"{len(self.loaded)}/{len(self.job.items())} graphs, {time.perf_counter() - self.started:.0f} s"

    def wait(self, timeout: float | None = None) -> bool:
        """True once every graph is in (or the compile gave up)."""
        return self.done.wait(timeout)
