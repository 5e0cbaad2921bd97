"""Run-time settings: typed, immutable, checked once. ``Settings.parse`` takes raw values by
field name (a config's ``inference:`` section, or what an app read from its own flags:
inference/flags.py maps the OWL_* environment variables) and names each value in its errors
through ``source``, so an app's message names the flag or config key the user wrote.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch


class SettingsError(ValueError):
    """A setting is malformed or contradicts another; the message names it, the value and the fix.
    ``params``: the field names the message uses, which an app may respell as its own flags."""

    def __init__(self, message: str, params: tuple[str, ...] = ()):
        super().__init__(message)
        self.params = params


class MalformedSetting(SettingsError):
    """A value that is not one of its setting's accepted values (no contradiction with another)."""


def _bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _compile_mode(text: str) -> str:
    t = str(text).strip().lower()
    if t == "auto":
        return t
    return "1" if _bool(t) else "0"


_compile_mode.accepted = "auto|0|1 (or another yes/no word for 0|1)"


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = str(text).strip().lower()
        if t not in options:
            raise ValueError
        return t
    parse.accepted = "|".join(options)
    return parse


def _int(minimum: int, maximum: int = 2**63 - 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(str(text).strip())
        if not minimum <= v <= maximum:
            raise ValueError
        return v
    parse.accepted = f"an integer in [{minimum}, {maximum}]"
    return parse


# kv_late_layers may be a share of the model's depth, resolved when the cache is planned
LATE_SHARES = {"quarter": 0.25, "half": 0.5, "three_quarters": 0.75}


def _late_layers(text: str) -> int | str:
    t = str(text).strip().lower()
    return t if t in LATE_SHARES else _int(1)(t)


_late_layers.accepted = f"a layer count (an integer >= 1) or a share of the model's depth ({'|'.join(LATE_SHARES)})"


def late_layer_count(late: int | str | None, n_layers: int) -> int | None:
    """``kv_late_layers`` as a layer count of an ``n_layers`` model (None: every layer)."""
    if isinstance(late, str):
        return max(1, round(n_layers * LATE_SHARES[late]))
    return late


def _device(text: str) -> str:
    t = str(text).strip().lower()
    if t in ("cpu", "cuda", "auto") or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise ValueError


def _float(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        v = float(str(text).strip())
        if not (lo < v if lo_open else lo <= v) or not v <= hi or v != v:
            raise ValueError
        return v
    parse.accepted = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    return parse


def _ema(text: str):
    t = str(text).strip().lower()
    if t == "max":
        return None  # running max
    v = float(t)
    if not 0 <= v < 1:
        raise ValueError
    return v


def _guard(text: str) -> int:
    """0 off, 1 invariants, checksum[:N] invariants + a float32 shadow for N frames (-> N + 1)."""
    t = str(text).strip().lower()
    if t in ("checksum", "checksum:"):
        return 1 + 16
    if t.startswith("checksum:"):
        n = int(t[9:])
        if n < 1:
            raise ValueError
        return 1 + n
    return int(_bool(t))


_bool.accepted = "0|1 (or true|false)"
_ema.accepted = "max (running max) or an EMA momentum in [0, 1)"
_guard.accepted = "0|1|checksum|checksum:N (N frames of a float32 shadow cache)"
_device.accepted = "cpu|cuda|cuda:N|auto"
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
           "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


def ring_kernel(device: str, dtype: torch.dtype) -> str:
    """The faster kernel of a frame's attention over the in-place ring on this hardware
    (docs/results.md, Ring attention): matmul-softmax-matmul in bf16 on a CPU with AVX512-BF16
    but no AMX (an AMD EPYC), whose SDPA runs without AMX tiles; SDPA elsewhere (on an Intel Xeon
    with AMX it ran faster, as it does in fp32 and on CUDA)."""
    cpu_bf16 = device.startswith("cpu") and dtype == torch.bfloat16
    return "matmul" if cpu_bf16 and torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported() \
        else "sdpa"


def native_bf16(device: str) -> bool:
    """Whether ``device`` computes bf16 at full speed: CUDA, or a CPU with AVX512-BF16 or AMX.
    (scripts.bench_frame on an AVX2 CPU: bf16 matmuls at 1.3 GFLOP/s against 166.6 in fp32.)"""
    if not device.startswith("cpu"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


@dataclass(frozen=True)
class Option:
    field: str
    parse: Callable
    default: object
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("device", _device, "auto", "where the model runs (auto: cuda if available)"),
    Option("dtype", _choice("auto", *_DTYPES), "auto",
           "model and cache dtype (auto: bf16 where the hardware computes it, on CUDA or a CPU with "
           "AVX512-BF16 or AMX; fp32 on other CPUs, where bf16 matmuls run unvectorised)"),
    Option("seed", _int(0), 0, "seed of the noise generator"),
    Option("threads", _int(0, 1024), 0, "CPU threads for torch (0: the machine's physical cores, shared by TP ranks)"),
    Option("decode", _choice("sync", "async"), "sync",
           "async: each frame decodes on a thread beside the generator, which keeps threads - 1 of the threads "
           "(at least 1); the frames are the same (docs/pipeline_parallel.md)"),
    Option("compile", _compile_mode, "auto", "torch.compile the frame call (auto: eager frames at once while it "
           "compiles in the background, then the compiled call; 1: compile before the first frame; 0: never)"),
    Option("frame_graph", _bool, True, "with compile: each generated frame's model call as one graph of the "
           "model as written (over the in-place ring; 0: a graph per block half)"),
    Option("attn_backend", _choice("auto", "sdpa", "flex"), "auto",
         "attention backend (auto: flex on GPU, sdpa on CPU)"),
    Option("attn_sdpa_decode", _bool, False, "use SDPA for per-frame decode"),
    Option("ring_attention", _choice("auto", "sdpa", "matmul"), "auto",
           "kernel of a generated frame's attention over the in-place ring (auto: matmul-softmax-matmul in "
           "bf16 on a CPU with AVX512-BF16 and no AMX, where it ran faster; SDPA elsewhere)"),
    Option("kv_cache", _choice("static", "none"), "static",
         "static: bf16 roll cache; none: recompute without a cache (correctness baseline)"),
    # Quantized cache family (docs/architecture.md, The KV cache); None defaults mean "not set".
    Option("fp8_kv", _bool, None, "quantize the KV cache (storage: kv_storage, default fp8_e4m3)"),
    Option("k_fp8", _bool, None, "0 keeps keys in bf16 while values are quantized"),
    Option("kv_late_layers", _late_layers, None, "quantize only the last N layers (or quarter|half|three_quarters of them)"),
    Option("kv_storage", _choice("bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"), None,
         "storage codec of K and V"),
    Option("kv_bits", _choice("8", "4"), None, "8: int8, 4: int4 (when kv_storage is unset)"),
    Option("kv_fmt_k", _choice("bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"), None,
         "codec of keys (overrides kv_storage)"),
    Option("kv_fmt_v", _choice("bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"), None,
         "codec of values (overrides kv_storage)"),
    Option("kv_scale", _choice("token", "head", "channel"), None,
         "scale granularity (channel: keys per channel, values per token)"),
    Option("kv_ema", _ema, None, "per-head scales: running max or EMA momentum"),
    Option("v_percentile", _float(50, 100, lo_open=True), None,
         "value scales from this percentile of |v| instead of the max"),
    Option("v_per_channel", _bool, None, "per-channel scales for values too"),
    Option("scale_smooth", _float(0, 1), None,
         "temporal smoothing: scale_t = max(scale_t, a * scale_t-1)"),
    Option("ring_mode", _choice("roll", "pointer", "inplace"), None, "cache layout"),
    Option("ring_guard", _guard, None, "check cache invariants (checksum: float32 shadow)"),
    Option("ring_scratch", _bool, None, "pointer layout: gather into preallocated buffers"),
    Option("kv_tail_only", _bool, None, "local layers read only their window"),
    Option("kv_share", _int(1), None, "cross-layer sharing: groups of N layers share K/V"),
    # Cache lifecycle (owl_wms/engine/lifecycle.py) and tensor parallelism (owl_wms/parallel.py).
    Option("kv_recompute_every", _int(0), 0,
         "rebuild the cache from the last W frames every N frames (0: off); positions restart at 0"),
    Option("kv_recompute_anchor", _choice("latent", "decoded"), "latent",
         "what a recompute rebuilds from: generated latents, or decoded frames re-encoded by the VAE"),
    Option("kv_cache_attention_bias", _float(-100, 100), 0.0,
         "soft forgetting: added to the attention logits of cached history keys (0: off)"),
    Option("tp_check_every", _int(1), 16,
         "tensor parallel: compare every rank's lifecycle scalars every N frames"),
    Option("tp_timeout_s", _float(1, 3600), 60.0,
         "tensor parallel: seconds a collective may wait before every rank fails"),
    Option("tp_reduce", _choice("exact", "sum"), "exact",
         "tensor parallel: exact (all-gathers: the single process's numbers to the bit) or sum "
         "(all-reduce of partial sums: one collective fewer, rounding-level differences)"),
    Option("profile_kv", _bool, False, "print per-frame timings and memory"),
    Option("profile_kv_first", _int(0), 3, "profile lines for the first N frames"),
    Option("profile_kv_every", _int(1), 30, "then one profile line every N frames"),
)
BY_FIELD = {o.field: o for o in OPTIONS}
# The cache-plan fields (a config may choose its own default plan; A/B tools compare from bf16 roll).
KV_FIELDS = tuple(o.field for o in OPTIONS if o.field in {
    "fp8_kv", "k_fp8", "kv_late_layers", "kv_storage", "kv_bits", "kv_fmt_k", "kv_fmt_v", "kv_scale", "kv_ema",
    "v_percentile", "v_per_channel", "scale_smooth", "ring_mode", "ring_guard", "ring_scratch", "kv_tail_only",
    "kv_share"})


CODEC_FIELDS = ("fp8_kv", "k_fp8", "kv_storage", "kv_bits", "kv_fmt_k", "kv_fmt_v")


def known_settings(inference: Mapping | None) -> dict:
    """A config's ``inference:`` section, its known settings only; each other key warns by name."""
    inference = dict(inference or {})
    for key in sorted(set(inference) - set(BY_FIELD)):
        warnings.warn(f"config inference.{key} is not a known setting; known: {sorted(BY_FIELD)}", stacklevel=3)
    return {k: v for k, v in inference.items() if k in BY_FIELD}


def without_kv(inference: Mapping | None) -> dict:
    """A config's ``inference:`` section minus its cache plan (so an app's flags alone define it)."""
    return {k: v for k, v in dict(inference or {}).items() if k not in KV_FIELDS}


@dataclass(frozen=True)
class KVSettings:
    """The cache plan's inputs, resolved and checked for contradictions."""
    fmt_k: str = "bf16"
    fmt_v: str = "bf16"
    late_layers: int | str | None = None  # quantize only the last N layers, or a LATE_SHARES name (None: all)
    scale_k: str = "token"
    scale_v: str = "token"
    ema: float | None = None  # per-head scales: None = running max
    v_percentile: float | None = None
    smooth: float = 0.0
    ring_mode: str = "roll"
    guard: int = 0  # 0 off, 1 invariants, N > 1: invariants + float32 shadow for N - 1 frames
    ring_scratch: bool = True
    tail_only: bool = True
    share: int = 1

    @property
    def quantized(self) -> bool:
        return self.fmt_k != "bf16" or self.fmt_v != "bf16"

    @classmethod
    def resolve(cls, v: dict, source: Callable[[str], str], name: Callable[[str], str], kv_cache: str) -> "KVSettings":
        """``v``: parsed values (None = unset); ``source(field)`` names a value and where it came
        from, ``name(field)`` the setting as the user spells it."""
        def clash(fields, why):
            raise SettingsError(" and ".join(source(f) for f in fields) + f" contradict: {why}", tuple(fields))

        storage, bits, fp8 = v["kv_storage"], v["kv_bits"], v["fp8_kv"]
        if storage and bits and storage != {"8": "int8", "4": "int4"}[bits]:
            clash(("kv_storage", "kv_bits"), f"{storage} is not the {bits}-bit integer format; set only one of them")
        base = storage or {"8": "int8", "4": "int4", None: None}[bits] or ("fp8_e4m3" if fp8 else "bf16")
        fmt_k, fmt_v = v["kv_fmt_k"] or base, v["kv_fmt_v"] or base
        if fp8 is False:
            for f in ("kv_storage", "kv_bits", "kv_fmt_k", "kv_fmt_v"):
                if v[f] not in (None, "bf16"):
                    clash(("fp8_kv", f), "the first turns quantization off, the second asks for it")
        if v["k_fp8"] is False:
            if v["kv_fmt_k"] not in (None, "bf16"):
                clash(("k_fp8", "kv_fmt_k"), "keys cannot be both bf16 and quantized")
            fmt_k = "bf16"
        scale = v["kv_scale"] or "token"
        scale_k, scale_v = scale, "token" if scale == "channel" else scale
        if v["v_per_channel"]:
            scale_v = "channel"
        quantized = fmt_k != "bf16" or fmt_v != "bf16"
        if fp8 and not quantized:
            clash(("fp8_kv", *(f for f in ("kv_storage", "kv_fmt_k", "kv_fmt_v") if v[f] == "bf16")),
                  "the first asks for a quantized cache, the rest store K and V in bf16; set only one of them")
        for f in ("kv_scale", "kv_ema", "v_percentile", "v_per_channel", "scale_smooth", "kv_late_layers", "k_fp8"):
            if v[f] is not None and not quantized:
                clash((f, "kv_storage"), "a quantization option is set but K and V are stored in bf16; "
                      f"set {name('fp8_kv')}=1 or {name('kv_storage')}")
        if v["kv_ema"] is not None and "head" not in (scale_k if fmt_k != "bf16" else "", scale_v):
            clash(("kv_ema", "kv_scale"), f"an EMA applies to per-head scales only ({name('kv_scale')}=head)")
        if v["v_percentile"] is not None and fmt_v == "bf16":
            clash(("v_percentile", "kv_fmt_v"), "values are not quantized")
        ring = v["ring_mode"] or "roll"
        if v["ring_scratch"] is not None and ring != "pointer":
            clash(("ring_scratch", "ring_mode"), "scratch buffers belong to the pointer layout")
        if kv_cache == "none":
            for f in ("fp8_kv", "kv_storage", "kv_bits", "kv_fmt_k", "kv_fmt_v", "ring_mode", "ring_guard",
                      "ring_scratch", "kv_tail_only", "kv_share"):
                if v[f] is not None:
                    clash((f, "kv_cache"), "there is no cache to configure")
        return cls(fmt_k=fmt_k, fmt_v=fmt_v, late_layers=v["kv_late_layers"], scale_k=scale_k, scale_v=scale_v,
                   ema=v["kv_ema"], v_percentile=v["v_percentile"], smooth=v["scale_smooth"] or 0.0,
                   ring_mode=ring, guard=v["ring_guard"] or 0,
                   ring_scratch=True if v["ring_scratch"] is None else v["ring_scratch"],
                   tail_only=True if v["kv_tail_only"] is None else v["kv_tail_only"], share=v["kv_share"] or 1)

    def describe(self) -> str:
        parts = [f"layout={self.ring_mode}"]
        if self.quantized:
            parts.append(f"K={self.fmt_k}" + (f"/{self.scale_k}" if self.fmt_k != "bf16" else ""))
            parts.append(f"V={self.fmt_v}" + (f"/{self.scale_v}" if self.fmt_v != "bf16" else ""))
            if self.late_layers:
                parts.append(f"late={self.late_layers}")
        if self.share > 1:
            parts.append(f"share={self.share}")
        if not self.tail_only:
            parts.append("tail_only=0")
        if self.guard:
            parts.append("guard=" + ("1" if self.guard == 1 else f"checksum:{self.guard - 1}"))
        return " ".join(parts)


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    threads: int = 0  # CPU threads torch uses (0: not chosen; apps resolve it to the physical cores)
    decode: str = "sync"  # "async": frames decode on a thread of their own beside the generator
    compile: bool = False  # compile before the first frame (OWL_COMPILE=1)
    compile_background: bool = False  # the apps compile the frame call in the background (OWL_COMPILE=auto)
    frame_graph: bool = True
    attn_backend: str = "sdpa"
    attn_backend_decode: str = "sdpa"
    ring_attention: str = "sdpa"  # RING_KERNELS name of a frame over the in-place ring
    kv_cache: str = "static"
    profile_kv: bool = False
    profile_kv_first: int = 3
    profile_kv_every: int = 30
    kv_recompute_every: int = 0
    kv_recompute_anchor: str = "latent"
    kv_cache_attention_bias: float = 0.0
    tp_check_every: int = 16
    tp_timeout_s: float = 60.0
    tp_reduce: str = "exact"
    kv: KVSettings = KVSettings()

    @classmethod
    def from_config(cls, inference: Mapping | None = None) -> "Settings":
        """Defaults under a config's ``inference:`` section (no flags)."""
        return cls.parse(known_settings(inference), lambda f: f"config inference.{f}")

    @classmethod
    def parse(cls, raw: Mapping, name: Callable[[str], str] | None = None) -> "Settings":
        """Settings from raw values by field name (unnamed fields take their defaults).
        ``name(field)`` is how errors call a field: where its value came from (default: the field)."""
        name = name or (lambda f: f)
        values, said = {}, {}
        for option in OPTIONS:
            if option.field not in raw:
                values[option.field] = option.default
                continue
            value = raw[option.field]
            said[option.field] = f"{name(option.field)}={value!r}"
            try:
                values[option.field] = option.parse(value)
            except (ValueError, TypeError):
                raise MalformedSetting(f"{said[option.field]} is malformed; accepted values: {option.parse.accepted}",
                                       (option.field,)) from None
        return cls._finish(values, lambda f: said.get(f, f"{name(f)} (unset)"), name)

    @classmethod
    def _finish(cls, v: dict, source: Callable[[str], str], name: Callable[[str], str]) -> "Settings":
        device = v["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise SettingsError(f"{source('device')} but no CUDA device is available; use {name('device')}=cpu", ("device",))
        if v["kv_recompute_every"] and v["kv_cache"] == "none":
            raise SettingsError(f"{source('kv_recompute_every')} rebuilds the KV cache, but "
                                f"{source('kv_cache')} runs without one; unset one of them", ("kv_recompute_every", "kv_cache"))
        backend = v["attn_backend"]
        if backend == "auto":
            # FlexAttention is fast only when compiled (Triton); eager it runs an unfused
            # reference that made a CUDA frame ~10x slower than SDPA (measured on an H100).
            backend = "flex" if device.startswith("cuda") and v["compile"] == "1" else "sdpa"
        dtype = v["dtype"] if v["dtype"] != "auto" else "bf16" if native_bf16(device) else "fp32"
        ring = v["ring_attention"] if v["ring_attention"] != "auto" else ring_kernel(device, _DTYPES[dtype])
        if v["decode"] == "async" and v["profile_kv"]:
            raise SettingsError(f"{source('profile_kv')} times each frame's denoise and decode in line, but "
                                f"{source('decode')} decodes beside the generator; unset one of them",
                                ("profile_kv", "decode"))
        return cls(device=device, dtype=_DTYPES[dtype], seed=v["seed"], threads=v["threads"], decode=v["decode"],
                   compile=v["compile"] == "1", compile_background=v["compile"] == "auto", frame_graph=v["frame_graph"],
                   attn_backend=backend, attn_backend_decode="sdpa" if v["attn_sdpa_decode"] else backend,
                   ring_attention=ring,
                   kv_cache=v["kv_cache"], profile_kv=v["profile_kv"],
                   profile_kv_first=v["profile_kv_first"], profile_kv_every=v["profile_kv_every"],
                   kv_recompute_every=v["kv_recompute_every"], kv_recompute_anchor=v["kv_recompute_anchor"],
                   kv_cache_attention_bias=float(v["kv_cache_attention_bias"]),
                   tp_check_every=v["tp_check_every"], tp_timeout_s=float(v["tp_timeout_s"]),
                   tp_reduce=v["tp_reduce"],
                   kv=KVSettings.resolve(v, source, name, v["kv_cache"]))

    @property
    def decode_threads(self) -> int:
        """torch threads of the decoding thread (0: frames decode in line, on the generator's)."""
        return 1 if self.decode == "async" else 0

    @property
    def generator_threads(self) -> int:
        """torch threads of the thread that makes frames: the rest of ``threads``, at least one."""
        return max(1, self.threads - self.decode_threads)

    @property
    def compile_mode(self) -> str:
        return "1" if self.compile else "auto" if self.compile_background else "0"

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return (f"device={self.device} dtype={dtype} seed={self.seed} threads={self.threads or torch.get_num_threads()} "
                + (f"decode=async({self.generator_threads}+{self.decode_threads}) " if self.decode == "async" else "")
                + f"compile={self.compile_mode} "
                + ("frame_graph=0 " if self.compile and not self.frame_graph else "")
                + f"attn={self.attn_backend}/decode={self.attn_backend_decode}"
                + (f"/ring={self.ring_attention} " if self.kv_cache != "none" and self.kv.ring_mode == "inplace" else " ")
                + f"kv_cache={self.kv_cache} "
                + (f"[{self.kv.describe()}] " if self.kv_cache != "none" else "")
                + (f"recompute_every={self.kv_recompute_every}({self.kv_recompute_anchor}) "
                   if self.kv_recompute_every else "")
                + (f"attn_bias={self.kv_cache_attention_bias:g} " if self.kv_cache_attention_bias else "")
                + f"profile_kv={int(self.profile_kv)}")
