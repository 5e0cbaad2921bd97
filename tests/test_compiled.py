"""A generated frame's model call compiled whole, the model as written over the tensor-state ring
(owl_wms/engine/runner.py, owl_wms/ring.py): the frames of the eager call within float rounding,
the same frames run to run, and no graph break and no recompile across ring wrap-arounds, hard
cuts, recomputes and attention-bias changes."""
import os

import pytest
import torch
from torch._dynamo.utils import counters

from inference.causvid_pipeline import CausvidPipeline
from owl_wms.rope import make_rope
from owl_wms.settings import KVSettings

from .conftest import fp32_settings, random_model, tiny_config, tiny_world


@pytest.fixture(autouse=True)
def compile_or_fail():
    """A graph that stops compiling (dynamo's recompile limit) would run eagerly and make
    "no recompile" hold vacuously: here it fails instead. Each test starts with no compiled
    graphs, so the graphs that earlier tests in the process compiled for their own models do
    not count against the limit of the code objects they share."""
    import torch._dynamo.config

    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


WINDOW = 5  # ring slots of the global layer; the local layers hold 3 (tiny_config's local window)
# A global and a local layer: the graph holds both kinds of ring and compiles in three quarters of the
# time four layers take (each test here compiles its own graph cold).
LAYERS = 2
# Compiled float sums round differently from eager ones; an int8 ring can then store a value one
# code step away (under 1% of the token's largest value).
TOLERANCE = {"int8": 2e-3, "int4": 2e-2}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (run on a GPU machine)"))]


def pipeline(storage: str, compile: bool, dtype=torch.float32, model=None, kv=None, **settings) -> CausvidPipeline:
    cfg = tiny_config(n_layers=LAYERS)
    kv = kv or KVSettings(ring_mode="inplace", fmt_k=storage, fmt_v=storage)
    pipe = CausvidPipeline(model if model is not None else random_model(cfg), None, tiny_world(cfg, WINDOW),
                           fp32_settings(compile=compile, kv=kv, **settings).replace(dtype=dtype), verbose=False)
    count_frame_calls(pipe)
    pipe.prefill(*history(cfg, seed=1))
    return pipe


def count_frame_calls(pipe):
    """Count the runner's calls of the compiled (or eager) frame call in ``pipe.frame_calls``."""
    runner, inner = pipe.runner, pipe.runner.frame_call
    pipe.frame_calls = 0

    def counted(*args, **kwargs):
        pipe.frame_calls += 1
        return inner(*args, **kwargs)

    runner.frame_call = counted


def history(cfg, seed: int, frames: int = WINDOW):
    g = torch.Generator().manual_seed(seed)
    c, s = cfg.channels, cfg.sample_size
    return (torch.randn(frames, c, s, s, generator=g), torch.randn(frames, 2, generator=g),
            (torch.rand(frames, 11, generator=g) > 0.5).float())


