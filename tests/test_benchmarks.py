"""The README's benchmark commands, each run whole at its smallest size: every row it prints is
measured (a number, not a placeholder), and its report files are written. The figures mean
nothing at these sizes; the test is that the command works from start to finish."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from .conftest import REPO, run_main, time_limit

NUMBER = r"\d+(?:\.\d+)?"


def bench(module: str, *args, cwd=REPO, quiet_seconds: float = 300, env: dict | None = None):
    """``python -m scripts.<module> args`` in a child process (compiling benchmarks leave dynamo
    state behind); asserts exit 0 and no traceback, returns stdout."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWL_") or k == "OWL_THREADS"},
           "PYTHONPATH": str(REPO), **(env or {})}
    r = subprocess.run([sys.executable, "-m", f"scripts.{module}", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=time_limit(quiet_seconds))
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"{module} {args}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_bench_compile_measures_eager_and_compiled_modes(tiny2):
    out = bench("bench_compile", "--checkpoint", tiny2, "--frames", 2,
                "--mode", "int8 inplace")
    row = re.search(rf"^int8 inplace +({NUMBER}) +({NUMBER}) +{NUMBER} / {NUMBER} +({NUMBER}) s, (\d+) graphs "
                    rf"+(\d+) / (\d+) +{NUMBER}$", out, re.M)
    assert row, out
    assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0 and int(row[4]) >= 1  # its graph was built
    assert "bf16 roll" not in out and "bf16 inplace" not in out  # only the mode asked for


def test_bench_tp_times_tp1_and_tp2_and_compares_their_frames(tmp_path):
    out = bench("bench_tp", "--skip-prod", "--frames", 2, "--warmup", 1, "--exact-frames", 2, "--out", "tp",
                cwd=tmp_path)
    report = json.loads((tmp_path / "tp" / "report.json").read_text())
    assert [r["tp"] for r in report["rows"]] == [1, 1, 2, 2]
    assert all(r["median_ms"] > 0 and 0 <= r["comm_share"] < 1 for r in report["rows"])
    assert report["rows"][2]["comm_ms"] > 0 and report["rows"][3]["comm_ms"] > 0  # TP 1 has nothing to time
    assert report["fp32_frames"] == 2 and report["fp32_tp2_vs_tp1"]["exact"]["max_abs_diff_uint8"] == 0
    assert report["fp32_tp2_vs_tp1"]["sum"]["max_abs_diff_uint8"] <= 8
    assert "| shipped, TP 2 exact (1 thread per rank) |" in out and (tmp_path / "tp" / "report.md").exists()


def test_bench_pp_times_decoding_in_line_on_a_thread_and_in_two_stages(tmp_path):
    # the shipped world only: the production-shaped model runs the same loops in processes of its
    # own (the next test builds it)
    out = bench("bench_pp", "--frames", 3, "--rounds", 1, "--warmup-rounds", 0, "--compile", 0, "--prod-layers", 0,
                "--json", tmp_path / "pp.json")
    report = json.loads((tmp_path / "pp.json").read_text())
    assert [m["label"] for m in report["models"]] == ["the shipped world"]
    for model in report["models"]:
        rows = model["rows"]
        assert [r["loop"] for r in rows] == ["synchronous, 2 threads", "synchronous, 1 thread",
                                             "asynchronous decode, 1 + 1 threads", "asynchronous decode, 2 + 1 threads",
                                             "two stages: rank 1 generates (1), rank 0 decodes (1)"]
        assert all(r["fps"] > 0 and r["latency_ms"] > 0 for r in rows)
        assert rows[0]["decode_ms"] > 0 and 0 < rows[0]["decode_share"] < 1 and rows[0]["x_sync_default"] == 1.0
        assert all("decode_hidden" in r for r in rows[2:])
        assert model["same_frames"]  # every loop made the same frames, bit for bit
    assert "every loop gave the same frames bit for bit: yes" in out


def test_bench_pp_s_production_shaped_world_has_the_production_model_and_its_decoder():
    from owl_wms.config import PRODUCTION
    from scripts.bench_pp import production_world

    world, model, decoder = production_world(1, 8)
    assert world.model == type(world.model).from_mapping({**PRODUCTION, "n_layers": 1}) and len(model.core.transformer.blocks) == 1
    c, s = world.model.channels, world.model.sample_size
    frame = decoder.decode(torch.randn(1, c, s, s))
    assert frame.shape[:2] == (1, 3) and frame.shape[-1] == 8 * s and torch.isfinite(frame).all()


def test_bench_train_times_eager_compiled_and_dense_steps(tmp_path):
    from .test_world_recipe import tiny_config

    out = bench("bench_train", "--config", tiny_config(tmp_path), "--batch", 1, "--steps", 4)
    assert re.search(rf"median s/step: eager {NUMBER}, compiled {NUMBER}, eager, one masked attention call {NUMBER}", out), out
    assert re.search(rf"compiled / eager step time \(median of interleaved rounds\): {NUMBER}", out), out


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory):
    """An untrained two-layer world (a local and a global layer): its graphs compile in a quarter
    of the shipped world's time, and a compiling benchmark's test compiles every one from cold."""
    folder = tmp_path_factory.mktemp("tiny2")
    # over a base: the checkpoint's config is written merged, so the checkpoint loads without it
    (folder / "tiny2.yaml").write_text(f"base: {json.dumps(str(REPO / 'configs' / 'untrained_tiny.yaml'))}\n"
                                       "model: {n_layers: 2}\n")
    make_checkpoint = [sys.executable, "-m", "scripts.make_untrained_checkpoint", "--config", str(folder / "tiny2.yaml"),
                       "--out", str(folder / "tiny2"), "--clips", "1", "--future", "64"]
    subprocess.run(make_checkpoint, cwd=REPO, check=True, capture_output=True, timeout=time_limit(120))
    return folder / "tiny2"


