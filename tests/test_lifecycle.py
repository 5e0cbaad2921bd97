"""Cache lifecycle (single process): hard cut, recompute, soft forgetting, snapshots, state machine."""
import numpy as np
import pytest
import torch

from inference.causvid_pipeline import CausvidPipeline
from inference.flags import resolve_settings
from owl_wms.attention import attend, dense_mask, history_bias_mask
from owl_wms.engine.lifecycle import Lifecycle, LifecycleError, Phase, StepPlan
from owl_wms.settings import SettingsError
from tests.conftest import fp32_settings, random_model, tiny_config, tiny_world

CFG = tiny_config()
W = 5
INT8_INPLACE = dict(kv=resolve_settings({}, {"OWL_KV_STORAGE": "int8", "OWL_RING_MODE": "inplace"}).kv)
HEAD_EMA = dict(kv=resolve_settings({}, {"OWL_KV_STORAGE": "int8", "OWL_KV_SCALE": "head", "OWL_KV_EMA": "0.9",
                                         "OWL_RING_MODE": "pointer"}).kv)


def make(seed_model=0, **settings):
    return CausvidPipeline(random_model(CFG, seed_model), None, tiny_world(CFG, W), fp32_settings(**settings),
                           verbose=False)


def history(seed=1):
    g = torch.Generator().manual_seed(seed)
    c, s = CFG.channels, CFG.sample_size
    return (torch.randn(W, c, s, s, generator=g), torch.randn(W, 2, generator=g),
            (torch.rand(W, 11, generator=g) > 0.5).float())


def controls(n, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float()) for _ in range(n)]


def run(pipe, ctrl):
    return torch.cat([pipe.generate(m, b) for m, b in ctrl], dim=1)


# -- soft forgetting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_k,window", [(1, 4, None), (3, 6, 2), (2, 2, None)])
def test_bias_mask_with_zero_bias_is_the_frame_rule(n_q, n_k, window):
    tpf = 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n * tpf, 8, generator=g) for n in (n_q, n_k, n_k))
    add = history_bias_mask(n_q, n_k, tpf, window, 0.0, torch.float32, "cpu")
    assert torch.equal(torch.isfinite(add), dense_mask(n_q, n_k, tpf, window))
    for backend in ("sdpa", "flex"):
        torch.testing.assert_close(attend(q, k, v, tpf, window, backend, add), attend(q, k, v, tpf, window, backend),
                                   atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
def test_bias_on_history_keys_matches_a_reference_on_both_backends(window):
    tpf, n_k, bias = 4, 4, -1.7
    n_q = 1
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, tpf, 8, generator=g), *(torch.randn(1, 2, n_k * tpf, 8, generator=g) for _ in "kv")
    add = history_bias_mask(n_q, n_k, tpf, window, bias, torch.float32, "cpu")
    # reference: softmax over visible keys with the bias on every frame but the query's own
    current = n_k - 1
    frame = torch.arange(n_k * tpf) // tpf
    visible = (frame > current - window) if window is not None else torch.ones(n_k * tpf, dtype=torch.bool)
    logits = q @ k.transpose(-1, -2) / 8 ** 0.5 + torch.where(frame == current, 0.0, bias)
    logits = logits.masked_fill(~visible, float("-inf"))
    ref = logits.softmax(-1) @ v
    for backend in ("sdpa", "flex"):
        torch.testing.assert_close(attend(q, k, v, tpf, window, backend, add), ref, atol=1e-5, rtol=1e-5)


def test_zero_bias_reproduces_unbiased_rollout_exactly():
    ctrl = controls(6)
    outs = []
    for bias in (None, 0.0):
        pipe = make(**({} if bias is None else {"kv_cache_attention_bias": bias}), **INT8_INPLACE)
        pipe.prefill(*history())
        outs.append(run(pipe, ctrl))
    assert torch.equal(outs[0], outs[1])


