"""Host memory between training steps: keep what glibc malloc frees for the next step, instead of handing it
back to the kernel and faulting it in again.

On a CPU torch has no caching allocator: each step mallocs its activations in forward and frees them in
backward. glibc gives the free top of its heap back to the kernel whenever it exceeds the trim threshold
(by default adaptive: twice the largest mmapped block freed so far), and the next step's forward faults
the same pages in again, zeroed by the kernel. Whether a step does so depends on where the heap's live
blocks happen to lie, so it varies from step to step and from process to process: on the benchmark's
reference model it was 3-14k minor page faults per step (12-55 MiB; up to 27 ms of kernel time per step
on one thread, more with two, whose threads wait for each other), and the Trainer's process drew more of
them than the plain loop's (bench/README.md). `hold_freed_heap` fixes both thresholds, as torch's CUDA
caching allocator keeps freed blocks for the next step: blocks up to 32 MiB come from the heap and its
free top is kept; `release_freed_heap` hands what is free back once, when the steps are done.
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
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    user = [k for k in _USER_SETTINGS if k in os.environ] + (
        ["GLIBC_TUNABLES"] if "malloc" in tunables else []
    )
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
