"""Process-level tuning for CPU inference.

glibc's malloc serves large blocks with fresh mmap()s and returns them on free, so every step's
multi-megabyte activations fault their pages in again (thousands of page faults per step). Raising
the mmap and trim thresholds keeps those pages in the heap for reuse: the same effect as
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, applied at run time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("tidegate.worker")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def keep_large_allocations() -> bool:
    """Tell glibc malloc to keep freed blocks of up to 1 GiB; False where that isn't glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, 4 * _KEEP_BYTES) == 1
    log.debug("malloc thresholds raised: %s", ok)
    return ok
