import warnings

import pytest
import torch

from inference.flags import KNOWN, resolve_settings
from owl_wms.settings import Settings, SettingsError


def test_defaults_on_cpu():
    from owl_wms.settings import native_bf16

    s = resolve_settings({}, environ={})
    # auto dtype: bf16 where this CPU computes it natively, fp32 elsewhere (an AVX2 CPU runs bf16 unvectorised)
    assert s.device == "cpu" and s.dtype == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    assert native_bf16("cuda") and resolve_settings({}, environ={"OWL_DTYPE": "bf16"}).dtype == torch.bfloat16
    assert s.attn_backend == "sdpa"
    assert s.attn_backend_decode == "sdpa" and not s.compile and not s.profile_kv and s.seed == 0


def test_env_overrides_config_overrides_defaults():
    s = resolve_settings({"seed": 5, "dtype": "fp32", "attn_backend": "flex"}, environ={"OWL_SEED": "9"})
    assert s.seed == 9 and s.dtype == torch.float32 and s.attn_backend == "flex" and s.attn_backend_decode == "flex"


def test_sdpa_decode_alias():
    s = resolve_settings({}, environ={"OWL_ATTN_BACKEND": "flex", "OWL_ATTN_SDPA_DECODE": "1"})
    assert (s.attn_backend, s.attn_backend_decode) == ("flex", "sdpa")


@pytest.mark.parametrize("flag,value", [("OWL_DTYPE", "fp64"), ("OWL_SEED", "-1"), ("OWL_COMPILE", "maybe"),
                                        ("OWL_ATTN_BACKEND", "xformers"), ("OWL_PROFILE_KV_EVERY", "0"),
                                        ("OWL_DEVICE", "tpu"), ("OWL_TP_REDUCE", "mean"),
                                        ("OWL_RING_ATTENTION", "flash")])
def test_malformed_values_name_flag_value_and_accepted(flag, value):
    with pytest.raises(SettingsError) as err:
        resolve_settings({}, environ={flag: value})
    msg = str(err.value)
    assert flag in msg and repr(value) in msg and "accepted values" in msg


def test_malformed_config_value_names_the_config_key():
    with pytest.raises(SettingsError, match="config inference.attn_backend='nope'"):
        resolve_settings({"attn_backend": "nope"}, environ={})


def test_unknown_flag_warns_and_lists_known():
    with pytest.warns(UserWarning, match="OWL_FP9_KV is not a known OWL_\\* flag") as rec:
        resolve_settings({}, environ={"OWL_FP9_KV": "1"})
    assert all(name in str(rec[0].message) for name in KNOWN)
    assert "did you mean OWL_FP8_KV?" in str(rec[0].message)
    with pytest.warns(UserWarning, match="OWL_FOO is not a known") as rec:  # near only by the shared OWL_
        resolve_settings({}, environ={"OWL_FOO": "1"})
    assert "did you mean" not in str(rec[0].message)


