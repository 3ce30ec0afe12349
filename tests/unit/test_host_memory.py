"""trainers.host_memory: freed heap is kept for the next step instead of being faulted in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainers import host_memory

# A step's pattern in small: 64 MiB of activations in 64 KiB blocks made, written and freed, six times;
# the minor page faults of the last three rounds (glibc's adaptive thresholds have settled by then).
_STEPS = """
import ctypes, json, resource, sys
from trainers.host_memory import hold_freed_heap
how = hold_freed_heap() if sys.argv[1] == "hold" else "glibc's defaults"
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
faults, blocks = [], [0] * 1024  # the list first: grown among the blocks, it would pin the heap below it
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(1024):
        blocks[i] = libc.malloc(2**16)
    for b in blocks:
        ctypes.memset(b, 1, 2**16)
    for b in reversed(blocks):
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"how": how, "faults": sum(faults[-3:])}))
"""


def _faults(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True, env=env
    ).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_held_heap_is_not_faulted_in_again():
    if host_memory._glibc() is None:
        pytest.skip("not glibc")
    default, held = _faults("default"), _faults("hold")
    assert held["how"] == "held"
    pages = 3 * 64 * 2**20 // 4096  # what three rounds fault in when each is handed back
    assert default["faults"] > pages // 2, default  # glibc gives it back, and it comes back zeroed
    assert held["faults"] < pages // 20, held


def test_a_users_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    assert host_memory.hold_freed_heap() == "left to MALLOC_MMAP_THRESHOLD_"
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert host_memory.hold_freed_heap() == "left to GLIBC_TUNABLES"
    host_memory.release_freed_heap()  # harmless whatever was set
