"""Parity with tensors produced by the original implementation (float32, CPU).

Every golden file runs every test here (conftest.GOLDEN_FILES): the shared one, and those in
tests/golden made by Wayfarer-Labs/owl-wms branch laptop_inference_v2_bf16, commit 39983ec
(its StaticCache and two-step loop, eager FlexAttention in float32 on the CPU)."""
import pytest
import torch

from inference.causvid_pipeline import CausvidPipeline
from owl_wms import attention
from owl_wms.cache import StaticCache

from .conftest import fp32_settings, golden_decode, golden_error, golden_frames, tiny_world

TOL = 1e-4


@pytest.mark.parametrize("backend,chunk_tokens", [("sdpa", 0), ("sdpa", 32), ("sdpa", 48), ("flex", 0)],
                         ids=["sdpa-one-call", "sdpa-chunks-of-2-frames", "sdpa-chunks-of-3-frames", "flex"])
def test_cache_free_forward(golden, backend, chunk_tokens, monkeypatch):
    g, model = golden["t"], golden["model"]
    model.core.transformer.set_backends(backend, backend)
    monkeypatch.setattr(attention, "QUERY_CHUNK_TOKENS", chunk_tokens)
    with torch.no_grad():
        out = model(g["full.x"], g["full.t"], g["full.mouse"], g["full.btn"])
    assert (out - g["full.out"]).abs().max().item() <= TOL


@pytest.mark.parametrize("backend,chunk_tokens", [("sdpa", 0), ("sdpa", 32), ("flex", 0)],
                         ids=["sdpa-one-call", "sdpa-chunks-of-2-frames", "flex"])
def test_two_step_decode_model_and_cache(golden, backend, chunk_tokens, monkeypatch):
    """The original call sequence, written out: prefill (in query chunks or one call), then
    per frame two model calls."""
    g, model, cfg = golden["t"], golden["model"], golden["cfg"]
    model.core.transformer.set_backends(backend, backend)
    monkeypatch.setattr(attention, "QUERY_CHUNK_TOKENS", chunk_tokens)
    cache = StaticCache(cfg, max_length=golden["window"], batch_size=1, dtype=torch.float32)
    with torch.no_grad():
        model.core.transformer.disable_decoding()
        cache.enable_cache_updates()
        model(g["dec.hist_x"], g["dec.hist_t"], g["dec.hist_mouse"], g["dec.hist_btn"], kv_cache=cache)
        cache.disable_cache_updates()
        model.core.transformer.enable_decoding()
        for f in range(golden_frames(g)):
            z, m, b = g[f"dec.{f}.noise"], g[f"dec.{f}.mouse"], g[f"dec.{f}.btn"]
            v1 = model(z, torch.ones(1, 1), m, b, kv_cache=cache)
            x = z - 0.75 * v1
            cache.enable_cache_updates()
            v2 = model(x, torch.full((1, 1), 0.25), m, b, kv_cache=cache)
            cache.disable_cache_updates()
            x0 = x - 0.25 * v2
            for name, val in (("v1", v1), ("v2", v2), ("x0", x0)):
                assert (val - g[f"dec.{f}.{name}"]).abs().max().item() <= TOL, (f, name)
            assert cache.get_offset(0) == int(g[f"dec.{f}.offset"])
            assert all(cache.get_offset(i) == cache.get_offset(0) for i in range(cfg.n_layers))


@pytest.mark.parametrize("kv_cache", ["static", "none"], ids=["cache", "no-cache-baseline"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_two_step_decode_through_pipeline(golden, backend, kv_cache):
    """The pipeline's frames; the no-cache baseline recomputes every frame's window from its
    inputs, with the history under the frame mask and later frames as decoded."""
    g = golden["t"]
    pipe = CausvidPipeline(golden["model"], None, tiny_world(golden["cfg"], golden["window"]),
                           fp32_settings(backend, kv_cache=kv_cache), verbose=False)
    assert pipe.alpha == golden["alpha"] and bool((g["dec.hist_t"] == pipe.alpha).all())
    assert golden_error(golden_decode(pipe, g), g) <= TOL
    if pipe.cache is not None:
        assert pipe.cache.get_offset(0) == int(g[f"dec.{golden_frames(g) - 1}.offset"])


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_the_backend_setting_picks_the_attention_kernel(golden, backend, monkeypatch):
    """A parity pass with "flex" must have run FlexAttention (and no SDPA), and "sdpa" the reverse."""
    calls = {"flex": 0, "sdpa": 0}
    flex, sdpa = attention._flex_eager, attention.F.scaled_dot_product_attention

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(attention, "_flex_eager", count("flex", flex))
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", count("sdpa", sdpa))
    g = golden["t"]
    pipe = CausvidPipeline(golden["model"], None, tiny_world(golden["cfg"], golden["window"]),
                           fp32_settings(backend), verbose=False)
    assert golden_error(golden_decode(pipe, g, 1), g) <= TOL
    layers = golden["cfg"].n_layers
    assert calls[backend] >= 3 * layers  # prefill + two steps, every layer
    assert calls["sdpa" if backend == "flex" else "flex"] == 0, calls


def test_start_up_line_names_the_rope_kind(golden, capsys):
    cfg = golden["cfg"]
    CausvidPipeline(golden["model"], None, tiny_world(cfg, golden["window"]), fp32_settings(), verbose=True)
    line = capsys.readouterr().out
    assert f" rope={cfg.rope_impl} " in line, line
    if "rope_impl" not in golden["meta"]:  # a config without the key means ortho, as in the original
        assert cfg.rope_impl == "ortho"


def test_golden_files_tell_the_decode_rule_from_the_frame_mask(monkeypatch):
    """The files with global_window below the window catch a decode that keeps the frame mask on
    global layers: it is off by far more than the tolerance from the first generated frame."""
    from owl_wms.config import ModelConfig

    from .conftest import REPO_GOLDEN, load_golden

    monkeypatch.setattr(ModelConfig, "decode_window", ModelConfig.layer_window)
    for name in ("gw_lt_window", "latent3x3", "window10", "ortho_uncond_gw2"):
        golden = load_golden(REPO_GOLDEN / f"{name}.safetensors")  # built under the wrong rule
        g = golden["t"]
        pipe = CausvidPipeline(golden["model"], None, tiny_world(golden["cfg"], golden["window"]), fp32_settings(),
                               verbose=False)
        assert golden_error(golden_decode(pipe, g, 1), g) > 1e-2, name
