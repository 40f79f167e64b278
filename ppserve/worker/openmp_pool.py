"""Free a thread's OpenMP worker pool when it hands a stage's compute to another thread.

GNU libgomp (the OpenMP runtime torch's Linux wheels and ppserve's native kernels share) keeps one pool
of worker threads per thread that has started a parallel region, and counts every pool's threads
together. When that count exceeds the CPUs the process may use, libgomp stops spinning at barriers
(a spin count of 100 instead of 300,000) and its threads sleep and wake through the kernel at every
one of the hundreds of parallel regions a forward pass runs. That is exactly what happens when one
thread builds a stage (loading weights, warming up and timing it run parallel regions) and another
computes with it: the engine thread of `ppserve serve` behind the event loop's thread, a Ray stage
actor's loop thread behind the thread that ran its set-up calls: on a small machine that doubles a decode
step (ARCHITECTURE.md#the-life-of-a-microbatch; docs/decisions.md#release-openmp-pool).

`release_thread_pool()` calls `omp_pause_resource_all(omp_pause_soft)` on the libgomp already loaded,
which in libgomp frees the calling thread's pool (its workers exit and leave the count); a later
parallel region on that thread simply starts a new one. Where the process has no libgomp loaded (Intel's
runtime, macOS, a torch built without OpenMP) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t's omp_pause_soft


def loaded_libgomp(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the libgomp this process has loaded (torch's wheel may ship its own, renamed), or None."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and Path(parts[-1]).name.startswith("libgomp"):
            return parts[-1]
    return None


@cache
def _pause_fn() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    path = loaded_libgomp()
    if path is None:
        logger.debug("no libgomp loaded: OpenMP pools are not released")
        return None
    try:
        # RTLD_NOLOAD: the library already mapped, never a second copy of the runtime.
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError) as e:  # libgomp older than GCC 9 has no omp_pause_resource_all
        logger.debug("%s: cannot release OpenMP pools (%s)", path, e)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; True when libgomp did. Call it on the thread that
    built a stage, when another thread takes over its compute, never inside a parallel region."""
    fn = _pause_fn()
    if fn is None:
        return False
    status = int(fn(OMP_PAUSE_SOFT))
    if status != 0:
        logger.debug("omp_pause_resource_all returned %d", status)
    return status == 0
