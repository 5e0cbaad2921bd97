"""Mask rule, the two backends, and RoPE far beyond the original's table."""
import math

import pytest
import torch

from owl_wms import attention
from owl_wms.attention import attend, block_mask, dense_mask
from owl_wms.rope import MotionRoPE, apply_rope

from .conftest import random_model, tiny_config


@pytest.mark.parametrize("window", [3, None], ids=["local", "global"])
@pytest.mark.parametrize("n_q,n_k", [(6, 6), (1, 5), (2, 7)])
def test_dense_mask_equals_flex_block_mask(window, n_q, n_k):
    tpf = 16
    blocks = block_mask(n_q, n_k, tpf, window, "cpu", block_size=tpf).to_dense()[0, 0].bool()
    from_blocks = blocks.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)
    dense = dense_mask(n_q, n_k, tpf, window)
    assert from_blocks.shape == dense.shape and torch.equal(from_blocks, dense)
    # and the dense mask is the rule written out token by token
    for qi in range(0, n_q * tpf, 7):
        for ki in range(0, n_k * tpf, 5):
            fq, fk = qi // tpf + n_k - n_q, ki // tpf
            assert dense[qi, ki] == (fk <= fq and (window is None or fq - fk < window))


@pytest.mark.parametrize("window", [2, None])
def test_flex_and_sdpa_agree(window):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 4 * 16, 32, generator=g)
    k, v = torch.randn(2, 2, 6 * 16, 32, generator=g), torch.randn(2, 2, 6 * 16, 32, generator=g)
    a = attend(q, k, v, 16, window, "sdpa")
    b = attend(q, k, v, 16, window, "flex")
    assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 3, None], ids=["w1", "w3", "global"])
@pytest.mark.parametrize("n_q,n_k", [(7, 7), (5, 9), (2, 2)])
@pytest.mark.parametrize("chunk_tokens", [16, 32, 48])
def test_query_chunks_equal_one_masked_call(monkeypatch, window, n_q, n_k, chunk_tokens):
    """Multi-frame queries in chunks (each against only the key frames it can see, a last chunk
    shorter) give one masked SDPA call's output and gradients."""
    tpf = 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, n_q * tpf, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 2, n_k * tpf, 32, generator=g, requires_grad=True)
    v = torch.randn(2, 2, n_k * tpf, 32, generator=g, requires_grad=True)
    w = torch.randn(2, 2, n_q * tpf, 32, generator=g)
    results = []
    for tokens in (chunk_tokens, 0):
        monkeypatch.setattr(attention, "QUERY_CHUNK_TOKENS", tokens)
        out = attend(q, k, v, tpf, window, "sdpa")
        results.append((out, *torch.autograd.grad((out * w).sum(), (q, k, v))))
    for chunked, whole in zip(*results):
        assert (chunked - whole).abs().max() < 1e-5


def test_a_chunk_reads_only_the_key_frames_it_can_see(monkeypatch):
    """The point of the chunks: a local layer's chunk never touches keys its window hides.
    Keys outside every chunk's reach are NaN; a read of one would poison the output."""
    tpf, window, n = 16, 2, 8
    monkeypatch.setattr(attention, "QUERY_CHUNK_TOKENS", 2 * tpf)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n * tpf, 32, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :tpf], v2[:, :, :tpf] = float("nan"), float("nan")  # frame 0: seen only by query frames 0-1
    out = attend(q, k2, v2, tpf, window, "sdpa")
    assert torch.isnan(out[:, :, :2 * tpf]).all() and not torch.isnan(out[:, :, 2 * tpf:]).any()
    assert (out[:, :, 2 * tpf:] - attend(q, k, v, tpf, window, "sdpa")[:, :, 2 * tpf:]).abs().max() < 1e-6


