"""OWL_* environment flags: read once, here at the apps' edge, into typed ``Settings``.

Precedence: defaults < the config's ``inference:`` section < OWL_* flags. Each setting's flag is
OWL_ + its field name in capitals (owl_wms/settings.py lists them with their help), except
tp_timeout_s, whose flag is OWL_TP_TIMEOUT. Errors name the flag or config key the user wrote.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
import warnings
from typing import Mapping

from owl_wms.settings import (CODEC_FIELDS, OPTIONS, MalformedSetting, Settings, SettingsError, known_settings,
                              without_kv)

FLAGS = {o.field: "OWL_TP_TIMEOUT" if o.field == "tp_timeout_s" else f"OWL_{o.field.upper()}" for o in OPTIONS}
KNOWN = {flag: field for field, flag in FLAGS.items()}


def resolve_settings(inference: Mapping | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The run's settings from a config's ``inference:`` section and the environment's OWL_* flags
    (``environ``: os.environ unless given)."""
    environ = os.environ if environ is None else environ
    for name in sorted(k for k, v in environ.items() if k in KNOWN and not str(v).strip()):
        warnings.warn(f"{name} is set but empty and is ignored; give it a value or unset it", stacklevel=2)
    for name in sorted(k for k in environ if k.upper().startswith("OWL_") and not k.startswith("OWL_")):
        warnings.warn(f"{name} is ignored: OWL_* flags are read in capitals only; set {name.upper()} instead",
                      stacklevel=2)
    environ = {k: v for k, v in environ.items() if k.startswith("OWL_") and str(v).strip()}
    inference = known_settings(inference)
    # The codec flags act together: once any is set, the config's codec choice steps aside
    # (OWL_FP8_KV=1 means fp8 even where the config says kv_storage: int8).
    set_aside = {}
    if any(FLAGS[f] in environ for f in CODEC_FIELDS):
        set_aside = {k: v for k, v in inference.items() if k in CODEC_FIELDS and FLAGS[k] not in environ}
        inference = {k: v for k, v in inference.items() if k not in CODEC_FIELDS}
    # OWL_KV_CACHE=none (the cache-free baseline) sets aside the config's whole cache plan.
    if str(environ.get(FLAGS["kv_cache"], "")).strip().lower() == "none":
        inference = without_kv(inference)
    for name in sorted(k for k in environ if k.startswith("OWL_") and k not in KNOWN):
        near = difflib.get_close_matches(name[4:], [k[4:] for k in KNOWN], n=1)  # (every name shares OWL_)
        warnings.warn(f"{name} is not a known OWL_* flag and is ignored"
                      + (f" (did you mean OWL_{near[0]}?)" if near else "") + f"; known flags: {', '.join(KNOWN)}",
                      stacklevel=2)
    raw = dict(inference)
    raw.update({f: environ[flag] for f, flag in FLAGS.items() if flag in environ})
    from_config = {f for f in raw if FLAGS[f] not in environ}
    try:
        return Settings.parse(raw, lambda f: f"config inference.{f}" if f in from_config else FLAGS[f])
    except SettingsError as exc:
        if not set_aside or not set(exc.params) & set(CODEC_FIELDS) or isinstance(exc, MalformedSetting):
            raise  # (a malformed value is the flag's own fault, whatever the config said)
        given = ", ".join(f"inference.{k}={v}" for k, v in set_aside.items())
        flags = " ".join(f"{FLAGS[k]}={v}" for k, v in set_aside.items())
        raise SettingsError(f"{exc} (the config's {given} steps aside once any KV codec flag is set: add {flags} "
                            "to keep it)", exc.params) from None


def warnings_as_lines() -> None:
    """The apps print each warning as one line, ``warning: <message>``, without the source line
    Python's default shows (the message names the flag, the value and the fix)."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        cores, cpu, phys = set(), None, "0"
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = (s.strip() for s in line.partition(":"))
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    phys = value
                elif key == "core id" and cpu in allowed:
                    cores.add((phys, value))
        return max(1, len(cores)) if cores else len(allowed)
    except OSError:
        return max(1, len(allowed))


def with_threads(settings: Settings, ranks: int = 1) -> Settings:
    """``threads`` 0 (not chosen) becomes this machine's physical cores shared by ``ranks``
    processes; torch then uses that many (set once, here at the edge)."""
    import torch

    if settings.threads == 0:  # OMP_NUM_THREADS, where set (torchrun sets it), is torch's choice already
        auto = torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else physical_cores() // ranks
        settings = settings.replace(threads=max(1, auto))
    elif settings.threads * ranks > (cores := physical_cores()):
        # more threads than cores spin against each other: 1000 on 2 cores measured 0.28 FPS against about 25
        said = (f"{FLAGS['threads']}={settings.threads}" if os.environ.get(FLAGS["threads"], "").strip()
                else f"config inference.threads={settings.threads}")  # the flag, or else the config, set it
        warnings.warn(f"{said} gives {settings.threads * ranks} threads to this machine's "
                      f"{cores} physical cores; frames slow down many times over: use at most {max(1, cores // ranks)} "
                      "(or unset it: threads then follow the free cores)", stacklevel=2)
    torch.set_num_threads(settings.generator_threads)  # OWL_DECODE=async: one goes to the decoding thread
    return settings


def flag_message(exc: BaseException) -> str:
    """An engine or cache error about settings, with its parameters (``exc.params``) respelled as
    OWL_* flags."""
    text = str(exc)
    for field in getattr(exc, "params", ()):
        if FLAGS.get(field) and FLAGS[field] not in text and f"inference.{field}" not in text:
            text = re.sub(rf"(?<![\w.]){field}(?==| \(unset\))", FLAGS[field], text)
    return text