def test_bias_means_the_same_in_every_layout_and_without_a_cache():
    """The biased keys are the earlier frames whatever the storage order: roll (time order),
    inplace (ring slots) and the cache-free recompute baseline agree; the bias changes frames."""
    ctrl = controls(7)  # past the ring's wrap-around (window 5)
    outs = {}
    for name, extra in [("roll", {}), ("inplace", {"kv": resolve_settings({}, {"OWL_RING_MODE": "inplace"}).kv}),
                        ("none", {"kv_cache": "none"}), ("unbiased", None)]:
        pipe = make(**(extra if extra is not None else {}))
        if extra is not None:
            pipe.kv_cache_attention_bias = -2.0  # live API
        pipe.prefill(*history())
        outs[name] = run(pipe, ctrl)
    torch.testing.assert_close(outs["inplace"], outs["roll"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs["none"], outs["roll"], atol=1e-4, rtol=1e-4)
    assert (outs["roll"] - outs["unbiased"]).abs().max() > 1e-2


def test_bias_setting_and_live_api_validate():
    with pytest.raises(SettingsError, match="OWL_KV_CACHE_ATTENTION_BIAS"):
        resolve_settings({}, {"OWL_KV_CACHE_ATTENTION_BIAS": "soft"})
    assert resolve_settings({}, {"OWL_KV_CACHE_ATTENTION_BIAS": "-1.5"}).kv_cache_attention_bias == -1.5
    pipe = make()
    with pytest.raises(ValueError, match="kv_cache_attention_bias"):
        pipe.kv_cache_attention_bias = 1e6


# -- hard cut ----------------------------------------------------------------------------------------
def test_hard_cut_starts_a_new_epoch_and_replays_deterministically():
    pipe = make(**INT8_INPLACE)
    lat, m, b = history()
    assert pipe.hard_cut(lat, m, b) == 1
    first = run(pipe, controls(4))
    assert pipe.frame_index == 4 and pipe.cache.get_offset(0) == (W + 4) * CFG.tokens_per_frame
    assert pipe.hard_cut(lat, m, b) == 2  # every index restarts
    assert pipe.cache_epoch == 2 and pipe.frame_index == 0 and pipe.lifecycle.phase is Phase.RESET
    assert all(pipe.cache.get_offset(i) == W * CFG.tokens_per_frame for i in range(CFG.n_layers))
    assert torch.equal(run(pipe, controls(4)), first)


def test_hard_cut_checks_its_history():
    pipe = make()
    with pytest.raises(ValueError, match="exactly one of"):
        pipe.hard_cut()
    with pytest.raises(ValueError, match=r"expected \[n <= 5"):
        pipe.hard_cut(torch.zeros(W + 1, CFG.channels, 4, 4))
    with pytest.raises(RuntimeError, match="no history"):
        pipe.generate([0, 0], [0] * 11)


# -- recompute ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [{}, INT8_INPLACE, HEAD_EMA], ids=["bf16-roll", "int8-inplace", "int8-head-ema"])
def test_recompute_equals_a_fresh_prefill_of_the_same_history(kv):
    every = 3
    a = make(kv_recompute_every=every, **kv)
    a.prefill(*history())
    ctrl = controls(every + 2)
    run(a, ctrl[:every])
    anchor, rng = a.recompute_anchor.stacked(), a.noise.state()
    after = run(a, ctrl[every:])  # the first of these frames rebuilds the cache
    assert a.lifecycle.event == "frame" and a.lifecycle.since_anchor == 2
    # positions were re-based: W anchor frames + the 2 frames since, not the whole session
    assert a.cache.get_offset(0) == (W + 2) * CFG.tokens_per_frame

    b = make(**kv)
    b.noise.restore(rng)
    b.hard_cut(*anchor, reseed=False)
    assert torch.equal(run(b, ctrl[every:]), after)


def test_recompute_from_decoded_frames_equals_a_hard_cut_to_those_images():
    """Shipped world: the decoded anchor re-encodes the frames the player saw."""
    every = 2
    settings = resolve_settings({}, {"OWL_KV_RECOMPUTE_EVERY": str(every), "OWL_KV_RECOMPUTE_ANCHOR": "decoded",
                                     "OWL_DEVICE": "cpu", "OWL_DTYPE": "fp32"})
    a = CausvidPipeline.from_checkpoint(settings=settings, verbose=False)
    ctrl = [([4.0, 0.0], [1] + [0] * 10)] * (every + 1)
    for m, b in ctrl[:every]:
        a.generate(m, b)
    lat, m_hist, b_hist = a.recompute_anchor.stacked()
    images = torch.stack([a.decode(x[None, None]) for x in lat])
    rng = a.noise.state()
    after = a.generate(*ctrl[every])

    b = CausvidPipeline.from_checkpoint(settings=settings.replace(kv_recompute_every=0), verbose=False)
    b.noise.restore(rng)
    b.hard_cut(images=images, mouse=m_hist, buttons=b_hist, reseed=False)
    assert torch.equal(b.generate(*ctrl[every]), after)


def test_recompute_settings_are_checked():
    with pytest.raises(SettingsError, match="OWL_KV_RECOMPUTE_EVERY"):
        resolve_settings({}, {"OWL_KV_RECOMPUTE_EVERY": "-2"})
    with pytest.raises(SettingsError, match="OWL_KV_CACHE"):
        resolve_settings({}, {"OWL_KV_RECOMPUTE_EVERY": "4", "OWL_KV_CACHE": "none"})
    with pytest.raises(SettingsError, match="latent|decoded"):
        resolve_settings({}, {"OWL_KV_RECOMPUTE_ANCHOR": "pixels"})


# -- snapshots ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [{}, INT8_INPLACE, HEAD_EMA, {"kv_cache": "none"}],
                         ids=["bf16-roll", "int8-inplace", "int8-head-ema", "no-cache"])
