"""tests/cpu_time.py counts a test's own CPU and its children's, and ranks the files."""
import json
import os
import shlex
import subprocess
import sys

from .conftest import REPO


def test_cpu_times_count_a_tests_child_processes_and_rank_the_files(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import subprocess, sys\n"
        "def test_spins_a_child():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(i * i for i in range(3_000_000))'], check=True)\n"
        "def test_does_nothing():\n"
        "    pass\n")
    times = tmp_path / "cpu.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_time", "--cpu-times", str(times),
                          "test_two.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r["test"]: r for r in map(json.loads, times.read_text().splitlines())}
    spins, nothing = rows["test_two.py::test_spins_a_child"], rows["test_two.py::test_does_nothing"]
    assert spins["children_cpu_s"] > 0.05 and nothing["children_cpu_s"] == 0
    assert spins["wall_s"] >= spins["children_cpu_s"] * 0.5 and nothing["cpu_s"] < 0.5
    report = subprocess.run([sys.executable, "-m", "tests.cpu_time", str(times)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0 and "2 tests," in report.stdout and "test_two.py::test_spins_a_child" in report.stdout


def test_the_report_names_a_file_that_is_not_a_times_file_and_stops_quietly_when_its_reader_does(tmp_path):
    def report(path, pipe_into=None, unbuffered=""):
        command = [sys.executable, "-m", "tests.cpu_time", str(path)]
        if pipe_into is None:
            return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
        env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
        return subprocess.run(f"set -o pipefail; {shlex.join(command)} | {pipe_into}", shell=True, executable="/bin/bash",
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    missing = report(tmp_path / "none.jsonl")
    assert missing.returncode == 1 and "none.jsonl: No such file" in missing.stderr
    (tmp_path / "bad.jsonl").write_text('{"test": "a", "wall_s": 1, "cpu_s": 1, "children_cpu_s": 0}\nnot json\n')
    bad = report(tmp_path / "bad.jsonl")
    assert bad.returncode == 1 and "bad.jsonl line 2: not a JSON line" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n')
    other = report(tmp_path / "other.jsonl")
    assert other.returncode == 1 and "line 1: not a test's times" in other.stderr
    rows = [{"test": f"tests/test_{i}.py::test_{i}", "wall_s": 1, "cpu_s": 1, "children_cpu_s": i} for i in range(5000)]
    (tmp_path / "many.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for buffered in ("", "1"):  # a reader that stops at once, as `| head` does after its lines
        piped = report(tmp_path / "many.jsonl", pipe_into="true", unbuffered=buffered)
        assert piped.returncode == 0 and "Error" not in piped.stderr, piped.stderr