def reference_angles(p: int, tpf: int, side: int, dh: int = 64, delta: float = 2.0, theta: float = 10000.0):
    """docs/architecture.md's frame visibility written out in Python floats (float64)."""
    t_dim, x_dim, y_dim = dh * 2 // 8, dh * 3 // 8, dh * 3 // 8
    s = t_dim + x_dim + y_dim
    f = [1.0 / theta ** (2 * j / s) for j in range(s // 2)]
    n_sp = (x_dim + y_dim) // 2
    fx, fy, ft = f[0:n_sp:2], f[1:n_sp:2], f[n_sp:]
    frame, n = divmod(p, tpf)
    r, c = divmod(n, side)
    t = frame * delta
    x, y = t + c - (side - 1) / 2, t + r - (side - 1) / 2
    out = []
    for i in range(len(fx)):
        out += [x * fx[i], y * fy[i]]
    return out + [t * v for v in ft]


def test_only_the_cpu_attends_in_query_chunks_unless_a_benchmark_asks(monkeypatch):
    """On a GPU one masked call beat chunks (H200), so only CPU tensors are chunked;
    query_chunk_tokens (the benchmarks') chunks on every device."""
    seen = []
    monkeypatch.setattr(attention, "_attend_sdpa", lambda q, k, v, tpf, window, chunk, scale: seen.append(chunk))
    tpf, frames = 4, 12
    for device in ("cpu", "meta"):
        q = torch.empty(1, 2, frames * tpf, 8, device=device)
        attend(q, q, q, tpf, None, "sdpa")
        with attention.query_chunk_tokens(2 * tpf):
            attend(q, q, q, tpf, None, "sdpa")
    assert seen == [attention.QUERY_CHUNK_TOKENS // tpf, 2, frames, 2]


def test_rope_far_beyond_the_original_table_matches_float64_formula():
    cfg = tiny_config(sample_size=8, tokens_per_frame=64)
    rope = MotionRoPE(cfg)
    start = 250_000 * 64 + 37  # frame 250,000: the original's table ended near frame 32
    angles = rope.angles(start, 70)
    for i in (0, 1, 27, 69):
        ref = torch.tensor(reference_angles(start + i, 64, 8), dtype=torch.float64)
        assert torch.allclose(angles[i], ref, rtol=0, atol=1e-9)
    cos, sin = rope.cos_sin(start, 70, "cpu")
    v = torch.randn(1, 1, 70, 64, dtype=torch.float64)
    out = apply_rope(v.float(), cos, sin).double()
    a = torch.tensor([reference_angles(start + i, 64, 8) for i in range(70)], dtype=torch.float64)
    ev, od = v[..., 0::2], v[..., 1::2]
    ref = torch.cat([ev * a.cos() - od * a.sin(), od * a.cos() + ev * a.sin()], dim=-1)
    assert (out - ref).abs().max() < 1e-5


def test_rope_built_under_another_default_device_keeps_its_angles_on_the_host():
    """A model built under ``with torch.device(...)`` (bench_pipeline does so on CUDA) failed at
    its first call: the angle tables took the default device, the positions did not."""
    cfg = tiny_config(sample_size=8, tokens_per_frame=64)
    ref = MotionRoPE(cfg).cos_sin(64, 70, "cpu")
    with torch.device("meta"):
        rope = MotionRoPE(cfg)
    got = rope.cos_sin(64, 70, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_model_output_is_invariant_to_absolute_position():
    """RoPE is relative: a window 100,000 frames into a session gives the same velocity."""
    cfg = tiny_config()
    model = random_model(cfg)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 4, 8, 4, 4, generator=g), torch.rand(1, 4, generator=g)
    m, b = torch.randn(1, 4, 2, generator=g), (torch.rand(1, 4, 11, generator=g) > 0.5).float()
    with torch.no_grad():
        near = model(x, t, m, b, frame_offset=0)
        far = model(x, t, m, b, frame_offset=100_000)
    assert (near - far).abs().max() < 1e-3 * max(1.0, near.abs().max().item())
    assert not math.isnan(far.sum().item())


# Angle rows of the original's OrthoRoPE (laptop_inference_v2_bf16 at 39983ec; head dim 32,
# sample_size 4, n_frames 24), read off its float32 table after it drops the audio slots.
ORIGINAL_ORTHO_ROWS = {
    0: [-3.1415927, -136.13568, -269.12979, -402.12387, -3.1415927, -136.13568, -269.12979, -402.12387,
        -3.1415927, -136.13568, -269.12979, -402.12387, 0, 0, 0, 0],
    5: [-3.1415927, -136.13568, -269.12979, -402.12387, -1.5707964, -68.067841, -134.5649, -201.06194,
        -1.5707964, -68.067841, -134.5649, -201.06194, 0, 0, 0, 0],
    65: [-2.0488646, -88.784134, -175.51942, -262.25467, -3.1415927, -136.13568, -269.12979, -402.12387,
         -1.5707964, -68.067841, -134.5649, -201.06194, 0, 0, 0, 0],
}


def test_ortho_rope_angles_are_the_originals_and_continue_past_its_table():
    from owl_wms.rope import make_rope

    cfg = tiny_config(n_heads=4, n_frames=24, rope_impl="ortho")
    rope = make_rope(cfg)
    assert cfg.head_dim == 32 and type(rope).__name__ == "OrthoRoPE"
    angles = rope.angles(0, 24 * 16)
    for token, row in ORIGINAL_ORTHO_ROWS.items():
        assert torch.allclose(angles[token], torch.tensor(row, dtype=torch.float64), rtol=1e-6, atol=2e-5), token
    # Past the original's 24-frame table the time axis goes on along the same line.
    later = rope.angles(30 * 16, 16)
    step = angles[16, :4] - angles[0, :4]
    assert torch.allclose(later[0, :4], angles[0, :4] + 30 * step, rtol=1e-12, atol=1e-9)
    assert torch.equal(later[:, 4:], angles[:16, 4:])  # rows, columns and the padding axis repeat per frame
    with torch.device("meta"):
        assert torch.equal(make_rope(cfg).angles(0, 24 * 16), angles)
