"""Start-up steps of a Ray pipeline are bounded by parallel.startup_timeout_s, named when it runs out."""

from __future__ import annotations

import time

import pytest

from ppserve.config import load_config
from ppserve.engine.ray_executor import RayExecutor


def test_a_slow_start_up_step_names_the_setting(ray_session):
    import ray

    executor = RayExecutor.__new__(RayExecutor)  # only the bound start-up wait, no pipeline
    executor.startup_timeout_s = load_config(
        overrides=["parallel.startup_timeout_s=0.2"]).parallel.startup_timeout_s

    @ray.remote(num_cpus=0)
    def slow() -> int:
        time.sleep(30)
        return 1

    ref = slow.remote()
    with pytest.raises(TimeoutError,
                       match=r"loading weights took longer than parallel\.startup_timeout_s=0\.2 s"):
        executor._startup_get([ref], "loading weights")
    ready, _ = ray.wait([ref], timeout=0)
    assert not ready  # the bound gave up on the step: it did not wait for the step to end
    ray.cancel(ref, force=True)
