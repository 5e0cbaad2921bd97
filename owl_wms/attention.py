"""Frame-causal windowed attention with two backends built from one visibility rule.

Rule (docs/architecture.md, Frame visibility): a query in frame fq sees a key in frame fk iff
fk <= fq and fq - fk < window (window None = unlimited). Attention is full inside a frame.

A ``window`` is one value for every query frame, or a tuple with one value per query frame
(a call that mixes frames under the training mask with decoded frames, which see further:
the no-cache baseline).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .rope import apply_rope

BACKENDS = ("sdpa", "flex")
# Named off the traced line: with kernel profiling (scripts.bench_frame) Inductor's C++ wrapper
# quotes each traced source line in a C++ raw string, which a ')"' in the line would end.
MERGE_HEADS = "b h t d -> b t (h d)"

# SDPA attends multi-frame queries (training clips, prefill) in chunks of about this many
# query tokens, each against only the key frames it can see; 0 makes one masked call (the
# benchmarks' reference). 256 tokens: 4 frames of the shipped world. Only on the device types
# in CHUNKED_DEVICES (None: all): the CPU pays for masked-out work in full, while on a GPU one
# masked call was faster (bench_pipeline on an H200: a 60-frame prefill of the production-size
# model in 0.45x the time of chunks, the shipped world's in 0.61x).
QUERY_CHUNK_TOKENS = 256
CHUNKED_DEVICES: frozenset[str] | None = frozenset({"cpu"})


@contextlib.contextmanager
def query_chunk_tokens(tokens: int):
    """Run a block with another query chunk size (0: one masked SDPA call) on every device;
    for benchmarks, which compare chunks with one call on a GPU too."""
    global QUERY_CHUNK_TOKENS, CHUNKED_DEVICES
    saved = QUERY_CHUNK_TOKENS, CHUNKED_DEVICES
    QUERY_CHUNK_TOKENS, CHUNKED_DEVICES = tokens, None
    try:
        yield
    finally:
        QUERY_CHUNK_TOKENS, CHUNKED_DEVICES = saved

# Eager FlexAttention (the CPU path when not compiled) is correct but unfused; torch warns
# about that on first use. The choice is deliberate here, so keep the console clean.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


Window = int | None | tuple


def frame_visible(q_frame, k_frame, window):
    """The one mask rule, on tensors of frame indices (broadcasting); ``window`` None, an int,
    or a tensor broadcasting like ``q_frame`` (per-query windows, no limit as a huge value)."""
    ok = k_frame <= q_frame
    if window is not None:
        ok = ok & (q_frame - k_frame < window)
    return ok


def widest(window: Window) -> int | None:
    """The largest look-back of a window (None: unlimited)."""
    if not isinstance(window, tuple):
        return window
    return None if any(w is None for w in window) else max(window)


def per_query(window: Window, device=None):
    """``window`` as ``frame_visible`` takes it: as is when uniform, else a [n_q, 1] tensor (no
    limit as a value past any distance)."""
    if not isinstance(window, tuple):
        return window
    if len(set(window)) == 1:
        return window[0]
    return torch.tensor([1 << 40 if w is None else w for w in window], device=device)[:, None]


def frame_rule(n_q_frames: int, n_k_frames: int, window: Window, device=None) -> torch.Tensor:
    """Boolean [n_q, n_k] frame visibility; the query frames are the last n_q_frames key frames."""
    q = torch.arange(n_q_frames, device=device) + (n_k_frames - n_q_frames)
    k = torch.arange(n_k_frames, device=device)
    if isinstance(window, tuple) and len(window) != n_q_frames:
        raise ValueError(f"{len(window)} per-frame windows for {n_q_frames} query frames")
    return frame_visible(q[:, None], k[None, :], per_query(window, device))


def dense_mask(n_q_frames: int, n_k_frames: int, tpf: int, window: Window, device=None) -> torch.Tensor:
    """Boolean [Tq, Tk] token mask; the query frames are the last n_q_frames key frames."""
    rule = frame_rule(n_q_frames, n_k_frames, window, device)
    return rule.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)


@torch.compiler.disable  # built once per shape in eager; compiled graphs take it as an input
@lru_cache(maxsize=64)
def block_mask(n_q_frames: int, n_k_frames: int, tpf: int, window: Window, device: str,
               block_size: int = 128):
    shift = n_k_frames - n_q_frames
    if isinstance(window, tuple):
        rule = frame_rule(n_q_frames, n_k_frames, window, device)

        def mask_mod(b, h, q_idx, kv_idx):
            return rule[q_idx // tpf, kv_idx // tpf]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return frame_visible(q_idx // tpf + shift, kv_idx // tpf, window)

    return create_block_mask(mask_mod, None, None, n_q_frames * tpf, n_k_frames * tpf,
                             device=device, BLOCK_SIZE=block_size)


@torch.compiler.disable
def _flex_eager(q, k, v, bm, scale, score_mod=None):
    # Inductor's CPU lowering of FlexAttention fails for our shapes (torch 2.13 CPU), so
    # on CPU it stays eager even when the rest of the model is compiled.
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale)


@torch.compiler.disable
@lru_cache(maxsize=64)
def history_bias_mask(n_q_frames: int, n_k_frames: int, tpf: int, window: Window, bias: float | tuple,
                      dtype: torch.dtype, device: str) -> torch.Tensor:
    """Additive [Tq, Tk] mask for soft forgetting over time-ordered keys whose last ``n_q_frames``
    frames are the queries': ``bias`` on visible keys of earlier frames (cached history), 0 on the
    query's own frame, -inf where the frame rule hides a key. ``bias`` is one value, or one per
    query frame (frames written under different biases). (A frame over the ring carries its own.)"""
    q = torch.arange(n_q_frames) + (n_k_frames - n_q_frames)
    k = torch.arange(n_k_frames)
    visible = frame_rule(n_q_frames, n_k_frames, window)
    history = k[None, :] < q[:, None]
    per_frame = torch.tensor(bias if isinstance(bias, tuple) else (bias,), dtype=torch.float32)[:, None]
    add = torch.where(history, per_frame, torch.tensor(0.0))
    add = add.masked_fill(~visible, float("-inf"))
    return add.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1).to(device, dtype)


def attend(q, k, v, tpf: int, window: Window, backend: str, mask=None, ring_kernel: str = "sdpa"):
    """q: [b,h,Tq,dh], k/v: [b,h,Tk,dh]; query frames are the last Tq/tpf key frames.

    ``mask``: a float additive mask that encodes the whole rule: ``history_bias_mask``'s (soft
    forgetting), or with ``backend`` "ring" a frame's [b, 1, 1, Tk] over ring slots in any order,
    attended by the ``RING_KERNELS`` entry ``ring_kernel``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "ring":  # a frame over a ring read in place: its mask [b, 1, 1, Tk] holds the whole rule
        return RING_KERNELS[ring_kernel](q, k, v, mask, scale)
    if mask is not None and mask.dtype != torch.bool:
        if backend == "flex":
            def biased(score, b, h, q_idx, kv_idx):
                return score + mask[q_idx, kv_idx]

            if q.device.type == "cpu":
                return _flex_eager(q, k, v, None, scale, biased)
            return flex_attention(q, k, v, score_mod=biased, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    n_q, n_k = q.shape[2] // tpf, k.shape[2] // tpf
    # Tail-only read: drop key frames no query can see (exact; saves work on local layers).
    reach = widest(window)
    if reach is not None and n_k - n_q - (reach - 1) > 0:
        drop = n_k - n_q - (reach - 1)
        k, v, n_k = k[:, :, drop * tpf:], v[:, :, drop * tpf:], n_k - drop
    if backend == "flex":
        bm = block_mask(n_q, n_k, tpf, window, str(q.device))
        if q.device.type == "cpu":
            return _flex_eager(q, k, v, bm, scale)
        return flex_attention(q, k, v, block_mask=bm, scale=scale)
    chunked = QUERY_CHUNK_TOKENS and (CHUNKED_DEVICES is None or q.device.type in CHUNKED_DEVICES)
    chunk = max(1, QUERY_CHUNK_TOKENS // tpf) if chunked else n_q
    return _attend_sdpa(q, k, v, tpf, window, chunk, scale)


def sdpa_attention(q, k, v, mask, scale: float):
    """SDPA under the additive float ``mask`` [Tq or 1, Tk] (``matmul_attention``'s signature)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=scale)


def matmul_attention(q, k, v, mask, scale: float):
    """Attention as a matmul, a softmax in fp32 and a matmul, under the additive float ``mask``
    [Tq or 1, Tk]: the other kernel of a frame's queries over a ring (``Settings.ring_attention``
    says where it runs; ``scripts.bench_frame`` times both)."""
    logits = torch.matmul(q, k.transpose(-1, -2)).float() * scale + mask
    return torch.matmul(logits.softmax(-1).to(v.dtype), v)


# A frame's attention over a ring read in place, by name (Settings.ring_attention).
RING_KERNELS = {"sdpa": sdpa_attention, "matmul": matmul_attention}


def _attend_sdpa(q, k, v, tpf: int, window: Window, chunk: int, scale: float):
    """SDPA over chunks of ``chunk`` query frames, each against only the key frames it can
    see (one chunk of all the query frames is the plain masked call). The same rule and the
    same result either way, but chunks skip the masked-out work: on a 32-frame training clip
    in chunks of 4 frames, a local layer (window 8) reads 30% of the keys per query that one
    call reads and a global layer 56% (scripts.bench_train times the step both ways)."""
    n_q, n_k = q.shape[2] // tpf, k.shape[2] // tpf
    shift = n_k - n_q  # query frame j is key frame j + shift
    out = []
    for s in range(0, n_q, chunk):
        c = min(chunk, n_q - s)
        hi = s + c + shift
        part = window[s:s + c] if isinstance(window, tuple) else window
        reach = widest(part)
        lo = 0 if reach is None else max(0, s + shift - (reach - 1))
        # One query frame sees every key it is given: no mask needed.
        mask = None if c == 1 else dense_mask(c, hi - lo, tpf, part, q.device)
        out.append(F.scaled_dot_product_attention(q[:, :, s * tpf:(s + c) * tpf], k[:, :, lo * tpf:hi * tpf],
                                                  v[:, :, lo * tpf:hi * tpf], attn_mask=mask, scale=scale))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, layer: int, tpf: int, window: int | None,
                 decode_window: int | None = None):
        super().__init__()
        self.n_heads, self.layer, self.tpf = n_heads, layer, tpf
        self.window, self.decode_window = window, decode_window  # frame mask / decoding (ModelConfig)
        self.ring_kernel = "sdpa"  # a frame over a ring: the RING_KERNELS entry (Transformer.set_backends)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def project(self, x, cos, sin):
        """Pure: q, k, v [b, h, t, dh] with QK-norm and RoPE (K is cached in this form)."""
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        q, k = F.rms_norm(q, (q.shape[-1],)), F.rms_norm(k, (k.shape[-1],))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def project_q(self, x, cos, sin):
        """Queries only (a layer that borrows another layer's K/V): the first third of qkv."""
        d = self.qkv.out_features // 3  # (three, heads, dh) rows: also true of a tensor-parallel shard
        q = rearrange(F.linear(x, self.qkv.weight[:d], self.qkv.bias[:d]), "b t (h d) -> b h t d", h=self.n_heads)
        return apply_rope(F.rms_norm(q, (q.shape[-1],)), cos, sin)

    def with_cache(self, k, v, kv_cache):
        """Eager cache bookkeeping: write this call's K/V (when enabled) and read the window."""
        if kv_cache is None:
            return k, v, None
        return kv_cache.attend_window(self.layer, k, v)

    def effective_window(self, window_cap: int | None, n_q_frames: int = 1, decode_from: int | None = None) -> Window:
        """The look-back of each query frame: the frame mask's window for frames before
        ``decode_from`` (None: no decoded frames), the decoding window from there on; both
        capped at ``window_cap`` frames."""
        def cap(w):
            return w if window_cap is None else window_cap if w is None else min(w, window_cap)

        framed, decoded = cap(self.window), cap(self.decode_window)
        if decode_from is None or decode_from >= n_q_frames:
            return framed
        if decode_from <= 0 or framed == decoded:
            return decoded
        return (framed,) * decode_from + (decoded,) * (n_q_frames - decode_from)

    def attend_out(self, q, k, v, window: Window, backend: str, mask=None):
        y = attend(q, k, v, self.tpf, window, backend, mask, self.ring_kernel)
        return self.out(rearrange(y, MERGE_HEADS))
