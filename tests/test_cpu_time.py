"""tests/cpu_time.py counts a test's own CPU and its children's, and ranks the files."""
import json
import os
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
