import os
from pathlib import Path

import pytest

# The suite runs on pytest-xdist workers (pyproject's addopts), one per core, which share the
# machine: each worker and every app it starts gets its share of the cores, and idle OpenMP
# threads sleep instead of spinning (spinning threads of two processes on shared cores slow
# both several times over).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
TEST_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # as the apps: float32 matmuls give the same bits at any thread count
import torch  # noqa: E402
from safetensors import safe_open
from safetensors.torch import load_file

from owl_wms.config import DecoderConfig, ModelConfig, PipelineConfig, WorldConfig
from owl_wms.model import GameRFT
from owl_wms.settings import Settings

REPO = Path(__file__).resolve().parent.parent
# A fixed, small thread count: on a busy machine the suite slows in proportion instead of
# collapsing, and the apps the tests start in child processes use the same.
torch.set_num_threads(TEST_THREADS)
os.environ["OWL_THREADS"] = str(TEST_THREADS)
GOLDEN = REPO.parent / "shared" / "golden" / "gamerft_motion_tiny.safetensors"
# Seconds of a fixed piece of work (100 fp32 384x384 matmuls on TEST_THREADS threads) on a quiet
# 2-thread AMD EPYC VM, the machine the suite's time limits were set on (there 0.07-0.14 s on
# 2 threads, 0.12 s on the 1 thread of each of two workers).
QUIET_PACE_S = 0.14