def test_bench_frame_times_every_path_against_the_default_and_the_floor(tmp_path, tiny2):
    # a path of each kind the table times: eager, the other ring kernel, and the model compiled
    # whole, cold, in a background process as the apps compile it (the sessions' table). The
    # compiled paths of the first table are the same pipeline with other flags, each a cold compile
    # of its own (tens of seconds of CPU; test_compiled and test_kv_quant compile those modes).
    out = bench("bench_frame", "--checkpoint", tiny2, "--frames", 1, "--warmup", 1, "--profile-frames", 1,
                "--prod-layers", 0, "--dtype", "fp32", "--sessions", 1, "--json", tmp_path / "frame.json",
                "--paths", "roll", "other-ring", "--guidance", 1.5, quiet_seconds=600)
    assert f"world untrained-tiny ({tiny2}): " in out, out
    report = json.loads((tmp_path / "frame.json").read_text())
    rows = report["rows"]
    # the world's ring lengths: its global layer's 32 slots and its local layer's 8
    assert sorted(a["keys"] for a in report["attention"]) == [8 * 64, 32 * 64]
    assert all(a["dtype"] == "float32" and a["sdpa_us"] > 0 and a["matmul_us"] > 0 for a in report["attention"])
    assert [r["path"] for r in rows] == ["eager, int8 in-place", "eager, bf16 roll (the original's layout)",
                                         "eager, int8 in-place, matmul ring", "eager, int8 in-place, guidance 1.5"]
    # float32 rings attend by SDPA (auto); eager runs beside the other kernel; roll has no ring
    assert [r["ring_attention"] for r in rows] == ["sdpa", None, "matmul", "sdpa"]
    assert rows[0]["x_eager"] == 1.0 and all(r["x_original"] is None for r in rows)  # no --original given
    for r in rows:
        assert r["dtype"] == "float32" and r["calls_ms"] > 0 and r["decode_ms"] > 0 and r["floor_ms"] > 0
        assert r["end_to_end_ms"] == pytest.approx(r["calls_ms"] + r["decode_ms"]) and 0 <= r["overhead_share"] < 1
    sessions = report["sessions"]
    # one batch size: another would compile its own graphs (the sessions tests run several)
    assert [r["sessions"] for r in sessions] == [1] and sessions[0]["x_one_session"] == 1.0
    # the bound of one session against itself; its floor is the frame's and its decoding's FLOPs
    assert sessions[0]["x_one_session_bound"] == pytest.approx(1.0)
    assert sessions[0]["session_frame_floor_ms"] > rows[0]["floor_ms"]
    assert all(r["ring_attention"] == "sdpa" for r in sessions)
    for r in sessions:
        assert r["step_ms"] > 0 and r["session_frame_ms"] == pytest.approx(r["step_ms"] / r["sessions"])
        assert r["aggregate_fps"] == pytest.approx(1000 * r["sessions"] / r["step_ms"]) and r["decoded"]
        assert 0 < r["attention_share"] and 0 < r["matmul_share"] and r["softmax_share"] >= 0
        assert r["attention_share"] + r["matmul_share"] + r["softmax_share"] < 1
        assert isinstance(r["heap_kept"], bool) and r["page_faults_per_step"] >= 0


