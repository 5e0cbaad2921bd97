"""The bf16/fp32 StaticCache against the no-cache baseline, and the cache contract."""
import pytest
import torch

from owl_wms.cache import StaticCache

from .conftest import tiny_config
from .conftest import rollout as shared_rollout

CONFIGS = {
    "golden-shape": {},
    "global-window-local-idx-2": dict(global_window=4, local_idx=2, local_window=2),
    "head-dim-32-wide-frame": dict(n_heads=4, sample_size=3, tokens_per_frame=9, n_layers=3, local_window=4),
}


def rollout(cfg, kv_cache: str, frames: int, window: int = 5, seed: int = 0):
    out, pipe, _ = shared_rollout(cfg, frames, window, kv_cache=kv_cache, seed=seed)
    return out, pipe


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decode_equals_no_cache_baseline(name):
    cfg = tiny_config(**CONFIGS[name])
    frames = 100 if name == "golden-shape" else 30  # 100 frames = 20 rollovers of a 5-frame window
    cached, pipe = rollout(cfg, "static", frames)
    baseline, _ = rollout(cfg, "none", frames)
    assert pipe.cache.get_offset(0) == (5 + frames) * cfg.tokens_per_frame
    err = (cached - baseline).abs().max().item()
    assert err <= 1e-4, err
    assert cached.abs().mean() > 0.1  # the comparison is over real, non-trivial outputs


def test_same_seed_same_frames_other_seed_differs():
    cfg = tiny_config()
    a, _ = rollout(cfg, "static", 6, seed=3)
    b, _ = rollout(cfg, "static", 6, seed=3)
    c, _ = rollout(cfg, "static", 6, seed=4)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def _kv(cfg, frames, fill):
    shape = (1, cfg.n_heads, frames * cfg.tokens_per_frame, cfg.head_dim)
    return torch.full(shape, float(fill)), torch.full(shape, float(-fill))


def test_static_cache_window_roll_and_logical_append():
    cfg = tiny_config(n_layers=1)
    cache = StaticCache(cfg, max_length=3, dtype=torch.float32)
    tpf = cfg.tokens_per_frame
    for f in range(3):
        cache.update(*_kv(cfg, 1, f + 1), 0)
    assert cache.get_offset(0) == 3 * tpf and cache.n_frames(0) == 3
    k, _ = cache.get(0, *_kv(cfg, 1, 9))
    # Read-only step: the window (W frames) as if appended; the oldest frame drops out, nothing mutates.
    assert k.shape[2] == 3 * tpf and k[0, 0, ::tpf, 0].tolist() == [2, 3, 9]
    assert cache.get(0)[0][0, 0, ::tpf, 0].tolist() == [1, 2, 3] and cache.get_offset(0) == 3 * tpf
    cache.update(*_kv(cfg, 1, 4), 0)  # writing rolls: the oldest frame is evicted
    k, v = cache.get(0)
    assert k[0, 0, ::tpf, 0].tolist() == [2, 3, 4] and v[0, 0, ::tpf, 0].tolist() == [-2, -3, -4]
    assert cache.get_offset(0) == 4 * tpf
    cache.truncate(2)
    assert cache.get(0)[0][0, 0, ::tpf, 0].tolist() == [4] and cache.get_offset(0) == 4 * tpf
    cache.reset(2)
    assert cache.get_offset(0) == 0 and cache.shape == (2, cfg.n_heads, 3 * tpf, cfg.head_dim)
    assert cache.to(dtype=torch.bfloat16).k[0].dtype == torch.bfloat16


def test_static_cache_rejects_bad_writes():
    cfg = tiny_config(n_layers=1)
    cache = StaticCache(cfg, max_length=2, dtype=torch.float32)
    k, v = _kv(cfg, 3, 1)
    with pytest.raises(ValueError, match="at most the cache's 2 frames"):
        cache.update(k, v, 0)
    with pytest.raises(ValueError, match="head dim"):
        cache.update(torch.zeros(1, cfg.n_heads, cfg.tokens_per_frame, 7), torch.zeros(1, cfg.n_heads, cfg.tokens_per_frame, 7), 0)
    with pytest.raises(ValueError, match="whole frames"):
        cache.update(k[:, :, :5], v[:, :, :5], 0)


def test_compiled_model_matches_eager_and_stops_recompiling():
    cfg = tiny_config()
    eager, _ = rollout(cfg, "static", 8)
    compiled, _, new_graphs = shared_rollout(cfg, 8, compile=True)
    assert new_graphs == 0  # steady state: no recompiles per frame
    assert (compiled - eager).abs().max() <= 1e-4


def test_teacher_forcing_observe_matches_between_cache_and_baseline():
    cfg = tiny_config()
    outs = {}
    for mode in ("static", "none"):
        _, pipe = rollout(cfg, mode, 3)
        g = torch.Generator().manual_seed(7)
        seq = []
        for _ in range(9):  # predict without committing, then observe a "real" frame
            m, b = torch.randn(2, generator=g), (torch.rand(11, generator=g) > 0.5).float()
            seq.append(pipe.generate(m, b, commit=False))
            pipe.observe(torch.randn(1, 1, 8, 4, 4, generator=g), m, b)
        outs[mode] = torch.cat(seq, dim=1)
        if mode == "static":
            assert pipe.cache.get_offset(0) == (5 + 3 + 9) * cfg.tokens_per_frame
    assert (outs["static"] - outs["none"]).abs().max() <= 1e-4


def test_modes_agree_where_global_window_is_below_the_window_through_observe_and_bias():
    """global_window 2 < window 5: the history fills under the frame mask, every later frame
    (generated or observed) sees the whole window on global layers; the roll, the in-place ring
    and the no-cache baseline build the same frames, with soft forgetting switched on mid-rollout
    (the baseline recomputes each frame under the bias it was cached with)."""
    from inference.flags import resolve_settings

    from .conftest import fp32_settings, random_model, tiny_world
    from inference.causvid_pipeline import CausvidPipeline

    cfg = tiny_config(global_window=2, local_window=2, local_idx=2)
    inplace = resolve_settings({}, {"OWL_RING_MODE": "inplace"}).kv
    outs = {}
    for name, extra in (("roll", {}), ("inplace", {"kv": inplace}), ("none", {"kv_cache": "none"})):
        pipe = CausvidPipeline(random_model(cfg), None, tiny_world(cfg, 5), fp32_settings(**extra), verbose=False)
        g = torch.Generator().manual_seed(3)
        pipe.prefill(torch.randn(5, 8, 4, 4, generator=g), torch.randn(5, 2, generator=g), torch.zeros(5, 11))
        seq = []
        for i in range(10):
            m, b = torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.6).float()
            if i == 6:
                pipe.kv_cache_attention_bias = -1.0
            if i in (3, 4):  # teacher forcing: a prediction left out of the history, a real frame in
                seq.append(pipe.generate(m, b, commit=False))
                pipe.observe(torch.randn(1, 1, 8, 4, 4, generator=g), m, b)
            else:
                seq.append(pipe.generate(m, b))
        outs[name] = torch.cat(seq, dim=1)
    assert (outs["inplace"] - outs["roll"]).abs().max() <= 1e-4
    assert (outs["none"] - outs["roll"]).abs().max() <= 1e-4
    assert outs["roll"].abs().mean() > 0.1
