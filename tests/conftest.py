"""Shared fixtures: one Ray instance for the session, tiny random checkpoints, the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep CPU tests deterministic and polite on a 2-core machine.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU, Triton kernels (the triton_paged attention backend) run under Triton's interpreter. It
# must be chosen before anything imports triton (transformers may, via torch): triton.language's own
# helpers (tl.sum, tl.max) are built as interpreted or compiled functions when first imported, and a
# kernel cannot mix the two. On a GPU the kernels run compiled, as in production.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every test that builds a pipeline (starting Ray costs seconds)."""
    import ray

    from ppserve.engine.ray_executor import ray_single_machine_mode

    if not ray.is_initialized():
        # Logical CPUs may exceed physical ones: a 2-core machine hosts 4-actor pipelines.
        with ray_single_machine_mode():  # loopback only, like ppserve's embedded Ray
            ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.model_helpers import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "llama", num_layers=4, hidden=64, heads=4,
                               kv_heads=2)


@pytest.fixture(scope="session")
def default_model_conversion() -> tuple[Path, bool]:
    """SmolLM2-135M-Instruct converted once into the user cache (tests share it), and whether this session
    made that conversion (a cold cache, as on a fresh install): then it is this checkout's code's own
    output, which tests/integration/test_loader.py checks instead of converting a second time."""
    from ppserve.model.loader import default_cache_dir, resolve_model

    cache = default_cache_dir()
    before = set(cache.iterdir()) if cache.is_dir() else set()
    path = resolve_model(None)
    return path, path not in before


@pytest.fixture(scope="session")
def default_model_dir(default_model_conversion: tuple[Path, bool]) -> Path:
    """SmolLM2-135M-Instruct converted once into the user cache (tests share it)."""
    return default_model_conversion[0]