def play(pipe, frames: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([pipe.generate(torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float())
                      for _ in range(frames)], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_the_graph_gives_the_eager_frames_within_float_rounding(storage, device):
    """Three wrap-arounds of every ring (15 frames over 5 and 3 slots), then a fresh history. (A
    bf16 ring's graph: test_in_bf16_on_the_cpu_the_graph_is_as_close_to_fp32_as_the_eager_step.)"""
    eager, compiled = pipeline(storage, False, device=device), pipeline(storage, True, device=device)
    assert eager.runner.compiled is None and compiled.runner.compiled == "whole"
    a, b = play(eager, 3 * WINDOW), play(compiled, 3 * WINDOW)
    assert compiled.frame_calls == 2 * 3 * WINDOW  # every generated frame's two calls ran the graph
    assert (a - b).abs().max() <= TOLERANCE[storage]
    for pipe in (eager, compiled):
        pipe.prefill(*history(pipe.cfg, seed=3, frames=2))  # a short history: rings not yet full
    assert (play(eager, 4) - play(compiled, 4)).abs().max() <= TOLERANCE[storage]
    assert torch.equal(eager.cache.written, compiled.cache.written)  # the same writes were committed


# Two graphs cover the options (each graph is a cold compile of its own): keys with per-head
# running-max scales beside values with a percentile's token scales, layers sharing their
# owner's ring; then per-head EMA keys beside smoothed token scales of the values.
@pytest.mark.parametrize("kv", [
    KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="fp8_e4m3", scale_k="head", v_percentile=99.0, share=2),
    KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="int8", scale_k="head", ema=0.9, smooth=0.9),
], ids=["head-max-percentile-share", "head-ema-smooth"])
def test_scales_with_memory_percentiles_and_sharing_compile_whole_to_the_eager_frames(kv):
    """Every in-place mode is one graph: scales that follow each row's last committed scale, a
    percentile's scales, layers reading their owner's ring; over wrap-arounds and a fresh history,
    the frames of the eager call within a quantized cache's rounding, and no recompile."""
    eager, compiled = pipeline("", False, kv=kv), pipeline("", True, kv=kv)
    assert eager.runner.compiled is None and compiled.runner.compiled == "whole"
    graphs = counters["stats"]["unique_graphs"]
    a, b = play(eager, 3 * WINDOW), play(compiled, 3 * WINDOW)
    for pipe in (eager, compiled):
        pipe.hard_cut(*history(pipe.cfg, seed=3, frames=2))
    a, b = torch.cat([a, play(eager, 4)], 1), torch.cat([b, play(compiled, 4)], 1)
    assert compiled.frame_calls == 2 * (3 * WINDOW + 4)
    assert (a - b).abs().max() <= 2e-2
    assert counters["stats"]["unique_graphs"] - graphs == 1, "the compiled frame call recompiled"


@pytest.mark.parametrize("storage,ring", [("bf16", "sdpa"), ("int8", "sdpa"), ("int8", "matmul")])
def test_in_bf16_on_the_cpu_the_graph_is_as_close_to_fp32_as_the_eager_step(storage, ring):
    """On the CPU in bf16, over two ring wrap-arounds, then a short history (slots masked out)
    under an attention bias, the graph's frames (Inductor's fused kernels round in other places;
    ``ring``: its kernel of a frame's attention over the ring) stay as close to the fp32 frames
    as the eager bf16 step's with SDPA do (RMS distance within 1.25x of the eager one's)."""
    def frames(pipe):
        wraps = play(pipe, 2 * WINDOW)
        pipe.hard_cut(*history(pipe.cfg, seed=3, frames=2))
        pipe.kv_cache_attention_bias = -1.0
        return torch.cat([wraps, play(pipe, 2)], dim=1).float()

    compiled = pipeline(storage, True, dtype=torch.bfloat16, ring_attention=ring)
    reference, eager, graph = (frames(pipe) for pipe in (pipeline(storage, False),
                                                         pipeline(storage, False, dtype=torch.bfloat16), compiled))
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    for part in (slice(0, 2 * WINDOW), slice(2 * WINDOW, None)):  # full rings; the short biased history
        assert 0 < rms(graph[:, part] - reference[:, part]) <= 1.25 * rms(eager[:, part] - reference[:, part])