def test_snapshot_restore_continues_identically(kv, tmp_path):
    a = make(kv_recompute_every=4, **kv) if kv.get("kv_cache") != "none" else make(**kv)
    a.prefill(*history())
    a.kv_cache_attention_bias = -0.5
    run(a, controls(3))
    path = a.save_state(tmp_path / "snap.safetensors")
    state = a.get_state()
    cont = controls(5, seed=9)
    expected = run(a, cont)
    for source in (state, path):  # in memory and from the file, into a fresh pipeline
        b = make(seed_model=0, **({"kv_recompute_every": 4} if kv.get("kv_cache") != "none" else {}), **kv)
        b.load_state(source)
        assert b.cache_epoch == 1 and b.kv_cache_attention_bias == -0.5
        assert torch.equal(run(b, cont), expected)


def test_snapshot_from_other_settings_is_refused(tmp_path):
    a = make()
    a.prefill(*history())
    path = a.save_state(tmp_path / "s.safetensors")
    b = make(**INT8_INPLACE)
    with pytest.raises(ValueError, match="same checkpoint and settings"):
        b.load_state(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        a.save_state(tmp_path / "missing" / "s.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary files left
    damaged = a.get_state()
    del damaged["meta"]["parts"]["anchor"]
    with pytest.raises(ValueError, match="lacks the state of anchor"):
        a.load_state(damaged)


@pytest.mark.parametrize("damage", ["anchor", "replay", "noise"])
def test_a_snapshot_refused_part_way_leaves_the_pipeline_as_it_was(damage):
    """A snapshot of the same settings whose cache loads but a later part is damaged: refused with
    the part named, and the pipeline makes the frames it would have made without the attempt."""
    b = make(kv_recompute_every=4, **INT8_INPLACE)
    b.prefill(*history())
    run(b, controls(3))
    twin = make(kv_recompute_every=4, **INT8_INPLACE)
    twin.load_state(b.get_state())
    other = make(kv_recompute_every=4, **INT8_INPLACE)
    other.prefill(*history(seed=7))
    run(other, controls(5, seed=8))
    damaged = other.get_state()
    if damage == "noise":  # not a generator's state
        damaged["tensors"]["noise.rng"] = torch.zeros(3)
    elif damage == "anchor":  # more frames than it holds
        damaged["meta"]["parts"]["anchor"]["frames"] += 1
    else:  # its step lost
        del damaged["meta"]["parts"]["replay"]["step"]
    with pytest.raises(ValueError, match=f"snapshot refused: its {damage} state does not fit"):
        b.load_state(damaged)
    cont = controls(5, seed=9)
    assert torch.equal(run(b, cont), run(twin, cont))


# -- state machine -----------------------------------------------------------------------------------
def test_state_machine_phases_and_envelope_checks():
    life = Lifecycle(n_steps=2, recompute_every=2)
    with pytest.raises(LifecycleError, match="load a history first"):
        life.frame(None, None, torch.zeros(1))
    z = torch.zeros(1)
    seen = []
    plan = life.cut(z, z, z)
    for _ in range(5):
        life.expect(plan)
        life.advance(plan)
        seen.append((plan.event, life.phase.value, life.epoch))
        plan = life.frame(z, z, z, anchor=(z, z, z) if life.recompute_due else None)
    assert seen == [("cut", "reset", 1), ("frame", "steady", 1), ("frame", "steady", 1),
                    ("recompute", "steady", 1), ("frame", "steady", 1)]
    stale = life.frame(z, z, z)
    life.advance(stale)
    with pytest.raises(LifecycleError, match="call id"):
        life.expect(stale)  # the same envelope twice
    other = Lifecycle(n_steps=3)
    other.advance(other.cut(z, z, z))
    with pytest.raises(LifecycleError, match="model calls"):  # a rank whose sampler has another schedule
        other.expect(StepPlan("frame", call_id=1, epoch=1, frame_index=0, bias=0.0, expected_calls=2, noise=z))


def test_profile_line_reports_epoch_and_event(capsys):
    pipe = make(kv_recompute_every=2, profile_kv=True, profile_kv_first=10)
    pipe.profiler.print = print
    pipe.prefill(*history())
    pipe.generate(*controls(1)[0])  # generate() alone does not print; __call__ does, with a decoder
    lines = []
    pipe.profiler.print = lines.append
    for m, b in controls(3):
        pipe.profiler.start()
        pipe.generate(m, b)
        pipe.profiler.frame(pipe.kv_bytes, 0, epoch=pipe.cache_epoch, event=pipe.lifecycle.event)
    assert [line.split()[2:4] for line in lines] == [["epoch=1", "event=frame"], ["epoch=1", "event=recompute"],
                                                     ["epoch=1", "event=frame"]]
    assert "recompute_ms=" in lines[1]


def test_snapshot_and_restore_events_branch_a_headless_rollout(tmp_path):
    """Action files can branch: frames after 'restore' repeat the frames after 'snapshot'."""
    import json

    from inference.game_cv import main

    frame = {"mouse": [4.0, 0.0], "buttons": [1] + [0] * 10}
    script = [frame] * 2 + [{"event": "snapshot"}] + [frame] * 3 + [{"event": "bias", "value": -3.0}, frame,
                                                                   {"event": "restore"}] + [frame] * 3
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in script))
    assert main(["--headless", "--actions", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "a.mp4"),
                 "--save-frames", str(tmp_path / "a.npy")]) == 0
    f = np.load(tmp_path / "a.npy")
    assert f.shape[0] == 9 and (tmp_path / "a.mp4").is_file()
    assert np.array_equal(f[2:5], f[6:9])  # the restored branch replays exactly (bias back to 0)
    assert not np.array_equal(f[5], f[2])


def test_hard_cut_from_a_clip_or_a_fresh_level_counts_epochs():
    settings = resolve_settings({}, {"OWL_DEVICE": "cpu"})
    pipe = CausvidPipeline.from_checkpoint(settings=settings, verbose=False)  # clip 0: epoch 1
    pipe.generate([0, 0], [1] + [0] * 10)
    from owl_wms.maze.worlds import load_level

    assert pipe.hard_cut(clip=1) == 2 and pipe.clip.name == pipe.replay.paths[1].stem
    load_level(pipe, 5)
    assert pipe.cache_epoch == 3 and pipe.frame_index == 0
    with pytest.raises(ValueError, match="exactly one of"):
        pipe.hard_cut(clip=1, images=np.zeros((1, 64, 64, 3), np.uint8))
