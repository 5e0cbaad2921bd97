"""A/B runs: determinism, fault detection by the health metrics, report files, crash handling."""
import csv
import os
import re
import subprocess
import sys

import pytest

from inference.video import count_frames

from .conftest import REPO, time_limit


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ab")
    # The "broken" variant's worker reads values through a NaN scale (tests/faults/sitecustomize.py).
    env = {**os.environ, "TEST_FAULT": "nan_scale@broken", "PYTHONPATH": f"{REPO / 'tests' / 'faults'}:{REPO}"}
    r = subprocess.run([sys.executable, "-m", "scripts.ab_kv", "--frames", "4", "--out", str(out),
                        "--variant", "again:", "--variant", "int8_kv", "--variant", "broken:OWL_RING_MODE=pointer",
                        "--variant", "crash:OWL_KV_BITS=5"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=time_limit(900))
    return r, out


def rows(out):
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_baseline_against_itself_is_identical(ab_run):
    r, out = ab_run
    again = [row for row in rows(out) if row["variant"] == "again"]
    assert len(again) == 4
    assert all(row["psnr_vs_base"] == "inf" and float(row["velocity_drift"]) == 0 for row in again)


def test_a_broken_cache_is_flagged_by_the_health_metrics(ab_run):
    r, out = ab_run
    by = {}
    for row in rows(out):
        by.setdefault(row["variant"], []).append(int(row["unhealthy"]))
    assert sum(by["broken"]) > 0 and sum(by["baseline"]) == 0 and sum(by["int8_kv"]) == 0


def test_report_files_exist_and_parse(ab_run):
    r, out = ab_run
    report = (out / "report.md").read_text()
    for section in ("## Quality", "## Health", "## Speed", "other processes' cores |", "## Memory", "## Variants",
                    "OWL_KV_STORAGE=int8",
                    "machine:", "command: `python -m scripts.ab_kv"):
        assert section in report
    assert {row["variant"] for row in rows(out)} == {"baseline", "again", "int8_kv", "broken"}
    assert "| again 🏆 |" in report  # identical to the baseline: the best of three on quality
    for png in ("psnr_ssim.png", "latency.png", "memory.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert count_frames(out / "int8_kv.mp4") == 4


def test_a_crashing_variant_gives_a_non_zero_exit_and_is_named(ab_run):
    r, out = ab_run
    assert r.returncode == 1
    assert "crash" in r.stdout and "CRASHED: MalformedSetting: OWL_KV_BITS='5' is malformed" in r.stdout
    assert "**crash** crashed: `MalformedSetting" in (out / "report.md").read_text()


def test_bad_variant_specs_are_clear_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "scripts.ab_kv", "--variant", "nope", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=time_limit(120))
    assert r.returncode != 0 and "is neither a preset" in r.stderr and "fp8_v_only" in r.stderr
    r = subprocess.run([sys.executable, "-m", "scripts.ab_kv", "--variant", "x:FP8=1", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=time_limit(120))
    assert r.returncode != 0 and "not FLAG=VALUE with an OWL_* flag" in r.stderr
    r = subprocess.run([sys.executable, "-m", "scripts.ab_kv", "--variant", "typo:OWL_KV_BIT=4", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=time_limit(120))
    assert r.returncode != 0 and "OWL_KV_BIT is not a known OWL_* flag (did you mean OWL_KV_BITS?)" in r.stderr


def test_a_bad_action_file_is_one_line_not_a_traceback(tmp_path):
    from scripts import ab_kv

    (tmp_path / "a.jsonl").write_text('{"mouse": [0, 0], "buttons": [1, 0]}\n')
    for actions, message in (("nowhere.jsonl", "is neither a built-in script"), (str(tmp_path / "a.jsonl"),
                                                                                  "buttons must be 11 values")):
        with pytest.raises(SystemExit, match=f"error: .*{message}"):
            ab_kv.main(["--actions", actions, "--out", str(tmp_path / "ab")])


def test_a_bad_clip_is_one_line_before_anything_runs_or_the_previous_run_is_cleared(tmp_path):
    from scripts import ab_kv

    out = tmp_path / "ab"
    out.mkdir()
    (out / "report.md").write_text("an earlier run's report")
    (tmp_path / "not_a_clip.safetensors").write_text("text")
    for clip, message in (("99", "clip 99 does not exist: world 'maze-world' has 4 clips (0 to 3)"),
                          (str(tmp_path / "nowhere.safetensors"), "does not exist; give a clip .safetensors file"),
                          (str(tmp_path / "not_a_clip.safetensors"), "is not a readable safetensors file")):
        with pytest.raises(SystemExit, match=f"error: --clip .*{re.escape(message)}"):
            ab_kv.main(["--clip", clip, "--frames", "2", "--out", str(out)])
    assert (out / "report.md").read_text() == "an earlier run's report"


def test_a_run_from_a_clip_explains_itself_and_replaces_the_previous_run(ab_run, tmp_path):
    """Into a folder an earlier run wrote: its outputs are cleared (a user's own file stays); from a
    clip there is no simulator, said in words, never as nan or an empty plot; each variant gets a
    one-line verdict naming the cause where one is known (cross-layer sharing)."""
    import shutil

    _, first = ab_run
    out = tmp_path / "ab"
    shutil.copytree(first, out)
    (out / "notes.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "scripts.ab_kv", "--frames", "3", "--clip", "0", "--out", str(out),
                        "--variant", "sharing"], cwd=REPO, capture_output=True, text=True, timeout=time_limit(600))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cleared the" in r.stdout and "nan" not in r.stdout.lower() and "no simulator for a clip" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["ab_kv_outputs.txt", "baseline", "sharing", "sharing.mp4", "notes.txt", "report.md", "metrics.csv",
         "psnr_ssim.png", "latency.png", "memory.png"])
    report = (out / "report.md").read_text()
    assert "## Verdicts" in report and "no simulator for a clip" in report
    assert "cross-layer sharing hands a layer another layer's keys" in report
    assert "🏆" not in report  # one variant beside the baseline: nothing to win