# The files that take longest, longest first (wall seconds on two workers, docs/results.md "The
# test suite"): each worker takes the next whole file when it is free (pyproject's addopts), so
# starting the long ones first leaves only short files for the end, and both workers finish
# together. The rest keep their order. A stale list costs time, never a result.
LONGEST_FIRST = ("test_benchmarks.py", "test_compiled.py", "test_kv_quant.py", "test_serve.py", "test_tp.py",
                 "test_pp.py", "test_readme_commands.py", "test_stages.py", "test_world_recipe.py", "test_play.py",
                 "test_ab_kv.py", "test_headless.py", "test_eval.py", "test_serve_browser.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def machine_pace() -> float:
    """How many times slower than that quiet machine this one runs now (at least 1): the best of
    three timings of the same work, so a busy machine's limits grow with its load."""
    import time

    a = torch.randn(384, 384)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(100):
            a @ a
        best = min(best, time.perf_counter() - start)
    return max(1.0, best / QUIET_PACE_S)


def time_limit(quiet_seconds: float) -> float:
    """A time limit sized by the work: ``quiet_seconds`` (a generous limit on the quiet machine,
    several times the work's measured time there) scaled by how slow this machine is now."""
    return quiet_seconds * machine_pace()


def tiny_config(**overrides) -> ModelConfig:
    base = dict(sample_size=4, channels=8, n_layers=4, n_heads=2, d_model=128, tokens_per_frame=16,
                n_frames=32, n_buttons=11, causal=True, rope_impl="motion", local_window=3, global_window=None)
    base.update(overrides)
    return ModelConfig.from_mapping(base)


def tiny_world(cfg: ModelConfig, window: int = 5) -> WorldConfig:
    return WorldConfig(model=cfg, vae_scale=1.0, pipeline=PipelineConfig(window_frames=window),
                       decoder=DecoderConfig(), name="tiny")


def fp32_settings(backend: str = "sdpa", device: str = "cpu", **kw) -> Settings:
    return Settings(device=device, dtype=torch.float32, attn_backend=backend, attn_backend_decode=backend, **kw)


def random_model(cfg: ModelConfig, seed: int = 0) -> GameRFT:
    torch.manual_seed(seed)
    model = GameRFT(cfg).float().eval()
    # Default init leaves AdaLN/gates small but non-zero; scale up so every layer matters.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    return model


def rollout(cfg: ModelConfig, frames: int, window: int = 5, **settings):
    """A random model prefilled with a random history, then ``frames`` frames of random controls.
    Returns (latents [1, frames, c, h, w], pipeline, torch.compile graphs made after frame 2)."""
    from torch._dynamo.utils import counters

    from inference.causvid_pipeline import CausvidPipeline

    pipe = CausvidPipeline(random_model(cfg), None, tiny_world(cfg, window), fp32_settings(**settings), verbose=False)
    g = torch.Generator().manual_seed(1)
    c, s = cfg.channels, cfg.sample_size
    pipe.prefill(torch.randn(window, c, s, s, generator=g), torch.randn(window, 2, generator=g),
                 (torch.rand(window, 11, generator=g) > 0.5).float())
    outs, graphs = [], 0
    for i in range(frames):
        if i == 2:
            graphs = counters["stats"]["unique_graphs"]
        outs.append(pipe.generate(torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float()))
    return torch.cat(outs, dim=1), pipe, counters["stats"]["unique_graphs"] - graphs


# Golden files made by the original implementation (float32, CPU): the shared one beside the
# repo, and ours in tests/golden, made from Wayfarer-Labs/owl-wms branch laptop_inference_v2_bf16
# (commit 39983ec; each file's ``source`` metadata names it) for the configurations the shared
# file does not reach: global_window below the window, local_idx 2, head dim 32, 3x3 latents, a
# 10-frame window, ortho RoPE by default, an unconditional model. Their weights are stored as
# bf16 values (exact: the original ran on those values in float32).
REPO_GOLDEN = REPO / "tests" / "golden"
GOLDEN_FILES = (sorted(GOLDEN.parent.glob("*.safetensors")) if GOLDEN.parent.is_dir() else []) + sorted(
    REPO_GOLDEN.glob("*.safetensors"))


def _meta_value(text: str):
    if text in ("null", "None"):
        return None
    if text in ("True", "true", "False", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_golden(path: Path) -> dict:
    import dataclasses

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig.from_mapping({k: _meta_value(v) for k, v in meta.items() if k in fields})
    model = GameRFT(cfg).float().eval()
    weights = {k[len("model."):]: v.float() for k, v in tensors.items() if k.startswith("model.")}
    model.core.load_state_dict(weights)
    return {"cfg": cfg, "model": model, "t": tensors, "window": int(meta["window_frames"]),
            "alpha": float(meta.get("history_alpha", 0.25)), "name": path.stem, "weights": weights,
            "meta": meta}


def golden_frames(t: dict) -> int:
    """Decoded frames in a golden file's tensors."""
    n = len({k.split(".")[1] for k in t if k.startswith("dec.") and k.endswith(".x0")})
    assert n > 0
    return n


def golden_decode(pipe, t: dict, frames: int | None = None) -> list[torch.Tensor]:
    """The golden two-step decode through a pipeline: prefill the file's history (already the
    noised input), then each frame from its noise and controls; returns every frame's x0."""
    pipe.prefill(t["dec.hist_x"][0], t["dec.hist_mouse"][0], t["dec.hist_btn"][0], noised=True)
    return [pipe.generate(t[f"dec.{f}.mouse"][0, 0], t[f"dec.{f}.btn"][0, 0], noise=t[f"dec.{f}.noise"])
            for f in range(golden_frames(t) if frames is None else frames)]


def golden_error(x0: list[torch.Tensor], t: dict) -> float:
    """Largest |x0 - golden x0| over the frames given."""
    return max((x - t[f"dec.{f}.x0"]).abs().max().item() for f, x in enumerate(x0))


# Every golden file runs the parity tests (a new config's file is picked up as is).
@pytest.fixture(scope="session", params=GOLDEN_FILES or [GOLDEN], ids=lambda p: p.stem)
def golden(request):
    if not request.param.is_file():
        pytest.skip(f"golden file {request.param} is absent (it ships in ../shared beside the repo)")
    return load_golden(request.param)


def run_main(module: str, args, env: dict | None = None, cwd=REPO):
    """``python -m module args`` as a call of the module's ``main`` in this process (a child
    process would import torch again: seconds a command), with the OWL_* flags of ``env`` alone
    (OWL_THREADS stays) and ``cwd`` as the working folder. Returns (returncode, stdout, stderr)."""
    import importlib
    import io
    from contextlib import redirect_stderr, redirect_stdout
    from types import SimpleNamespace

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        for name in [k for k in os.environ if k.startswith("OWL_") and k != "OWL_THREADS"]:
            del os.environ[name]
        os.environ.update(env or {})
        os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rc = importlib.import_module(module).main([str(a) for a in args])
            except SystemExit as stop:  # argparse's errors, and scripts that exit with a message
                rc = stop.code
                if isinstance(rc, str):
                    print(rc, file=err)
                    rc = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        torch.set_num_threads(TEST_THREADS)  # the app sets its own
    return SimpleNamespace(returncode=rc or 0, stdout=out.getvalue(), stderr=err.getvalue())