def test_matmul_attention_is_sdpa_under_an_additive_mask():
    """In fp32 the matmul-softmax-matmul that bench_frame times beside SDPA is SDPA's arithmetic:
    masked-out slots (-inf) and a bias on the others."""
    from owl_wms.attention import matmul_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (8, 40, 40))
    mask = torch.zeros(1, 40)
    mask[:, 8:24], mask[:, 24:] = float("-inf"), -1.5
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    assert torch.allclose(matmul_attention(q, k, v, mask, 0.25), expected, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_the_graph_gives_the_same_frames_run_to_run(device):
    first, second = (play(pipeline("int8", True, device=device), 2 * WINDOW) for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.parametrize("device", DEVICES)
def test_noise_is_drawn_on_the_device_from_the_seed(device):
    """A frame's noise and the history's come from a generator on the model's device, so nothing
    is drawn on the host and copied in per frame; on the CPU its stream is the seed's, as before."""
    pipe = pipeline("int8", True, device=device, seed=7)
    assert pipe.noise.generator.device.type == device
    plans = []
    frame = pipe.lifecycle.frame
    pipe.lifecycle.frame = lambda *args, **kw: plans.append(frame(*args, **kw)) or plans[-1]
    play(pipe, 1)
    assert plans[0].noise.device.type == device and plans[0].noise.dtype == torch.float32
    c, s = pipe.cfg.channels, pipe.cfg.sample_size
    pipe.noise.generator.manual_seed(7)
    expected = torch.randn((1, 1, c, s, s), generator=torch.Generator(device).manual_seed(7), device=device)
    assert torch.equal(pipe.noise(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_no_graph_break_or_recompile_across_wraps_cuts_recomputes_and_bias(device):
    pipe = pipeline("int8", True, device=device, kv_recompute_every=4)
    cfg = pipe.cfg

    def session():
        play(pipe, 3 * WINDOW)  # three wrap-arounds, with a recompute every 4 frames
        pipe.kv_cache_attention_bias = -1.0  # soft forgetting, live
        play(pipe, 2)
        pipe.kv_cache_attention_bias = 0.0
        pipe.generate([0.0, 0.0], [0] * 11, commit=False)  # teacher forcing's uncommitted frame
        pipe.observe(torch.randn(1, 1, cfg.channels, cfg.sample_size, cfg.sample_size), [0.0, 0.0], [0] * 11)
        pipe.hard_cut(*history(cfg, seed=4))

    session()  # warm-up: every shape and path once
    graphs, breaks, calls = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), pipe.frame_calls
    session()
    assert pipe.frame_calls - calls == 2 * (3 * WINDOW + 2 + 1) + 1  # the frames' calls and the observed frame's
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled frame call recompiled"
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])


@pytest.mark.parametrize("settings, reason", [
    (dict(kv=KVSettings(ring_mode="roll", fmt_k="int8", fmt_v="int8")), "ring_mode is roll, not inplace"),
    (dict(kv=KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="int8", guard=2)), "the ring guard checks every write"),
    (dict(kv=KVSettings(ring_mode="inplace"), frame_graph=False), "OWL_FRAME_GRAPH=0"),
])
def test_other_modes_run_the_per_block_path_and_say_so_at_start_up(settings, reason, capsys):
    cfg = tiny_config()
    pipe = CausvidPipeline(random_model(cfg), None, tiny_world(cfg, WINDOW), fp32_settings(compile=True, **settings))
    assert pipe.runner.compiled == "blocks"
    assert f"a graph per block half (not one graph a frame: {reason}" in capsys.readouterr().out


