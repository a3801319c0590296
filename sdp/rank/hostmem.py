"""Host memory between steps: keep the C allocator from handing freed activations back to the kernel.

Why: a CPU training step allocates and frees the same activation bytes every step. glibc's malloc
returns large freed blocks to the kernel (``munmap`` above its mmap threshold, heap trimming above
its trim threshold, both adjusted at run time from the allocation history), so the next step touches
fresh pages and pays a page fault (and the kernel's zeroing) for every 4 KiB again. How much depends on
the process's allocation history, not on the step: measured on the harness benchmark
(``benchmarks/harness_overhead.py``, ResNet-18 width 32, 2 gloo ranks) the suite's DDP step took
15 000-19 000 minor faults against 4 000-5 000 in a minimal loop doing the same arithmetic, which was
most of its step-time gap. Fixing both thresholds (``mallopt``) keeps freed blocks below 32 MiB (glibc's
largest allowed mmap threshold) in the heap for reuse; larger blocks are still mapped per use.

Only glibc on Linux; elsewhere (musl, macOS, a preloaded jemalloc/tcmalloc answering ``mallopt`` with 0)
nothing changes and :func:`retain_freed_memory` says so. Peak RSS is unaffected (a peak is a peak);
the RSS between steps stays at the step's high-water mark instead of dropping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = 2**30  # trim only when more than 1 GiB at the heap top is free


def retain_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when both were accepted."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
