"""Run-time settings: OWL_* environment variables over the config's ``inference:`` section
over defaults, parsed once into an immutable object. Nothing else reads the environment.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch


class SettingsError(ValueError):
    """A flag or config value is malformed; the message names it, the value and the fix."""


def _bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = str(text).strip().lower()
        if t not in options:
            raise ValueError
        return t
    parse.accepted = "|".join(options)
    return parse


def _int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(str(text).strip())
        if v < minimum:
            raise ValueError
        return v
    parse.accepted = f"an integer >= {minimum}"
    return parse


def _device(text: str) -> str:
    t = str(text).strip().lower()
    if t in ("cpu", "cuda", "auto") or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise ValueError


_bool.accepted = "0|1 (or true|false)"
_device.accepted = "cpu|cuda|cuda:N|auto"
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
           "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class Flag:
    env: str
    field: str
    parse: Callable
    default: object
    help: str


FLAGS: tuple[Flag, ...] = (
    Flag("OWL_DEVICE", "device", _device, "auto", "where the model runs (auto: cuda if available)"),
    Flag("OWL_DTYPE", "dtype", _choice(*_DTYPES), "bf16", "model and cache dtype"),
    Flag("OWL_SEED", "seed", _int(0), 0, "seed of the noise generator"),
    Flag("OWL_COMPILE", "compile", _bool, False, "torch.compile the model"),
    Flag("OWL_ATTN_BACKEND", "attn_backend", _choice("auto", "sdpa", "flex"), "auto",
         "attention backend (auto: flex on GPU, sdpa on CPU)"),
    Flag("OWL_ATTN_SDPA_DECODE", "attn_sdpa_decode", _bool, False, "use SDPA for per-frame decode"),
    Flag("OWL_KV_CACHE", "kv_cache", _choice("static", "none"), "static",
         "static: bf16 roll cache; none: recompute without a cache (correctness baseline)"),
    Flag("OWL_PROFILE_KV", "profile_kv", _bool, False, "print per-frame timings and memory"),
    Flag("OWL_PROFILE_KV_FIRST", "profile_kv_first", _int(0), 3, "profile lines for the first N frames"),
    Flag("OWL_PROFILE_KV_EVERY", "profile_kv_every", _int(1), 30, "then one profile line every N frames"),
)
KNOWN = {f.env: f for f in FLAGS}


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    compile: bool = False
    attn_backend: str = "sdpa"
    attn_backend_decode: str = "sdpa"
    kv_cache: str = "static"
    profile_kv: bool = False
    profile_kv_first: int = 3
    profile_kv_every: int = 30

    @classmethod
    def resolve(cls, inference: Mapping | None = None, environ: Mapping[str, str] | None = None) -> "Settings":
        """defaults < config ``inference:`` section < OWL_* environment variables."""
        environ = os.environ if environ is None else environ
        inference = dict(inference or {})
        by_field = {f.field: f for f in FLAGS}
        for key in sorted(set(inference) - set(by_field)):
            warnings.warn(f"config inference.{key} is not a known setting; known: {sorted(by_field)}", stacklevel=2)
        for name in sorted(k for k in environ if k.startswith("OWL_") and k not in KNOWN):
            warnings.warn(f"{name} is not a known OWL_* flag and is ignored; known flags: {', '.join(KNOWN)}",
                          stacklevel=2)
        values = {}
        for flag in FLAGS:
            raw, source = flag.default, None
            if flag.field in inference:
                raw, source = inference[flag.field], f"config inference.{flag.field}"
            if flag.env in environ:
                raw, source = environ[flag.env], flag.env
            if source is None:
                values[flag.field] = raw
                continue
            try:
                values[flag.field] = flag.parse(raw)
            except (ValueError, TypeError):
                raise SettingsError(f"{source}={raw!r} is malformed; accepted values: {flag.parse.accepted}") from None
        return cls._finish(values)

    @classmethod
    def _finish(cls, v: dict) -> "Settings":
        device = v["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise SettingsError(f"OWL_DEVICE={device!r} but no CUDA device is available; use OWL_DEVICE=cpu")
        backend = v["attn_backend"]
        if backend == "auto":
            backend = "flex" if device.startswith("cuda") else "sdpa"
        return cls(device=device, dtype=_DTYPES[v["dtype"]], seed=v["seed"], compile=v["compile"],
                   attn_backend=backend, attn_backend_decode="sdpa" if v["attn_sdpa_decode"] else backend,
                   kv_cache=v["kv_cache"], profile_kv=v["profile_kv"],
                   profile_kv_first=v["profile_kv_first"], profile_kv_every=v["profile_kv_every"])

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return (f"device={self.device} dtype={dtype} seed={self.seed} compile={int(self.compile)} "
                f"attn={self.attn_backend}/decode={self.attn_backend_decode} kv_cache={self.kv_cache} "
                f"profile_kv={int(self.profile_kv)}")