@pytest.mark.parametrize("rope_impl", ["motion", "ortho"])
def test_device_rope_angles_keep_their_precision_at_large_positions(rope_impl):
    """Over the ring, angles are made on the device as frame x step + base in float64; at frame
    10^6 their cos and sin agree with the host's direct angles' to float32's resolution, for
    each row of a batch at its own position."""
    cfg = tiny_config(rope_impl=rope_impl)
    rope, tpf = make_rope(cfg), cfg.tokens_per_frame
    frames = torch.tensor([7, 10**6])
    cos, sin = rope.frame_cos_sin(frames, 2)
    assert cos.shape == (2, 1, 2 * tpf, cfg.head_dim // 2)
    for row, frame in enumerate(frames.tolist()):
        c, s = rope.cos_sin(frame * tpf, 2 * tpf, "cpu")
        assert (cos[row, 0] - c).abs().max() < 1e-6 and (sin[row, 0] - s).abs().max() < 1e-6


def test_a_restored_snapshot_replays_the_same_frames_through_the_graph():
    """The graph reads the ring's tensors each call: a snapshot restored into it (storage and
    counters, copied in place) replays the frames made after the snapshot, bit for bit."""
    pipe = pipeline("int8", True)
    play(pipe, WINDOW + 2)  # past a wrap-around
    state = pipe.get_state()
    first = play(pipe, WINDOW, seed=5)
    pipe.load_state(state)
    assert torch.equal(play(pipe, WINDOW, seed=5), first)


def test_the_background_compile_never_traces_in_the_players_process_and_gives_the_compiled_frames(
        tmp_path, monkeypatch):
    """OWL_COMPILE=auto compiles in a child process: while frames run eagerly here, FX's tracer
    never swaps ``torch.nn.Module.__call__`` in this process (a traced call on the compile's
    thread did, and broke the frames' thread: "module is not installed as a submodule"); once
    the loaded graph takes over, every frame call runs it and the frames are those of
    OWL_COMPILE=1, bit for bit."""
    import threading
    import time

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold: a warm cache skips the tracing
    model = random_model(tiny_config(n_layers=LAYERS))
    auto = pipeline("int8", False, model=model, compile_background=True)
    logs, swapped, done = [], [], threading.Event()
    original = torch.nn.Module.__call__

    def watch():
        while not done.is_set():
            if torch.nn.Module.__call__ is not original:
                swapped.append(torch.nn.Module.__call__)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert auto.runner.compile_in_background((1,), log=logs.append)
        for _ in range(8):  # frames while the child compiles (it yields the cores to them)
            play(auto, 1)
        auto.runner.background.wait(600)
    finally:
        done.set()
        watcher.join()
    assert not swapped and auto.runner.compiled == "whole", logs
    assert any("took over" in text for text in logs), logs
    compiled = pipeline("int8", True, model=model)
    for pipe in (auto, compiled):
        pipe.hard_cut(*history(pipe.cfg, seed=3, frames=WINDOW))
    eager_calls = auto.frame_calls
    assert torch.equal(play(auto, WINDOW + 2), play(compiled, WINDOW + 2))
    assert auto.frame_calls == eager_calls  # no call fell back to the eager frame call
    # the kept graph checks only its tensors' guards (precompile.tensor_guards), and those still
    # refuse a call it was not built for: another batch's cache and inputs run eagerly instead
    graph = auto.runner.graphs[(1, torch.get_num_threads())]
    cfg = auto.cfg
    x = torch.zeros(2, 1, cfg.channels, cfg.sample_size, cfg.sample_size)
    assert graph(x, x.new_ones(2, 1), x.new_zeros(2, 1, 2), x.new_zeros(2, 1, 11),
                 kv_cache=auto.runner.new_cache(rows=2)) is None
    # a later start loads the kept graph: no compile process, and the same frames
    again = pipeline("int8", False, model=model, compile_background=True)
    assert again.runner.compile_in_background((1,), log=logs.append)
    play(again, 2)  # the kept graphs load once a frame is made
    assert again.runner.background.wait(60) and again.runner.background.process is None
    assert again.runner.compiled == "whole", logs
    again.hard_cut(*history(again.cfg, seed=3, frames=WINDOW))
    compiled.hard_cut(*history(compiled.cfg, seed=3, frames=WINDOW))
    assert torch.equal(play(again, 3), play(compiled, 3))


def test_a_compile_process_whose_app_ends_before_its_job_arrives_ends_quietly(capfd):
    """An app that exits while it sends the compile process its job (a Ctrl-C just after the first
    frame) leaves a child that ends with nothing on the terminal: nothing sent, or a message cut
    short (the two children start side by side)."""
    import struct
    import torch.multiprocessing as mp

    from owl_wms.engine.precompile import compile_graphs

    ctx = mp.get_context("spawn")
    children = []
    for cut in (False, True):
        child_jobs, jobs = ctx.Pipe(duplex=False)
        reader, child_conn = ctx.Pipe(duplex=False)
        child = ctx.Process(target=compile_graphs, args=(child_jobs, child_conn), daemon=True)
        child.start()
        child_jobs.close()
        child_conn.close()
        if cut:
            os.write(jobs.fileno(), struct.pack("!i", 4096) + b"\x80\x05" * 8)  # a 4 KiB message's first bytes
        jobs.close()
        children.append((child, reader))
    for child, reader in children:
        child.join(60)
        assert child.exitcode == 0
        with pytest.raises(EOFError):
            reader.recv()  # it built nothing and said nothing
    assert capfd.readouterr().err == ""


def test_an_exiting_app_lets_a_compile_process_start_under_way_finish_first(monkeypatch):
    """A start cut short by the app's exit leaves a child that prints spawn's unpickling traceback
    on the terminal after the app has gone: the exit waits for the loader thread's start."""
    import threading

    from owl_wms.engine import precompile

    starting = threading.Lock()
    monkeypatch.setattr(precompile, "_STARTING", starting)
    monkeypatch.setattr(precompile, "_ENDING", threading.Event())
    starting.acquire()  # the loader thread is starting the compile process
    ending = threading.Thread(target=precompile.end_compile_processes)
    ending.start()
    ending.join(0.5)
    assert ending.is_alive() and precompile._ENDING.is_set()  # no other start begins; this one finishes
    starting.release()
    ending.join(30)
    assert not ending.is_alive()


def blocked_signals(conn) -> None:
    """(A spawned process's target.) Sends the signals blocked in it."""
    import signal

    conn.send(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))


