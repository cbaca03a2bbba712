"""Process-level tuning for CPU inference.

OpenMP threads that spin between parallel regions: a decode step of a small model is a few
hundred short parallel regions (every projection of every layer), and GNU libgomp (torch's
OpenMP runtime on Linux) puts a team's threads to sleep on a futex almost at once when it
manages more threads than the process may use CPUs. A worker always does: torch's pool of the
main thread, which loads the model, and the engine thread's own. On a 2-core machine each
region then paid a futex wake-up, and `tidegate up` answered one stream at 35 tokens/s against
58 with the threads spinning 200,000 times before they sleep and 66 with 20,000 (an AMD EPYC,
the default model). ``spin_between_regions`` asks for the shorter spin (``OMP_WAIT_POLICY=active``
with a bounded ``GOMP_SPINCOUNT``: between steps the threads soon sleep), unless the operator
set either; it must run before torch is imported, when libgomp reads its environment. The
longer spin took the cores from processes beside the worker: the test suite's 10,000-line
batch, run beside another test, took 134 s with it against 43 s before.

glibc's malloc serves large blocks with fresh mmap()s and returns them on free, so every step's
multi-megabyte activations fault their pages in again (thousands of page faults per step). Raising
the mmap and trim thresholds keeps those pages in the heap for reuse: the same effect as
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, applied at run time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("tidegate.worker")

SPIN_COUNT = "20000"  # tens of microseconds of spinning, then sleep

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


def spin_between_regions(environ: dict[str, str] | None = None) -> bool:
    """Set libgomp's wait policy for a worker (module docstring) unless the operator chose one;
    True when set. Too late (False) once torch is imported: libgomp has read it already."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    if environ is None and "torch" in sys.modules:
        log.debug("torch is loaded already: libgomp's wait policy stays as it is")
        return False
    env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"] = "active", SPIN_COUNT
    return True
