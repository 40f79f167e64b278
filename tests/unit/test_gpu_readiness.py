"""What a GPU deployment depends on, checked without one: the thread's device, the dtype auto picks, the
CPU kernels kept off CUDA, the KV pool cap, and GPU shares NCCL can run."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from ppserve.engine.placement import resolve_gpus_per_worker
from ppserve.model.ops.settings import KernelSettings
from ppserve.worker import devices
from ppserve.worker.memory import capped_blocks, usable_blocks


def test_every_thread_that_runs_a_step_binds_the_actors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int | None]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((threading.current_thread().name, torch.device(d).index)))
    gpu = torch.device("cuda", 3)

    def step() -> None:  # what a Ray call thread, a compiled graph's loop or the connection reader does
        devices.bind_thread_device(gpu)
        devices.bind_thread_device(gpu)  # the second step on a thread costs nothing

    threads = [threading.Thread(target=step, name=f"t{i}") for i in range(3)]
    for t in threads:
        t.start()
        t.join()
    assert sorted(calls) == [("t0", 3), ("t1", 3), ("t2", 3)]
    devices.bind_thread_device(torch.device("cpu"))  # a CPU worker has nothing to bind
    assert len(calls) == 3


def test_stage_actor_binds_the_device_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from ppserve.worker.stage_actor import StageActor

    bound: list[str] = []
    monkeypatch.setattr(devices, "bind_thread_device",
                        lambda d: bound.append(threading.current_thread().name))
    worker = SimpleNamespace(device=torch.device("cuda", 1), spec=SimpleNamespace(stage=0, tp_rank=0),
                             init_cache=lambda n: None, startup_cost=None)
    actor = StageActor.local(worker, None, None)  # type: ignore[arg-type]
    t = threading.Thread(target=actor.init_cache, args=(8,), name="ray-call")
    t.start()
    t.join()
    assert bound == ["ray-call"]


def test_auto_dtype_on_gpu_is_bf16_for_a_float32_checkpoint() -> None:
    cuda = torch.device("cuda", 0)
    assert devices.resolve_dtype("auto", SimpleNamespace(torch_dtype="float32"), cuda) is torch.bfloat16
    assert devices.resolve_dtype("auto", SimpleNamespace(torch_dtype=None), cuda) is torch.bfloat16
    assert devices.resolve_dtype("auto", SimpleNamespace(torch_dtype="float16"), cuda) is torch.float16
    assert devices.resolve_dtype("float32", SimpleNamespace(torch_dtype="float32"), cuda) is torch.float32
    # On CPU auto is unchanged (float32 where the CPU has no native bf16: the equality tests rely on it).
    cpu = devices.resolve_dtype("auto", SimpleNamespace(torch_dtype="float32"), torch.device("cpu"))
    assert cpu is (torch.bfloat16 if devices.cpu_has_native_bf16() else torch.float32)


def test_cpu_kernels_are_off_in_a_cuda_worker() -> None:
    settings = KernelSettings(native=True, amx=True)
    assert devices.kernel_settings_for(settings, torch.device("cuda", 0)).native is False
    assert devices.kernel_settings_for(settings, torch.device("cpu")) == settings


def test_kv_pool_is_capped_at_what_the_scheduler_can_hold() -> None:
    # The default model on a 141 GB GPU: ~360,000 blocks fit; 256 sequences of 8192 tokens use 131,072.
    assert usable_blocks(256, 8192, 16) == 131_072
    assert capped_blocks(360_000, 256, 8192, 16) == 131_072
    assert capped_blocks(1_000, 256, 8192, 16) == 1_000  # memory is the limit: unchanged
    assert usable_blocks(3, 17, 16) == 6  # a partial block counts whole
    with pytest.raises(ValueError, match="max_num_seqs"):
        usable_blocks(0, 8192, 16)


def test_fractional_gpus_are_refused_where_nccl_links_the_actors() -> None:
    with pytest.raises(ValueError, match="NCCL"):
        resolve_gpus_per_worker(0.5, 8.0, world_size=2)
    with pytest.raises(ValueError, match="whole number"):
        resolve_gpus_per_worker(1.5, 8.0, world_size=4)
    assert resolve_gpus_per_worker(0.5, 8.0, world_size=1) == 0.5  # one actor: no NCCL group
    assert resolve_gpus_per_worker(2, 8.0, world_size=4) == 2.0
    assert resolve_gpus_per_worker(None, 8.0, world_size=8) == 1.0
