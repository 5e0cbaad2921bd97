"""inference/heap.py: a process whose heap keeps freed blocks takes no page faults for a large
block freed and allocated again; the environment's own malloc tuning stands."""
import os
import subprocess
import sys

import pytest

from inference.heap import user_tuned_malloc

from .conftest import REPO

# In a fresh process: a 40 MiB block (above the largest threshold glibc sets on its own, 32 MiB)
# allocated, written and freed ten times with glibc's malloc; prints whether the heap was set to
# keep blocks and the minor page faults of the last nine rounds.
ROUNDS = """
import ctypes, resource
from inference.heap import keep_freed_memory
kept = keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_round():
    block = libc.malloc(40 << 20)
    ctypes.memset(block, 1, 40 << 20)
    libc.free(block)
one_round()
before = faults()
for _ in range(9):
    one_round()
print(kept, faults() - before)
"""


def rounds(env_extra: dict) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", ROUNDS], cwd=REPO, env={**env, **env_extra}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                    reason="the heap setting is glibc's (Linux)")
def test_a_kept_heap_reuses_a_freed_block_without_page_faults_and_the_environment_s_tuning_stands():
    kept, faults = rounds({})
    # 40 MiB is 10240 pages: unmapped on free by default, so every round faults them in again
    default_kept, default_faults = rounds({"GLIBC_TUNABLES": "glibc.malloc.check=0"})
    assert kept and not default_kept
    assert faults < 100 < 9 * 10240 // 2 < default_faults


def test_malloc_tuning_in_the_environment_is_the_user_s(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert not user_tuned_malloc()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX2")
    assert not user_tuned_malloc()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert user_tuned_malloc()
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert user_tuned_malloc()