def test_the_compile_process_starts_with_ctrl_c_blocked_even_as_the_first_child():
    """The terminal's Ctrl-C reaches the compile process too, while it imports torch; it starts with
    SIGINT blocked, also when it is the app's first child (starting Python's resource tracker then
    unblocks SIGINT in the starting thread, before the child is made)."""
    import signal
    import subprocess
    import sys

    code = ("import threading, torch.multiprocessing as mp\n"
            "from owl_wms.engine.precompile import start_without_ctrl_c\n"
            "from tests.test_compiled import blocked_signals\n"
            "ctx = mp.get_context('spawn')\n"
            "reader, writer = ctx.Pipe(duplex=False)\n"
            "child = ctx.Process(target=blocked_signals, args=(writer,))\n"
            "starter = threading.Thread(target=start_without_ctrl_c, args=(child,))  # as the app's loader\n"
            "starter.start(); starter.join()\n"
            "print(reader.recv()); child.join()\n")
    from .conftest import REPO

    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert int(signal.SIGINT) in eval(run.stdout.strip().splitlines()[-1])


def semaphores_of_a_progress_bar(compile_process: bool, results) -> None:
    """(A spawned process's target.) The named semaphores a tqdm bar registers, in a compile
    process or in a plain one."""
    from multiprocessing import resource_tracker

    from tqdm import tqdm

    from owl_wms.engine.precompile import become_compile_process

    made = []
    register = resource_tracker.register
    resource_tracker.register = lambda name, kind: (made.append(kind), register(name, kind))
    if compile_process:
        become_compile_process()
    with open(os.devnull, "w") as sink:
        for _ in tqdm(range(2), disable=False, file=sink):
            pass
    results.put((made, os.getpgrp() == os.getpid()))