def test_the_app_prints_a_warning_as_one_line_naming_the_nearest_flag(tmp_path):
    """No Python source line or warning class: one line the user can act on."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, time_limit

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWL_")}, "OWL_RING_MOD": "pointer"}
    r = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--frames", "1",
                        "--checkpoint", str(REPO / "checkpoints" / "untrained-tiny"), "--out", str(tmp_path / "x.mp4")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=time_limit(120))
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "OWL_RING_MOD " in x]
    assert len(lines) == 1 and lines[0].startswith("warning: OWL_RING_MOD is not a known OWL_* flag and is ignored "
                                                   "(did you mean OWL_RING_MODE?)")
    assert "UserWarning" not in r.stderr and "resolve_settings(" not in r.stderr


@pytest.mark.parametrize("avx512_bf16,amx,device,dtype,kernel", [
    (True, False, "cpu", "bf16", "matmul"),  # an AMD EPYC: SDPA without AMX tiles ran slower
    (True, True, "cpu", "bf16", "sdpa"),  # an Intel Xeon with AMX
    (False, False, "cpu", "bf16", "sdpa"),
    (True, False, "cpu", "fp32", "sdpa"),
    (True, False, "cuda", "bf16", "sdpa"),
])
def test_the_ring_kernel_follows_the_hardware_unless_chosen(monkeypatch, avx512_bf16, amx, device, dtype, kernel):
    from owl_wms.settings import ring_kernel

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert ring_kernel(device, torch.bfloat16 if dtype == "bf16" else torch.float32) == kernel
    if device == "cpu":
        for name in {"bf16": ("bf16", "bfloat16"), "fp32": ("fp32", "float32")}[dtype]:
            assert resolve_settings({}, environ={"OWL_DTYPE": name}).ring_attention == kernel
    other = "sdpa" if kernel == "matmul" else "matmul"
    s = resolve_settings({"ring_attention": other}, environ={"OWL_RING_MODE": "inplace"})
    assert s.ring_attention == other and f"/ring={other} " in s.describe()  # the start-up line says which
    assert "/ring=" not in resolve_settings({}, environ={"OWL_RING_MODE": "roll"}).describe()  # no ring read in place


def test_settings_are_immutable():
    s = resolve_settings({}, environ={})
    with pytest.raises(Exception):
        s.seed = 3
    assert "seed=0" in s.describe()


def test_the_cache_free_baseline_sets_aside_the_configs_cache_plan():
    s = resolve_settings({"kv_storage": "int8", "ring_mode": "inplace"}, environ={"OWL_KV_CACHE": "none"})
    assert s.kv_cache == "none" and not s.kv.quantized


def test_the_library_names_its_parameters_and_the_apps_respell_them_as_flags():
    from inference.flags import flag_message
    from owl_wms.cache import plan_layers

    from .conftest import tiny_config

    with pytest.raises(SettingsError, match=r"kv_ema='0.5' and kv_storage \(unset\) contradict.*set fp8_kv=1"):
        Settings.parse({"kv_ema": "0.5"})  # library errors use field names...
    with pytest.raises(SettingsError, match=r"OWL_KV_EMA='0.5' and OWL_KV_STORAGE \(unset\) contradict.*OWL_FP8_KV=1"):
        resolve_settings({}, environ={"OWL_KV_EMA": "0.5"})
    kv = resolve_settings({}, environ={"OWL_KV_STORAGE": "int8", "OWL_KV_LATE_LAYERS": "99"}).kv
    with pytest.raises(SettingsError) as err:
        plan_layers(tiny_config(), kv, 4)
    assert str(err.value).startswith("kv_late_layers=99 exceeds")
    assert flag_message(err.value).startswith("OWL_KV_LATE_LAYERS=99 exceeds")  # ...the apps' flags
    with pytest.raises(SettingsError, match="OWL_DEVICE='tpu' is malformed"):
        resolve_settings({}, environ={"OWL_DEVICE": "tpu"})


def test_threads_default_to_the_physical_cores_shared_by_ranks_and_show_in_the_start_up_line(monkeypatch):
    from inference.flags import physical_cores, with_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        s = with_threads(resolve_settings({}, environ={}), ranks=2)
        assert s.threads == max(1, physical_cores() // 2) and torch.get_num_threads() == s.threads
        s = with_threads(resolve_settings({}, environ={"OWL_THREADS": "1"}), ranks=2)
        assert s.threads == 1 and torch.get_num_threads() == 1 and "threads=1 " in s.describe()
    finally:
        torch.set_num_threads(before)


def test_an_empty_flag_is_ignored_with_a_warning_not_read_as_off():
    with pytest.warns(UserWarning, match="OWL_FP8_KV is set but empty and is ignored"):
        s = resolve_settings({"kv_storage": "int8"}, environ={"OWL_FP8_KV": ""})
    assert s.kv.fmt_k == "int8"  # the config's plan stands


def test_omp_num_threads_is_respected_when_owl_threads_is_unset(monkeypatch):
    from inference.flags import with_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert with_threads(resolve_settings({}, environ={}), ranks=1).threads == 1
    finally:
        torch.set_num_threads(before)


def test_threads_follow_the_cores_other_processes_leave_free():
    """CoreBudget gives torch the cores other processes leave free, at least one, re-checked once
    an interval has passed; threads chosen by hand never change."""
    from inference.cores import TICKS, CoreBudget

    clock, ticks = [0.0], [0, 0]  # (system busy, own) ticks

    def advance(seconds, others, own):
        clock[0] += seconds
        ticks[0] += int((others + own) * TICKS * seconds)
        ticks[1] += int(own * TICKS * seconds)

    before = torch.get_num_threads()
    try:
        budget = CoreBudget(2, probe=lambda: tuple(ticks), clock=lambda: clock[0])
        advance(1.0, others=0.05, own=2.0)
        assert budget.check() == 2 and not budget.limited and budget.describe() == ""
        advance(0.5, others=2.0, own=0.5)
        assert budget.check() == 2  # within the interval: not re-measured
        advance(0.6, others=1.9, own=0.1)
        assert budget.check() == 1 and budget.limited and torch.get_num_threads() == 1
        assert "torch ran on 1 thread(s)" in budget.describe() and "busy machine" in budget.describe()
        advance(1.0, others=0.1, own=1.0)
        assert budget.check() == 2 and torch.get_num_threads() == 2 and not budget.limited
        fixed = CoreBudget(2, adaptive=False, probe=lambda: tuple(ticks), clock=lambda: clock[0])
        advance(2.0, others=2.0, own=0.0)
        assert fixed.check() == 2 and not fixed.limited
        server = CoreBudget(2, probe=lambda: tuple(ticks), clock=lambda: clock[0], free_below=0.7)
        advance(1.0, others=1.0, own=1.0)  # a whole busy neighbour takes a core from the server too
        assert server.check() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_window_counts_a_core_taken_sooner_than_the_server():
    """The same half-busy neighbour: the window's budget (free_below 0.3) gives up a core, the
    server's (0.7) keeps both."""
    from inference.cores import TICKS, CoreBudget
    from inference.serve import SERVE_FREE_BELOW

    before = torch.get_num_threads()
    try:
        for free_below, threads in ((0.3, 1), (SERVE_FREE_BELOW, 2)):
            clock, ticks = [0.0], [0, 0]
            budget = CoreBudget(2, probe=lambda: tuple(ticks), clock=lambda: clock[0], free_below=free_below)
            clock[0] += 1.0
            ticks[0] += int(2.0 * TICKS)  # others took half a core, this process 1.5
            ticks[1] += int(1.5 * TICKS)
            assert budget.check() == threads
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cores_are_kept_with_a_warning_naming_the_cores(monkeypatch):
    from inference.flags import physical_cores, with_threads

    before = torch.get_num_threads()
    cores = physical_cores()
    try:
        monkeypatch.setenv("OWL_THREADS", str(cores + 1))
        with pytest.warns(UserWarning, match=rf"OWL_THREADS={cores + 1} gives {cores + 1} threads to this machine's "
                                             rf"{cores} physical cores; .* use at most {cores}"):
            assert with_threads(Settings(threads=cores + 1)).threads == cores + 1
        monkeypatch.delenv("OWL_THREADS")  # the count came from a config: the warning names it
        with pytest.warns(UserWarning, match=rf"config inference.threads={cores + 1} gives {cores + 1} threads"):
            with_threads(Settings(threads=cores + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with_threads(Settings(threads=cores))  # as many as the cores: no warning
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("share,layers", [("quarter", 1), ("HALF", 2), ("three_quarters", 3), ("3", 3)])
def test_late_layers_may_be_a_share_of_the_depth(share, layers):
    """OWL_KV_LATE_LAYERS takes the presets' depth shares as the apps do: half of 4 layers is the last 2."""
    from owl_wms.cache import plan_layers

    from .conftest import tiny_config

    cfg = tiny_config()
    assert cfg.n_layers == 4
    kv = resolve_settings({}, environ={"OWL_KV_STORAGE": "int8", "OWL_KV_LATE_LAYERS": share}).kv
    plans = plan_layers(cfg, kv, 4)
    assert [p.k[0] for p in plans] == ["bf16"] * (4 - layers) + ["int8"] * layers
    with pytest.raises(SettingsError, match=r"OWL_KV_LATE_LAYERS='most' is malformed; accepted values: a layer count "
                                            r"\(an integer >= 1\) or a share of the model's depth \(quarter\|half"):
        resolve_settings({}, environ={"OWL_KV_STORAGE": "int8", "OWL_KV_LATE_LAYERS": "most"})


def test_a_flag_in_lower_case_is_named_and_a_set_aside_config_codec_is_explained():
    with pytest.warns(UserWarning, match="owl_kv_bits is ignored: OWL_\\* flags are read in capitals only; set OWL_KV_BITS"):
        resolve_settings({}, environ={"owl_kv_bits": "4"})
    with pytest.raises(SettingsError, match=r"OWL_K_FP8='0' and OWL_KV_STORAGE \(unset\) contradict.*\(the config's "
                                            r"inference\.kv_storage=int8 steps aside once any KV codec flag is set: add "
                                            r"OWL_KV_STORAGE=int8 to keep it\)"):
        resolve_settings({"kv_storage": "int8"}, environ={"OWL_K_FP8": "0"})
    with pytest.raises(SettingsError, match=r"^OWL_KV_BITS='3' is malformed; accepted values: 8\|4$"):  # its own fault
        resolve_settings({"kv_storage": "int8"}, environ={"OWL_KV_BITS": "3"})
