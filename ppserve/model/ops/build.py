"""The native build: ppserve's C kernels (csrc/), compiled on first use with the system C compiler.

Why C and ctypes rather than a torch C++ extension: the kernel needs no torch headers, so it builds in
about a second with no ninja, and the build can happen lazily inside every stage actor
(docs/decisions.md#native-build-ctypes). It runs its loops under OpenMP on the libgomp torch already
loaded, with the thread count torch uses in the calling thread.

The shared object is cached under `model.kernel_cache_dir` (~/.cache/ppserve/kernels), keyed by the
source, the compiler flags, the compiler and the CPU's feature flags (it is built with -march=native).
When no compiler is present or the build fails, `load_library()` returns None and every op falls back
to torch; the reason is logged once. The bindings are in native.py, the dispatch in ops/__init__.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from ppserve.model.ops.settings import current

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parents[1] / "csrc"  # every .c file here goes into one shared object
# -ffast-math lets gcc vectorise the dot-product reductions and expf (libmvec). It is passed to the compile
# step only: linking a shared object with it would pull in crtfastmath, which switches the whole process
# (torch included) to flush-denormals-to-zero when the library loads.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_LINK_LIBS = ["-lmvec", "-lm"]


def kernel_cache_dir() -> Path:
    return current().kernel_cache


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _sources() -> list[Path]:
    return sorted(f for f in _CSRC.iterdir() if f.suffix in (".c", ".h"))


@cache
def library_key(compiler: str | None = None) -> str:
    """What the built library depends on, hashed: its sources, flags, compiler and this CPU's features.
    Also keys what was measured with these kernels (a calibrated partition's stage costs)."""
    compiler = compiler or _compiler()
    try:
        version = "" if compiler is None else subprocess.run([compiler, "--version"], capture_output=True,
                                                             text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # a broken compiler: the build will say so where it matters
        version = f"{compiler}: no version"
    return hashlib.sha256("\0".join([*(f.read_text() for f in _sources()), *_COMPILE_FLAGS, *_LINK_FLAGS,
                                     *_LINK_LIBS, version, _cpu_flags(),
                                     platform.machine()]).encode()).hexdigest()[:16]


def _build(compiler: str) -> Path:
    sources = _sources()
    target = kernel_cache_dir() / f"ppserve_kernels-{library_key(compiler)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename into place: stage actors starting together may all build.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for src in (f for f in sources if f.suffix == ".c"):
            objects.append(str(Path(tmp) / f"{src.stem}.o"))
            _run([compiler, *_COMPILE_FLAGS, "-c", str(src), "-o", objects[-1]])
        lib = Path(tmp) / "ppserve_kernels.so"
        _run([compiler, *_LINK_FLAGS, *objects, "-o", str(lib), *_LINK_LIBS])
        os.replace(lib, target)
    return target


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")


@cache
def load_library() -> ctypes.CDLL | None:
    """The kernels' shared object, or None (logged once) where it cannot be built on this machine."""
    if platform.system() != "Linux" or not current().native:
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: native CPU kernels off, the torch path is used")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable (%s): using the torch path", exc)
        return None