def test_a_compile_process_leaves_no_semaphore_and_no_compiler_behind_when_the_app_ends_it():
    """torch's FX tracer draws a tqdm bar, whose default lock is a named semaphore: a compile
    process the app terminates would leave it behind, and Python warns of it when the app exits
    ("leaked semaphore objects"). The compile process locks its bars with a thread lock."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    runs = {}
    for compile_process in (False, True):  # side by side
        results = ctx.Queue()
        runs[compile_process] = (ctx.Process(target=semaphores_of_a_progress_bar, args=(compile_process, results),
                                             daemon=True), results)
        runs[compile_process][0].start()
    made = {compile_process: results.get(timeout=120) for compile_process, (_, results) in runs.items()}
    for child, _ in runs.values():
        child.join(30)
    # (the plain process shows what is counted); the compile process leads a process group, which
    # the C++ compilers it starts join, so that the app ends them with it
    assert made == {False: (["semaphore"], False), True: ([], True)}


def test_weights_that_cannot_move_to_shared_memory_leave_frames_eager_with_the_reason(monkeypatch):
    """The compile process reads the weights from shared memory; where they cannot move there (a
    small /dev/shm), no process starts and the frames stay eager, saying why."""
    auto = pipeline("int8", False, compile_background=True)

    def no_room(*_):
        raise RuntimeError("unable to write to file </torch_1_0>: No space left on device")

    monkeypatch.setattr(auto.runner.core, "share_memory", no_room)
    logs = []
    assert not auto.runner.compile_in_background((1,), log=logs.append)
    assert auto.runner.background is None and auto.runner.compile_state() == "eager"
    assert "frames stay eager" in logs[0] and "No space left on device" in logs[0]
    play(auto, 2)


def test_kept_graphs_unused_for_a_month_are_pruned(tmp_path):
    """Each change of the code or settings names new graph files: those no start used for 30 days
    go (a loaded graph's file is touched), the others stay."""
    import os
    import time

    from owl_wms.engine.precompile import prune_graphs

    old, recent = tmp_path / "frame-old.bin", tmp_path / "frame-recent.bin"
    for path in (old, recent):
        path.write_bytes(b"graph")
    month_ago = time.time() - 31 * 86400
    os.utime(old, (month_ago, month_ago))
    assert prune_graphs(tmp_path) == 1 and not old.exists() and recent.exists()
    assert prune_graphs(tmp_path / "missing") == 0


def test_a_kept_graph_is_named_by_what_it_was_built_from():
    """A frame graph's file name changes with the cache's plan and the ring's kernel, a decoder
    graph's does not (one decoder graph serves every KV mode) but changes with the decoder's own
    settings, which its weights' shapes do not show; both change with the Inductor
    settings the job carries, which are the app process's when the job was made, not the
    settings of the process that asks (the compile process builds with the job's)."""
    import dataclasses

    from torch._inductor import config as inductor

    from owl_wms.engine.precompile import CompileJob

    pipe = pipeline("int8", False)
    runner = pipe.runner
    job = CompileJob(runner.core, torch.nn.Conv2d(4, 3, 1), runner.cache_cfg, runner.kv_plan, "cpu", torch.float32,
                     (1,), (1,), {}, "sdpa", inductor.save_config_portable())
    other_ring, other_plan = dataclasses.replace(job, ring_attention="matmul"), dataclasses.replace(job, plans=[])
    other_inductor = dataclasses.replace(job, inductor_config={**job.inductor_config, "cpp.simdlen": 256})
    assert job.path("frame", 1, 1) not in {other_ring.path("frame", 1, 1), other_plan.path("frame", 1, 1)}
    assert job.path("decode", 1, 1) == other_ring.path("decode", 1, 1) == other_plan.path("decode", 1, 1)
    assert job.path("decode", 2, 1) != job.path("decode", 1, 1) != job.path("decode", 1, 2)
    relu, silu = torch.nn.Conv2d(4, 3, 1), torch.nn.Conv2d(4, 3, 1)
    relu.config, silu.config = {"act_fn": "relu"}, {"act_fn": "silu"}  # as a diffusers model's config
    assert (dataclasses.replace(job, autoencoder=relu).path("decode", 1, 1)
            != dataclasses.replace(job, autoencoder=silu).path("decode", 1, 1))
    assert other_inductor.path("frame", 1, 1) != job.path("frame", 1, 1)
    assert other_inductor.path("decode", 1, 1) != job.path("decode", 1, 1)
    named = job.path("frame", 1, 1)
    with inductor.patch({"cpp.enable_kernel_profile": not inductor.cpp.enable_kernel_profile}):
        assert job.path("frame", 1, 1) == named
