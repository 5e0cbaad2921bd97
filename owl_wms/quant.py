"""KV quantization: a storage codec x a scale policy (docs/architecture.md, The KV cache).

Every cached tensor is viewed per frame as ``[b, h, frames, tpf, dh]``. A scale policy
reduces a frame to its scales:

    token    amax over dh            -> [b, h, n, tpf, 1]   (stored beside its token)
    channel  amax over the frame     -> [b, h, n, 1, dh]    (KIVI-style, for keys)
    head     amax over the frame     -> [b, h, n, 1, 1]     then a running max or EMA over frames

Scales live in the cache's frame slots, so a layout that moves a frame moves its scales in
the same operation. A codec stores ``x / scale`` (bf16: no scale at all).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

CODECS = ("bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
GRANULARITIES = ("token", "head", "channel")


class Codec:
    """Stores values already divided by their scale; ``qmax`` is the largest storable magnitude."""
    name: str
    qmax: float | None = None  # None: stored as is, no scales
    pack: int = 1  # values per stored element along the head dim

    def stored_dim(self, head_dim: int) -> int:
        if head_dim % self.pack:
            raise ValueError(f"{self.name} packs {self.pack} values per byte; head dim {head_dim} is not divisible")
        return head_dim // self.pack

    def storage_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        raise NotImplementedError

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, out=None) -> torch.Tensor:
        """Values in ``dtype``; ``out`` (same shape as the values) is written and returned when given."""
        raise NotImplementedError


class PlainCodec(Codec):
    name = "bf16"  # "bf16" is the mode's name: values are kept in the cache's compute dtype

    def storage_dtype(self, compute_dtype):
        return compute_dtype

    def encode(self, y):
        return y

    def decode(self, q, scale, dtype, out=None):
        if out is not None:
            return out.copy_(q)
        return q if q.dtype == dtype else q.to(dtype)


class Int8Codec(Codec):
    name, qmax = "int8", 127.0

    def storage_dtype(self, compute_dtype):
        return torch.int8

    def encode(self, y):
        return y.round().clamp_(-self.qmax, self.qmax).to(torch.int8)

    def decode(self, q, scale, dtype, out=None):
        # Cast, then scale in place: exact (int8 fits bf16), and faster on CPU than one int8 x
        # bf16 multiply, whose type promotion runs unvectorised.
        out = q.to(dtype) if out is None else out.copy_(q)
        return out.mul_(scale.to(dtype))


class Fp8Codec(Codec):
    """Real float8 storage (torch.float8_e4m3fn / float8_e5m2) of values divided by their scale.

    Decoding on CPU places each code's bits into a bf16: under the sign, the code's exponent
    becomes the low bits of bf16's wider exponent and its mantissa the top of bf16's, so every
    code, subnormals included, reads as its value times 2^-(127 - bias); one multiply by a power
    of two restores it exactly. Those are integer ops that vectorise, where torch's float8 cast
    runs a scalar conversion per value on a CPU without float8 hardware (several times slower:
    ``python -m scripts.bench_kv --decode``).
    Codes outside the format's finite range (NaN, and e5m2's inf) read as large finite values:
    encoding never writes them (inputs are made finite and clamped to the format's max).
    """

    def __init__(self, name: str, dtype: torch.dtype, exponent_bits: int, bias: int):
        self.name, self.dtype = name, dtype
        self.qmax = float(torch.finfo(dtype).max)
        # the code's 7 - exponent_bits mantissa bits go to the top of bf16's 7
        self.shift = exponent_bits
        # magnitude bits moved up by ``shift`` plus the sign bit, as an int16 mask
        self.mask = (0x8000 | (0x7F << self.shift)) - 0x10000
        self.unbias = 2.0 ** (127 - bias)

    def storage_dtype(self, compute_dtype):
        return self.dtype

    def encode(self, y):
        return y.clamp(-self.qmax, self.qmax).to(self.dtype)

    @staticmethod
    def decodes_by_bits(device: torch.device, dtype: torch.dtype) -> bool:
        """Bit placement on a CPU into bf16; CUDA casts float8 natively."""
        return device.type == "cpu" and dtype == torch.bfloat16

    def place_bits(self, q: torch.Tensor, out: torch.Tensor):
        """``out`` (bf16, q's shape) := each code's value times 2^-(127 - bias), built in place."""
        bits = out.view(torch.int16)
        bits.copy_(q.view(torch.int8))  # sign-extends, so after the shift and the mask bit 15 is the sign
        bits.bitwise_left_shift_(self.shift).bitwise_and_(self.mask)

    def decode(self, q, scale, dtype, out=None):
        if self.decodes_by_bits(q.device, dtype):
            out = torch.empty(q.shape, dtype=dtype) if out is None else out
            self.place_bits(q, out)
            # two multiplies, not one by scale * unbias: that product overflows bf16 for
            # scales >= 2^(bias + 1) (e4m3: amax >= 114,688)
            return out.mul_(self.unbias).mul_(scale.to(dtype))
        if out is not None:
            return torch.mul(q.to(dtype), scale.to(dtype), out=out)
        return q.to(dtype) * scale.to(dtype)  # float8 has no type promotion: cast first


class Int4Codec(Codec):
    """Symmetric 4-bit, qmax 7, two values per byte: byte j holds value j of the head dim in its
    low nibble and value j + dh/2 in its high nibble, so each nibble unpacks into a contiguous
    half: two bit-op passes instead of the table lookup an interleaved layout needs (about
    half the eager decode time at production shapes)."""
    name, qmax, pack = "int4", 7.0, 2

    def storage_dtype(self, compute_dtype):
        return torch.uint8

    def encode(self, y):
        n = (y.round().clamp_(-self.qmax, self.qmax) + 8).to(torch.uint8)
        half = n.shape[-1] // 2
        return n[..., :half] | (n[..., half:] << 4)

    def decode(self, q, scale, dtype, out=None):
        half = q.shape[-1]
        if out is None:
            out = q.new_empty((*q.shape[:-1], 2 * half), dtype=dtype)
        s = scale.to(dtype)
        lo, hi = (s, s) if s.shape[-1] == 1 else (s[..., :half], s[..., half:])  # per-channel scales split too
        torch.mul((q & 15).to(torch.int16).sub_(8).to(dtype), lo, out=out[..., :half])
        torch.mul((q >> 4).to(torch.int16).sub_(8).to(dtype), hi, out=out[..., half:])
        return out


# -- fused kernels (OWL_COMPILE=1) --------------------------------------------------------------
# Eager encoding is ~15 small ops per call and eager decoding several passes over a window
# (cast or bit placement, multiply); torch.compile turns each body into one vectorised loop.
# Codecs are shared instances and policies enter as plain constants, so every layer reuses
# the same compiled graphs; each codec family has its own kernel functions (and so its own
# compile cache).
def stored_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``scale`` rounded to the ``dtype`` it is stored in, kept in fp32: values are
    quantized against the scale exactly as decoding will read it. bf16 rounding (to nearest
    even) is done on the bits, which a compiler cannot fold away as it may a to(bf16).float()
    pair (Inductor does, and compiled and eager codes then disagree)."""
    if dtype == torch.bfloat16:
        bits = scale.view(torch.int32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return scale.to(dtype).float()


def _quantize(x, scale, codec: Codec, count: bool, clips: bool = False):
    """Stored values of frames ``x`` under the fp32 ``scale``, and (when ``count``) how many
    inputs saturated and how many were not finite, as one int64 pair. Only a scale that can
    clip (``clips``: a percentile or an EMA below the frame's amax) saturates anything: amax
    scales bound |x / scale| by qmax up to the scale's rounding, so the count is skipped."""
    xf = x.float()
    y = xf / scale
    # NaN stored as 0; +-inf saturate in every codec's clamp (as nan_to_num's +-max would). y == y,
    # not nan_to_num or isnan: Inductor's CPU code vectorises a comparison, isnan it runs scalar.
    q = codec.encode(torch.where(y == y, y, 0.0))
    if not count:
        return q, None
    nonfinite = (~torch.isfinite(xf)).sum()
    saturated = (y.abs() > codec.qmax * 1.01).sum() if clips else torch.zeros_like(nonfinite)
    return q, torch.stack((saturated, nonfinite))


def _scale_and_quantize(x, codec: Codec, dims: tuple, floor: float, scale_dtype, count: bool):
    """Amax scales over ``dims`` and the stored values in one go (policies without memory)."""
    scale = stored_scale((x.float().abs().amax(dim=dims, keepdim=True) / codec.qmax).clamp_min(floor), scale_dtype)
    return (scale.to(scale_dtype), *_quantize(x, scale, codec, count))


def _int8_decode(q: list[torch.Tensor], scale: list[torch.Tensor], out: list[torch.Tensor]) -> None:
    codec = make_codec("int8")
    for q_i, scale_i, out_i in zip(q, scale, out):
        codec.decode(q_i, scale_i, out_i.dtype, out_i)


# int8 decoding inside compiled code on a CPU without AVX512 calls ATen's kernels through this
# operator, which Inductor leaves as it is: there Inductor's CPU code loads int8 eight bytes at a
# time through a scalar copy (at::vec's partial ``loadu``) and ran the decode 2-2.6x slower than
# ATen; on an AVX512 CPU its own cast ran 3x faster than ATen's (``python -m scripts.bench_kv
# --decode-only``, docs/results.md). The products are the same: one rounding each. The
# operator takes lists, so a layer's K and V cost one call from compiled code.
INT8_DECODE_BY_ATEN = torch.backends.cpu.get_cpu_capability() != "AVX512"
_OPS = torch.library.Library("owl_wms", "DEF")
_OPS.define("int8_decode_cpu(Tensor[] q, Tensor[] scale, Tensor(a!)[] out) -> ()")
_OPS.impl("int8_decode_cpu", _int8_decode, "CPU")
_OPS.impl("int8_decode_cpu", lambda q, scale, out: None, "Meta")


def cast_decode(q, scale, out):
    """``out`` = q x scale as a cast and a multiply, which compiled code fuses into one kernel."""
    out.copy_(q.to(out.dtype) * scale.to(out.dtype))


def scaled_decode(rings: list[tuple]) -> None:
    """Each ring ``(q, scale, out)`` of int8 or float8 values decoded into ``out``: q x scale."""
    by_aten, cast = [], []
    for ring in rings:
        aten = INT8_DECODE_BY_ATEN and ring[0].dtype == torch.int8 and ring[0].device.type == "cpu"
        (by_aten if aten else cast).append(ring)
    if by_aten:
        torch.ops.owl_wms.int8_decode_cpu(*(list(part) for part in zip(*by_aten)))
    for ring in cast:
        cast_decode(*ring)


def _scaled_cast(q, scale, out):
    scaled_decode([(q, scale, out)])


def _int4_unpack(q, scale, out):
    x = q.to(torch.float32)  # float arithmetic vectorises on CPU; byte bit operations do not
    high = torch.floor(x * 0.0625)
    half = q.shape[-1]
    # Each nibble fills its contiguous half of ``out`` directly: a concatenation would make
    # Inductor write an fp32 temporary of the whole window first (several times slower on CPU).
    lo, hi = out.unflatten(-1, (2, half)).unbind(-2)
    s = scale.to(torch.float32)
    s_lo, s_hi = (s, s) if s.shape[-1] == 1 else s.unflatten(-1, (2, half)).unbind(-2)  # per-channel scales split too
    lo.copy_(((x - 16 * high - 8) * s_lo).to(out.dtype))
    hi.copy_(((high - 8) * s_hi).to(out.dtype))


def _encode_int8(*args):
    return _scale_and_quantize(*args)


def _encode_fp8(*args):
    return _scale_and_quantize(*args)


def _encode_int4(*args):
    return _scale_and_quantize(*args)


def _decode_int8(q, scale, out):
    _scaled_cast(q, scale, out)


def _decode_fp8(q, scale, out):
    _scaled_cast(q, scale, out)


def _rescale_fp8(out, scale, unbias: float):
    # times the codec's power of two and the scale in fp32: one rounding (the product of a
    # <= 3-bit and an 8-bit mantissa is exact in fp32), as the cast's single bf16 multiply, and
    # no overflow
    out.copy_((out.float() * unbias * scale.float()).to(out.dtype))


class Fp8Decode:
    """The compiled fp8 decode. Where the codec decodes by bit placement (CPU, bf16), the bits
    are placed eagerly (integer ops vectorise there, while Inductor's bitcasts go value by
    value) and one compiled kernel applies the power of two and the scale; elsewhere one
    compiled cast kernel."""

    def __init__(self, codec_name: str, rescale: Fused, cast: Fused):
        self.codec_name, self.rescale, self.cast = codec_name, rescale, cast

    def one_kernel(self, device: torch.device, dtype: torch.dtype) -> bool:
        return not Fp8Codec.decodes_by_bits(device, dtype)

    def __call__(self, q, scale, out) -> tuple[bool, object]:
        if self.one_kernel(q.device, out.dtype):
            return self.cast(q, scale, out)
        codec = make_codec(self.codec_name)
        codec.place_bits(q, out)
        return self.rescale(out, scale, codec.unbias)  # not done: the eager decode redoes ``out`` whole


def eager_division() -> dict:
    """Inductor options that make compiled fp32 division round like eager's. Triton's ``/`` is an
    approximate division (up to 2 ulp), so on CUDA a compiled ``x / scale`` picked other codes
    than eager at exact rounding ties (seen on an H200: fp8_e5m2 and int4 rings differed).
    The option's name moved between torch releases (the older one is spelled so in torch)."""
    from torch._inductor import config

    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        return {"eager_numerics.division_rounding": True}
    for key in ("emulate_division_rounding", "emulate_divison_rounding"):
        if hasattr(config, key):
            return {key: True}
    return {}


class Fused:
    """A kernel compiled on first use; if the backend cannot compile here, every fused kernel
    falls back to the eager code (always correct) once, with the reason."""
    unavailable: str | None = None  # why compiling failed in this process (shared by all kernels)

    def __init__(self, body):
        self.body, self.kernel = body, None

    def __call__(self, *args) -> tuple[bool, object]:
        """(True, result), or (False, None) with nothing done when kernels are unavailable."""
        if Fused.unavailable is not None:
            return False, None
        try:
            if self.kernel is None:
                # dynamic sizes: one graph serves every layer group, window and frame count
                self.kernel = torch.compile(self.body, dynamic=True, options=eager_division())
            return True, self.kernel(*args)
        except Exception as e:  # noqa: BLE001 - any backend failure: the eager path is always correct
            first = str(e).splitlines()[0] if str(e) else ""
            Fused.unavailable = f"{type(e).__name__}: {first}"[:200]
            warnings.warn(f"[owl] compile: KV encode/decode kernels stay eager ({Fused.unavailable})", stacklevel=2)
            return False, None


_ENCODE_FP8, _DECODE_FP8 = Fused(_encode_fp8), Fused(_decode_fp8)
# codec -> (encode, decode). On this CPU Inductor's e5m2 cast costs more than eager bit placement
# plus a rescale kernel after it (bench_kv's e5m2 decode rows), so e5m2 takes the split decode.
FUSED = {"int8": (Fused(_encode_int8), Fused(_decode_int8)), "fp8_e4m3": (_ENCODE_FP8, _DECODE_FP8),
         "fp8_e5m2": (_ENCODE_FP8, Fp8Decode("fp8_e5m2", Fused(_rescale_fp8), _DECODE_FP8)),
         "int4": (Fused(_encode_int4), Fused(_int4_unpack))}


@functools.lru_cache(maxsize=None)  # codecs hold no state: one shared instance per name
def make_codec(name: str) -> Codec:
    if name == "bf16":
        return PlainCodec()
    if name == "int8":
        return Int8Codec()
    if name == "int4":
        return Int4Codec()
    if name == "fp8_e4m3":
        return Fp8Codec(name, torch.float8_e4m3fn, exponent_bits=4, bias=7)
    if name == "fp8_e5m2":
        return Fp8Codec(name, torch.float8_e5m2, exponent_bits=5, bias=15)
    raise ValueError(f"unknown KV storage codec {name!r}; choose one of {CODECS}")


@dataclass(frozen=True)
class ScalePolicy:
    granularity: str = "token"
    percentile: float | None = None  # e.g. 99.9: clip at this percentile of |x| instead of amax
    ema: float | None = None  # head: momentum of an EMA over frames; None = running max
    smooth: float = 0.0  # temporal smoothing: scale_t = max(scale_t, smooth * scale_{t-1})
    floor: float = 1e-8  # no zero scales (an all-zero frame stays exactly zero)

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"scale granularity {self.granularity!r} is not one of {GRANULARITIES}")
        if self.percentile is not None and not 50 < self.percentile <= 100:
            raise ValueError(f"scale percentile {self.percentile} must be in (50, 100]")
        if self.ema is not None and not 0 <= self.ema < 1:
            raise ValueError(f"scale EMA momentum {self.ema} must be in [0, 1)")
        if not 0 <= self.smooth < 1:
            raise ValueError(f"scale smoothing {self.smooth} must be in [0, 1)")

    @property
    def clips(self) -> bool:
        """Scales can fall below a frame's amax (percentile, EMA), so values can saturate."""
        return self.percentile not in (None, 100) or (self.granularity == "head" and self.ema is not None)

    @property
    def temporal(self) -> bool:
        """Scales depend on earlier frames (sequential over the frames of a write)."""
        return self.granularity == "head" or self.smooth > 0

    @property
    def dims(self) -> tuple[int, ...]:
        """The dims of a frame [b, h, n, tpf, dh] that one scale covers."""
        return {"token": (-1,), "channel": (-2,), "head": (-2, -1)}[self.granularity]

    def scale_shape(self, tpf: int, head_dim: int) -> tuple[int, int]:
        """Per-frame scale shape (the last two dims)."""
        return {"token": (tpf, 1), "channel": (1, head_dim), "head": (1, 1)}[self.granularity]

    def describe(self) -> str:
        parts = [self.granularity]
        if self.granularity == "head":
            parts.append("max" if self.ema is None else f"ema{self.ema:g}")
        if self.percentile is not None:
            parts.append(f"p{self.percentile:g}")
        if self.smooth:
            parts.append(f"smooth{self.smooth:g}")
        return "/".join(parts)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """|x| statistic per scale group of frames x [b, h, n, tpf, dh] (float32)."""
        dims = self.dims
        a = x.abs()
        if self.percentile is None or self.percentile == 100:
            return a.amax(dim=dims, keepdim=True)
        keep = list(a.shape)
        for d in dims:
            keep[d] = 1
        moved = a.movedim(dims, tuple(range(-len(dims), 0))).flatten(-len(dims))
        return torch.quantile(moved, self.percentile / 100, dim=-1).reshape(keep)


class Quantizer:
    """Codec x scale policy for one cached tensor (K or V) of one layer.

    ``encode`` returns stored data and scales for whole frames; temporal policies carry the
    last committed frame's scale in ``prev`` (advanced only when ``commit``). Counters of
    saturated and non-finite inputs accumulate in a tensor: reading them is the only sync.
    """

    def __init__(self, codec: Codec, policy: ScalePolicy, fused: bool = False):
        self.codec, self.policy = codec, policy
        # fused: compiled encode/decode kernels (OWL_COMPILE=1); bf16 has nothing to convert
        self.fused_encode, self.fused_decode = FUSED[codec.name] if fused and codec.qmax is not None else (None, None)
        # policies whose scales come from the frame alone (amax, no memory) encode in one kernel
        self.one_pass = not policy.temporal and policy.percentile in (None, 100)
        self.prev: torch.Tensor | None = None
        self.tally: torch.Tensor | int = 0  # (saturated, non-finite) inputs
        self.count = 0

    @property
    def quantized(self) -> bool:
        return self.codec.qmax is not None

    def describe(self) -> str:
        return self.codec.name if not self.quantized else f"{self.codec.name}/{self.policy.describe()}"

    def reset(self):
        self.prev = None
        self.tally, self.count = 0, 0

    def tally_tensor(self, device: torch.device) -> torch.Tensor:
        """The tally as a tensor on ``device`` (a tensor's own device, so "cuda" never differs
        from "cuda:0"): what a fused kernel takes and returns."""
        if not torch.is_tensor(self.tally) or self.tally.device != device:
            self.tally = torch.zeros(2, dtype=torch.int64, device=device) + self.tally
        return self.tally

    def committed(self, values: int, tally: torch.Tensor | None):
        """Account a committed write of ``values`` inputs (counters describe what entered the cache)."""
        self.count += values
        if tally is not None:
            self.tally = tally

    def scales(self, x: torch.Tensor, commit: bool) -> torch.Tensor:
        p, qmax = self.policy, self.codec.qmax
        raw = self.policy.reduce(x) / qmax  # [b, h, n, *, *]
        if not p.temporal:
            return raw.clamp_min(p.floor)
        out, prev = [], self.prev
        for i in range(raw.shape[2]):  # sequential over frames (n is 1 per generated frame)
            s = raw[:, :, i:i + 1]
            if prev is not None:
                if p.granularity == "head":
                    s = torch.maximum(s, prev) if p.ema is None else p.ema * prev + (1 - p.ema) * s
                if p.smooth:
                    s = torch.maximum(s, p.smooth * prev)
            s = s.clamp_min(p.floor)
            out.append(s)
            prev = s
        if commit:
            self.prev = prev
        return torch.cat(out, dim=2)

    def encode(self, x: torch.Tensor, commit: bool = True, scale_dtype: torch.dtype = torch.bfloat16):
        """x [b, h, n, tpf, dh] -> (stored [b, h, n, tpf, dh/pack], scales or None)."""
        if not self.quantized:
            return self.codec.encode(x), None
        done = False
        if self.fused_encode is not None and self.one_pass:
            done, res = self.fused_encode(x, self.codec, self.policy.dims, self.policy.floor, scale_dtype, commit)
        if done:
            scale, q, counts = res
        else:
            xf = x.float()
            scale = stored_scale(self.scales(xf, commit), scale_dtype)
            q, counts = _quantize(xf, scale, self.codec, commit, self.policy.clips)
            scale = scale.to(scale_dtype)
        if commit:
            self.committed(x.numel(), self.tally + counts)
        return q, scale

    def decode(self, q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, out=None) -> torch.Tensor:
        if self.fused_decode is not None:
            shape = (*q.shape[:-1], q.shape[-1] * self.codec.pack)
            target = out if out is not None else q.new_empty(shape, dtype=dtype)
            if self.fused_decode(q, scale, target)[0]:
                return target
        return self.codec.decode(q, scale, dtype, out)

    def stats(self) -> dict:
        saturated, nonfinite = self.tally.tolist() if torch.is_tensor(self.tally) else (0, 0)
        return {"values": self.count, "saturated": saturated, "nonfinite": nonfinite}

