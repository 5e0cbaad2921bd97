"""Tensor parallelism on CPU: 2 gloo processes started by torchrun, against one process."""
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from owl_wms.config import load_config
from owl_wms.parallel import ParallelContext, TPError
from tests.conftest import REPO, time_limit, tiny_config

ENV = {"OWL_DTYPE": "fp32", "OWL_DEVICE": "cpu"}


def game(tmp_path, *args, tp=2, env=None, actions=None, timeout=240.0):
    """Run the headless game (under torchrun when tp > 1); returns (rc, output, seconds)."""
    import os

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
           "-m", "inference.game_cv"] if tp > 1 else [sys.executable, "-m", "inference.game_cv"]
    if actions is not None:
        path = tmp_path / "actions.jsonl"
        path.write_text("".join(json.dumps(a) + "\n" for a in actions))
        args = (*args, "--actions", str(path))
    full_env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWL_")}, **ENV, **(env or {})}
    start = time.perf_counter()
    p = subprocess.run([*cmd, "--headless", "--tp", str(tp), *args], cwd=REPO, env=full_env, capture_output=True,
                       text=True, timeout=time_limit(timeout))
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - start


def fault_env(fault: str) -> dict:
    """Break rank 1 on purpose (tests/faults/sitecustomize.py)."""
    return {"TEST_FAULT": fault, "PYTHONPATH": f"{REPO / 'tests' / 'faults'}:{REPO}"}


FRAME = {"mouse": [4.0, 0.0], "buttons": [1] + [0] * 10}
SCRIPT = [FRAME] * 4 + [{"event": "restart"}, {"event": "bias", "value": -1.0}] + [FRAME] * 4


def one_process_and_tp2(tmp_path, env: dict) -> tuple[dict, str]:
    """{1: frames of one process on two threads, 2: frames of two ranks on one thread each} of the
    scripted rollout (float32 matmuls give the same bits at any thread count), and rank 0's log."""
    frames = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.npy"
        rc, log, _ = game(tmp_path, "--out", str(tmp_path / f"tp{tp}.mp4"), "--save-frames", str(out), tp=tp,
                          env={**env, "OWL_THREADS": str(3 - tp)}, actions=SCRIPT)
        assert rc == 0, log
        frames[tp] = np.load(out)
    return frames, log


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3"])
def test_tp2_gives_the_one_process_frames_through_cut_bias_and_recompute(tmp_path, storage):
    """Rank 0 broadcasts every step; the frames are the single-process run's exactly, for the
    integer and the float codecs of the cache (each rank quantizes its heads' K/V to the same
    codes; a bf16 cache, which quantizes nothing, follows the golden decode on two ranks below),
    and after the hard cut every rank restarted its epoch and offsets (checked by the all-gather
    after every step)."""
    env = {"OWL_KV_RECOMPUTE_EVERY": "3", "OWL_TP_CHECK_EVERY": "1", "OWL_KV_STORAGE": storage}
    frames, log = one_process_and_tp2(tmp_path, env)
    assert frames[1].shape == (8, 64, 64, 3)
    assert np.array_equal(frames[1], frames[2]), np.abs(frames[1].astype(int) - frames[2]).max()
    agreed = next(line for line in log.splitlines() if "ranks agree at stop" in line)
    model = load_config(REPO / "checkpoints" / "maze-world" / "config.yaml")
    tpf, window = model.model.tokens_per_frame, model.pipeline.window_frames
    # epoch 2 after the cut; 4 frames since, with a recompute at the 3rd: the window's anchor + 1 frame
    assert "epoch=2 " in agreed and "frame=4 " in agreed and f"offset0={(window + 1) * tpf} " in agreed, agreed


def test_tp2_summing_partials_stays_within_rounding(tmp_path):
    """tp_reduce=sum all-reduces partial sums (one collective fewer): fp32 rounding only, with a
    cache that rounds no further (bf16 storage keeps fp32 values in an fp32 run). A few values
    next to a uint8 rounding boundary differ by a level; a real divergence moves many by many."""
    frames, _ = one_process_and_tp2(tmp_path, {"OWL_KV_STORAGE": "bf16", "OWL_TP_REDUCE": "sum"})
    diff = np.abs(frames[1].astype(int) - frames[2])
    assert diff.max() <= 2 and diff.mean() < 0.05, (diff.max(), diff.mean())


@pytest.mark.parametrize("fault,message", [
    ("settings", "ranks were started with different settings.*settings.seed"),
    ("calls", "rank 1: made 3 model calls in step call 3 frame.*expected 2"),
    ("envelope", "rank 1: rejected the envelope.*call id 2, expected 3"),
    ("raise", "rank 0 stopped because rank 1: RuntimeError: injected fault"),
])
def test_broken_rank_fails_every_rank_fast_with_a_clear_message(tmp_path, fault, message):
    import re

    rc, log, secs = game(tmp_path, "--frames", "6", "--out", str(tmp_path / "x.mp4"), env=fault_env(fault))
    assert rc != 0
    assert re.search(message, log), log[-3000:]
    assert secs < time_limit(60), f"took {secs:.0f}s: a rank waited for a collective instead of failing"


def test_tp_without_torchrun_says_how_to_launch(tmp_path):
    import os
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")},
           **ENV}
    p = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--tp", "2", "--frames", "2",
                        "--out", str(tmp_path / "x.mp4")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=time_limit(120))
    assert p.returncode == 2
    assert "torchrun --nproc-per-node 2 -m inference.game_cv" in p.stderr


def test_heads_must_divide_across_ranks():
    ctx = ParallelContext.__new__(ParallelContext)
    ctx.world = 3
    with pytest.raises(TPError, match="4 attention heads, not divisible by 3"):
        ctx.check_divisible(tiny_config(n_heads=4))


@pytest.mark.parametrize("name,ring_mode", [("latent3x3", ""), ("window10", "inplace")])
def test_tp2_reproduces_the_golden_decode(tmp_path, name, ring_mode):
    """Heads on 2 ranks follow the original too, global_window below the window included
    (both files: global layers decode over the whole cache)."""
    import subprocess

    from safetensors.torch import load_file

    from tests.conftest import REPO_GOLDEN, golden_error, golden_frames, load_golden

    path, out = REPO_GOLDEN / f"{name}.safetensors", tmp_path / "x0.safetensors"
    golden = load_golden(path)
    assert golden["cfg"].global_window < golden["window"] and golden["cfg"].n_heads % 2 == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.tp_golden_worker", str(path), str(out), ring_mode]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=time_limit(240))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    x0 = load_file(str(out))["x0"]
    assert x0.shape[1] == golden_frames(golden["t"])
    err = golden_error(list(x0.split(1, dim=1)), golden["t"])
    assert err <= 1e-4, err
