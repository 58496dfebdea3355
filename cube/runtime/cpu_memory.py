"""CPU ranks keep the memory they free, as CUDA's caching allocator does on a GPU.

A training step allocates and frees the same activation and gradient buffers
every micro-batch. glibc's ``malloc`` hands large blocks back to the kernel
(``munmap``, or trimming the top of the heap) as soon as they are free, so the
next micro-batch touches fresh pages and pays a page fault per 4 KiB, each
page zeroed by the kernel: about 2300 faults per micro-batch, 3 to 10% of a
step, on the pipeline benchmark's GPT stage. Schedules that hold tensors
longer (zero-bubble's W keeps each layer's input and output gradient until
its W runs) lose the most. :func:`keep_freed_memory` raises the thresholds,
once per process: every block comes from the heap (``M_MMAP_MAX`` 0: glibc
will not raise its mmap threshold past 32 MiB, and a collective's 64 MiB
result mapped anew each step costs 40 ms of faults), and up to
``TRIM_THRESHOLD`` (2 GiB) of free heap stays with the process. Threads other than the
main one allocate from their own arenas, which still map blocks over 64 MiB. Peak memory does
not grow (the same buffers are reused); memory freed after the peak is kept
rather than returned. ``CUBE_CPU_MALLOC=system`` leaves ``malloc`` as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from cube import config

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20    # glibc's own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = (1 << 31) - 1   # mallopt takes an int: 2 GiB of free heap top kept (a step's buffers)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4   # <malloc.h>
_done = []


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once (Linux with glibc, ``CUBE_CPU_MALLOC`` not ``system``).

    Returns:
        Whether the allocator is now set so (False: another C library, or turned off).
    """
    if _done:
        return _done[0]
    ok = False
    if config.cpu_malloc() == "cache" and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):   # musl and others have no mallopt
            mallopt = None
        if mallopt is not None:
            ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) \
                and bool(mallopt(_M_MMAP_MAX, 0))
    log.debug("cube: CPU malloc keeps freed memory: %s", ok)
    _done.append(ok)
    return ok
