"""Host memory between training steps: keep what glibc malloc frees for the next step, instead of handing it
back to the kernel and faulting it in again.

On a CPU torch has no caching allocator: each step mallocs its activations in forward and frees them in
backward, and glibc gives the heap's free top back to the kernel past its adaptive trim threshold, so the next
forward faults the same pages in again, zeroed (on the benchmark's model 3-14k minor faults a step, up to
27 ms, varying from step to step and process to process: bench/README.md). `hold_freed_heap` fixes both
thresholds, as torch's CUDA caching allocator keeps freed blocks; `release_freed_heap` hands back what is
free once the steps are done.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "hold_freed_heap", "release_freed_heap"]

MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (HEAP_MAX_SIZE / 2), also the ceiling of its adaptive one
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: a free heap top of up to 2 GiB is kept
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
# A user's own malloc settings win (e.g. bench/run.py's fixed-mmap-threshold diagnostic).
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _glibc() -> ctypes.CDLL | None:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        return ctypes.CDLL("libc.so.6")
    except (ValueError, OSError, AttributeError):  # not Linux/glibc (macOS, musl)
        return None


def hold_freed_heap() -> str:
    """Keep freed heap memory in the process (see the module's docstring). Returns "held", or why not:
    not glibc, or the malloc settings the environment already makes (left as they are)."""
    user = [k for k in _USER_SETTINGS if k in os.environ]
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"left to {user[0]}"
    libc = _glibc()
    if libc is None:
        return "not glibc"
    # The mmap threshold first: setting either one stops glibc adapting both.
    if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return "held"
    return "refused by mallopt"


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the kernel now (the thresholds stay as `hold_freed_heap` set them)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
