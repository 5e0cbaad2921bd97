"""Parity with tensors produced by the original implementation (float32, CPU)."""
import pytest
import torch

from inference.causvid_pipeline import CausvidPipeline
from owl_wms import attention
from owl_wms.cache import StaticCache

from .conftest import fp32_settings, tiny_world

TOL = 1e-4


def n_decoded(g) -> int:
    n = len({k.split(".")[1] for k in g if k.startswith("dec.") and k.endswith(".x0")})
    assert n > 0
    return n


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
        for f in range(n_decoded(g)):
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


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_two_step_decode_through_pipeline(golden, backend):
    g = golden["t"]
    pipe = CausvidPipeline(golden["model"], None, tiny_world(golden["cfg"], golden["window"]),
                           fp32_settings(backend), verbose=False)
    pipe.prefill(g["dec.hist_x"][0], g["dec.hist_mouse"][0], g["dec.hist_btn"][0], noised=True)
    assert pipe.alpha == golden["alpha"] and bool((g["dec.hist_t"] == pipe.alpha).all())
    for f in range(n_decoded(g)):
        x0 = pipe.generate(g[f"dec.{f}.mouse"][0, 0], g[f"dec.{f}.btn"][0, 0], noise=g[f"dec.{f}.noise"])
        assert (x0 - g[f"dec.{f}.x0"]).abs().max().item() <= TOL
        assert pipe.cache.get_offset(0) == int(g[f"dec.{f}.offset"])
