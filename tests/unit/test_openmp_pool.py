"""A thread that hands a stage's compute to another frees its OpenMP pool (worker/openmp_pool.py): the
pool's workers exit, so libgomp keeps spinning at the computing thread's barriers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

from ppserve.engine.async_engine import AsyncEngine
from ppserve.worker import openmp_pool
from tests.fake_engine import FakeEngine

# In a fresh interpreter (its OpenMP state is its own): a parallel region on this thread starts a pool
# (one more OS thread at 2 torch threads); releasing it ends that thread, and a next region starts one again.
POOL_PROBE = textwrap.dedent("""
    import os, time, torch
    from ppserve.worker.openmp_pool import loaded_libgomp, release_thread_pool
    torch.set_num_threads(2)
    def threads():
        time.sleep(0.2)  # the pool's workers exit asynchronously
        return len(os.listdir("/proc/self/task"))
    base = threads()
    torch.ones(4_000_000).exp_()  # far above the grain size: a parallel region
    with_pool = threads()
    released = release_thread_pool()
    after = threads()
    torch.ones(4_000_000).exp_()
    again = threads()
    print(loaded_libgomp() is not None, released, base, with_pool, after, again)
""")


def test_loaded_libgomp_reads_the_mapped_runtime(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 fd:00 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 fd:00 2 /venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n")
    assert (openmp_pool.loaded_libgomp(maps)
            == "/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1")
    maps.write_text("7f00-7f01 r-xp 00000000 fd:00 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert openmp_pool.loaded_libgomp(maps) is None
    assert openmp_pool.loaded_libgomp(tmp_path / "absent") is None


def test_release_ends_the_calling_threads_pool() -> None:
    proc = subprocess.run([sys.executable, "-c", POOL_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    has_gomp, released, base, with_pool, after, again = proc.stdout.split()
    if has_gomp != "True":
        pytest.skip("this torch does not run on libgomp: nothing to release")
    assert released == "True"
    assert int(with_pool) == int(base) + 1, "a 2-thread parallel region starts one pool worker"
    assert int(after) == int(base), "the released pool's worker has exited"
    assert int(again) == int(base) + 1, "a later region on the same thread starts a new pool"


def test_async_engine_releases_the_builders_pool_before_its_thread_starts() -> None:
    calls: list[bool] = []

    async def main() -> None:
        eng = AsyncEngine(FakeEngine(max_waiting=4))
        with mock.patch("ppserve.engine.async_engine.release_thread_pool",
                        side_effect=lambda: calls.append(eng._thread is None) or True):
            eng.start()
        try:
            assert calls == [True], "released once, on the building thread, before the engine thread exists"
        finally:
            await asyncio.get_running_loop().run_in_executor(None, eng.stop)

    asyncio.run(main())