def test_batching_bound_adds_only_each_further_session_s_floor():
    from scripts.bench_frame import batching_bound

    assert batching_bound(1, 1, 14.0, 2.0) == 1.0
    assert batching_bound(8, 1, 14.0, 2.0) == pytest.approx(8 * 14.0 / (14.0 + 7 * 2.0))  # 4.0
    assert batching_bound(8, 2, 20.0, 2.0) == pytest.approx((8 / 32.0) / (2 / 20.0))
    assert batching_bound(4, 1, 14.0, 0.0) == 4.0  # sessions that cost nothing: B times the frames


def test_benchmark_headers_name_the_cpu_s_vector_extensions_and_threads():
    from scripts.common import machine

    # which dtype is fast depends on them (bf16 needs AVX512-BF16 or AMX), so every figure names them
    header = machine()
    assert f"({torch.backends.cpu.get_cpu_capability()}" in header and header.endswith(
        f"{torch.get_num_threads()} threads" + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))


def test_bench_heap_times_the_kept_heap_beside_glibc_s_default_each_in_its_own_process(tmp_path):
    out = bench("bench_heap", "--sessions", 1, "--steps", 2, "--rounds", 1, "--compile", 0, "--json",
                tmp_path / "heap.json")
    rows = json.loads((tmp_path / "heap.json").read_text())["rows"]
    glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc") if hasattr(os, "confstr") else False
    assert [r["heap"] for r in rows] == (["kept", "glibc default"] if glibc else ["glibc default"] * 2)
    assert all(r["sessions"] == 1 and r["step_ms"] > 0 and r["page_faults_per_step"] >= 0 for r in rows)
    assert re.search(rf"round 1:\s+kept heap, 1 sessions: {NUMBER} ms a step", out) or not glibc, out


def test_bench_startup_times_the_first_frame_and_the_background_compile(tmp_path, tiny2):
    """From a cold and then a warm compile cache: the first frame, then the compiled call taking
    over, every graph in, and the frame rates on both sides of the switch (the tiny world, over
    the ring)."""
    # two layers: the compile process runs at a low priority beside the frames and the other
    # tests, and a small graph keeps its cold compile within the time limit; the frames are capped
    # as a window's are, or their loop takes the compile's core (on a busy machine a niced process
    # beside three busy ones gets a few per cent of a core)
    seconds = time_limit(250)
    bench("bench_startup", "--checkpoint", tiny2, "--seconds", round(seconds), "--threads", 1,
          "--max-fps", 10, "--json", tmp_path / "startup.json", env={"OWL_RING_MODE": "inplace"},
          quiet_seconds=2.2 * seconds)
    rows = json.loads((tmp_path / "startup.json").read_text())["rows"]
    assert [r["start"] for r in rows] == ["cold compile cache", "warm compile cache"]
    for r in rows:
        assert 0 < r["first_frame_s"] < r["compiled_after_s"] <= r["all_graphs_after_s"] and r["fps_compiled"] > 0


def test_bench_shared_cores_runs_the_command_alone_and_beside_a_busy_process(tmp_path):
    bench("bench_shared_cores", "--frames", 3, "--out", tmp_path / "x.mp4", "--json", tmp_path / "cores.json")
    rows = json.loads((tmp_path / "cores.json").read_text())["rows"]
    assert [r["run"].split(",")[0] for r in rows] == ["free machine", "busy neighbour", "busy neighbour"]
    assert rows[0]["ratio"] == 1.0 and all(r["fps"] > 0 and r["ratio"] > 0 for r in rows)


