"""Per-test CPU time, to see where the suite's time goes:

    python -m pytest -q -p tests.cpu_time --cpu-times cpu.jsonl
    python -m tests.cpu_time cpu.jsonl          # the files and tests that cost most

Each test's line holds its wall seconds and the CPU seconds of its worker and of the child
processes it ran and reaped (apps, servers, torchrun ranks, the compiler): on a machine whose
cores are all busy, CPU time is what a test costs the others. A server a module's fixture keeps
is counted where it is reaped."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter

import pytest


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="FILE", help="append each test's wall and CPU seconds to FILE (JSON lines)")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_times")
    if not path:
        yield
        return
    (own, children), start = _cpu(), time.perf_counter()
    yield
    own_after, children_after = _cpu()
    with open(path, "a") as f:  # (one line per write: the workers append to one file)
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.perf_counter() - start, 3),
                            "cpu_s": round(own_after - own, 3), "children_cpu_s": round(children_after - children, 3)})
                + "\n")


def read_rows(path: str) -> list[dict]:
    """The lines of a --cpu-times file; a clear exit for a file that is not one."""
    fix = "pass the file pytest's --cpu-times wrote"
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise SystemExit(f"error: {path}: {exc.strerror}; {fix}")
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            raise SystemExit(f"error: {path} line {number}: not a JSON line ({exc.msg}); {fix}")
        if row is None:
            continue
        if not isinstance(row, dict) or not {"test", "wall_s", "cpu_s", "children_cpu_s"} <= row.keys():
            raise SystemExit(f"error: {path} line {number}: not a test's times (test, wall_s, cpu_s, "
                             f"children_cpu_s); {fix}")
        rows.append(row)
    return rows


def main(path: str, top: int = 25) -> None:
    rows = read_rows(path)
    cost = lambda r: r["cpu_s"] + r["children_cpu_s"]  # noqa: E731
    files = Counter()
    for r in rows:
        files[r["test"].split("::")[0]] += cost(r)
    total = sum(files.values())
    print(f"{len(rows)} tests, {total:.0f} CPU seconds ({sum(r['children_cpu_s'] for r in rows):.0f} in child processes)")
    for name, seconds in files.most_common(top):
        print(f"{seconds:8.1f} s  {100 * seconds / total:4.1f}%  {name}")
    print()
    for r in sorted(rows, key=cost, reverse=True)[:top]:
        print(f"{cost(r):8.1f} s CPU {r['wall_s']:7.1f} s wall  {r['test']}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.cpu_time FILE (a --cpu-times file)")
    try:
        main(sys.argv[1])
        sys.stdout.flush()  # here, not at exit, where a closed pipe's error can't be caught
    except BrokenPipeError:  # the report piped into a command that stopped reading (head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