def test_bench_reproducible_matmul_times_strict_and_default_mkl_in_turns(tmp_path):
    bench("bench_reproducible_matmul", "--frames", 3, "--rounds", 1, "--out", tmp_path / "x.mp4",
          "--json", tmp_path / "cbwr.json")
    rows = json.loads((tmp_path / "cbwr.json").read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["fp32", "bf16"]
    assert all(r["strict_fps"] > 0 and r["default_fps"] > 0 and r["ratio"] > 0 for r in rows)


@pytest.mark.skipif(not shutil.which("Xvfb"), reason="needs Xvfb (Debian package xvfb)")
def test_bench_play_measures_the_window_with_and_without_overlay():
    env = {"DISPLAY": ""}  # its own Xvfb, on a free display
    out = bench("bench_play", "--frames", 3, "--scale", 1, env=env)
    for overlay in ("on ", "off"):
        assert re.search(rf"overlay {overlay}: total {NUMBER} FPS, pipeline {NUMBER} FPS \(3 frames\)", out), out


def test_a_serving_round_starts_its_clock_once_every_player_has_joined():
    from scripts.common import Round

    clock = Round(2, seconds=1.0, warmup=0.5, drain=2.0)
    clock.joined(100)
    clock.joined(100)  # the same player's next frame: still one of two
    assert clock.start is None and not clock.over() and not clock.measures(time.perf_counter())
    clock.joined(101)
    t0 = clock.start
    assert t0 is not None and clock.end() == t0 + 1.5
    assert [clock.measures(t0 + dt) for dt in (0.4, 0.6, 1.6)] == [False, True, False]
    assert clock.measures(t0 + 1.6, until_end=False)  # a frame after the round still answers its controls
    late = Round(2, seconds=1.0, warmup=0.5, join_timeout=0.0)  # a player that never joins holds no one back
    assert late.end() <= time.perf_counter() + 1.5


def test_bench_serve_drives_players_against_the_batched_and_the_one_by_one_server(tmp_path):
    out = bench("bench_serve", "--players", 1, 2, "--seconds", 1.5, "--warmup", 0.5, "--rounds", 1, "--compile", 0,
                "--decode-thread", "--json", tmp_path / "serve.json")
    for n in (1, 2):
        for server in ("batched", "one by one", "batched decode thread"):
            assert re.search(rf"\| {n} \| {server} \| {NUMBER} \| ", out), out
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["aggregate_fps"] > 0 and r["latency_ms_p95"] > 0 for r in rows)


@pytest.mark.parametrize("module, args, message", [
    ("bench_compile", ["--frames", "0"], "--frames 0 measures nothing"),
    ("bench_compile", ["--mode", "bf16 rol"], "invalid choice: 'bf16 rol'"),
    ("bench_tp", ["--warmup", "-1"], "--warmup -1 is below 0"),
    ("bench_train", ["--steps", "3"], "--steps 3 leaves no measured step"),
    pytest.param("bench_train", ["--device", "cuda"], "--device cuda: torch sees no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
    ("bench_play", ["--frames", "0"], "--frames 0 --scale 4: both must be 1 or more"),
    ("bench_serve", ["--players", "0"], "--players, --seconds and --rounds must be positive"),
    ("bench_serve", ["--guidance", "nan"], "--guidance nan: must be a number in [0, 8]"),
    ("bench_shared_cores", ["--serve", "0"], "--serve 0: give 1 to 600 seconds"),
    ("bench_frame", ["--prod-layers", "17"], "--prod-layers 17: the production model has 16 layers"),
    ("bench_frame", ["--guidance", "9"], "--guidance 9: must be a number in [0, 8]"),
    ("bench_frame", ["--original", "/nowhere"], "--original /nowhere: no owl_wms/models/gamerft.py there"),
])
def test_benchmark_arguments_out_of_range_are_one_line_errors(module, args, message):
    r = run_main(f"scripts.{module}", args)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_gpu_check_fits_one_ten_minute_run():
    """scripts/device_check.sh: valid bash, and its steps' time limits add up to at most 9 minutes
    (the check is sized for a 10-minute run on a GPU machine), with the benchmarks above among its steps."""
    script = REPO / "scripts" / "device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    steps = re.findall(r"^step (\w+) (\d+) ", script.read_text(), re.M)
    assert {"tests", "bench_kv", "bench_compile", "bench_frame", "bench_train", "bench_pipeline", "stages"} <= {name for name, _ in steps}
    assert sum(int(limit) for _, limit in steps) <= 9 * 60
