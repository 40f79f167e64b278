"""The one-shot GPU check: `python -m ppserve.gpu_check --out DIR` (or benchmarks/gpu_check.sh).

On one NVIDIA GPU, with the torch already installed and nothing else (no Ray, no flash-attn, no
network), in a few minutes it runs:

1. `environment`  torch, CUDA, the device, Triton and flash-attn, the attention backend `auto` picks;
2. `gpu_tests`    the `gpu`-marked tests (tests/gpu, when run from a checkout);
3. `default_model_pp1`, `default_model_pp2`  the in-process executor on the default model with CUDA
   graphs captured at start-up: greedy bf16 agreement with transformers on the same device, the
   memory figures of every start-up phase, and each stage's decode steps timed by CUDA events against
   wall time;
4. `throughput`   a Llama-3-8B-shaped model with random bf16 weights built from a config (speed, not
   text): prompt and generated tokens per second over a batch of requests.

Every figure goes to DIR/gpu_check.json; a failed phase is recorded with its error and the others still
run (the exit status is 1 if any failed). `--device cpu` runs the same phases on CPU where they do not
need CUDA (CUDA graphs become their eager replay, the random model shrinks to fit): CI runs it that way,
so the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Explain pipeline parallelism to a child.",
    "List five fruits and their colors.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about a river.",
    "What are the main causes of inflation?",
    "Describe how a bicycle works.",
    "Give three tips for learning a language.",
]

# Llama-3-8B's shapes (its config.json), the throughput phase's model on a GPU.
LLAMA3_8B: dict[str, Any] = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 num_hidden_layers=32, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
# The same proportions shrunk for a CPU run (head dim 64, GQA group 4).
LLAMA3_SHRUNK: dict[str, Any] = dict(hidden_size=256, intermediate_size=896, num_attention_heads=4, num_key_value_heads=1,
                     num_hidden_layers=2, vocab_size=4096, rope_theta=500000.0, max_position_embeddings=2048)

# bf16 greedy paths part ways once two logits fall within rounding of each other (tests/integration/
# test_bf16.py): at least half the prompts must agree on their first AGREE_FIRST tokens, and every earlier
# difference must sit where the reference itself is at a near-tie (~2 bf16 steps at logit ~30).
AGREE_FIRST = 4
NEAR_TIE = 0.25


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ppserve.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: every phase that does not need CUDA, on CPU (what CI runs)")
    p.add_argument("--prompts", type=int, default=8, help="chat prompts for the agreement phases (<= 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="greedy tokens generated per prompt")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the throughput model (default: 32 on cuda, 2 on cpu)")
    p.add_argument("--requests", type=int, default=None, help="throughput requests (default: 64 on cuda, 4 on cpu)")
    p.add_argument("--prompt-len", type=int, default=None, help="throughput prompt tokens (default: 512 / 64)")
    p.add_argument("--output-len", type=int, default=None, help="throughput generated tokens (default: 128 / 8)")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(QUESTIONS):
        p.error(f"--prompts must be within 1..{len(QUESTIONS)}")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    return args


class Check:
    """Runs phases, keeps going past failures, and writes what each found."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.report: dict[str, Any] = {"phases": {}}

    def phase(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn()
            result.setdefault("ok", True)
        except Exception as e:  # one broken phase must not hide what the others would find
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        self.report["phases"][name] = result
        shown = {k: v for k, v in result.items() if k not in ("traceback", "stages", "prompts", "output")}
        print(json.dumps(shown, indent=1, default=str), flush=True)
        self.write()

    def write(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "gpu_check.json"
        path.write_text(json.dumps(self.report, indent=1, default=str))
        return path

    @property
    def ok(self) -> bool:
        return all(p.get("ok") or p.get("skipped") for p in self.report["phases"].values())


# ---- phases --------------------------------------------------------------------------------------------
def environment(device: str) -> dict[str, Any]:
    import importlib.util

    import torch

    from ppserve.model.backend_select import select_backend
    from ppserve.model.triton_attention import interpreting, triton_available

    info: dict[str, Any] = {
        "torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
        "triton": triton_available(), "triton_interpreter": interpreting(),
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "ray": importlib.util.find_spec("ray") is not None,
        "auto_attention_backend": select_backend(device).name,
    }
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible; --device cpu runs the phases that do not need one")
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count())
    return info


def gpu_tests(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"skipped": "needs CUDA (the gpu-marked tests skip without it)"}
    root = Path(__file__).resolve().parent.parent
    if not (root / "tests" / "gpu").is_dir():
        return {"skipped": f"no tests/gpu under {root} (run from a checkout)"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/gpu", "tests/integration/test_decode_graphs.py"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "output": tail,
            "summary": tail[-1] if tail else ""}


def _reference_greedy(model_dir: Path, prompts: list[list[int]], got: list[list[int]], max_tokens: int,
                      device: str) -> dict[str, Any]:
    """transformers' greedy generate in bf16 on the same device (the oracle), and how ppserve's tokens
    `got` agree with it: tokens before the first difference, and at each early difference the
    reference's own margin between its token and ppserve's (a near-tie, which two correct bf16
    implementations may break either way, or a clear winner, which would be a bug)."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model = model.to(device).eval()
    agree, margins = [], []
    with torch.inference_mode():
        for ids, g in zip(prompts, got, strict=True):
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                               min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref = y[0, len(ids):].tolist()
            j = next((i for i, (a, b) in enumerate(zip(g, ref, strict=False)) if a != b), min(len(g), len(ref)))
            agree.append(j)
            if j < min(AGREE_FIRST, len(ref)):
                logits = model(torch.tensor([ids + ref[:j]], device=device)).logits[0, -1].float()
                margins.append(round(float(logits[ref[j]] - logits[g[j]]), 4))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    agreeing = sum(a >= min(AGREE_FIRST, max_tokens) for a in agree)
    return {"tokens_before_first_difference": agree, "max_tokens": max_tokens,
            "prompts_agreeing_on_first_tokens": f"{agreeing}/{len(agree)}", "early_difference_margins": margins,
            "ok": agreeing >= len(agree) / 2 and all(m <= NEAR_TIE for m in margins)}


class StepClock:
    """Wraps each stage worker's `execute` and keeps, per stage, the decode-only steps' wall time next
    to the compute time the stage reports (CUDA events on a GPU, the host clock on CPU)."""

    def __init__(self, workers: list[Any]) -> None:
        self.samples: list[list[tuple[float, float]]] = [[] for _ in workers]
        for stage, worker in enumerate(workers):
            self._wrap(worker, stage)

    def _wrap(self, worker: Any, stage: int) -> None:
        inner = worker.execute

        def timed(out: Any, hidden_in: Any = None, inp: Any = None) -> Any:
            t0 = time.perf_counter()
            result = inner(out, hidden_in, inp)
            wall = time.perf_counter() - t0
            if out.num_prefill_tokens == 0 and out.num_decode_tokens > 0:
                self.samples[stage].append((wall, result.compute_s))
            return result

        worker.execute = timed

    def report(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for stage, samples in enumerate(self.samples):
            if not samples:
                rows.append({"stage": stage, "decode_steps": 0})
                continue
            wall = statistics.median(w for w, _ in samples) * 1e3
            event = statistics.median(c for _, c in samples) * 1e3
            rows.append({"stage": stage, "decode_steps": len(samples), "median_wall_ms": round(wall, 3),
                         "median_device_ms": round(event, 3), "host_overhead_ms": round(wall - event, 3)})
        return rows


def default_model(device: str, pp: int, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    from ppserve.engine.llm import LLM
    from ppserve.model.loader import resolve_model
    from ppserve.request import SamplingParams

    model_dir = resolve_model(None)
    graphs = "capture" if device == "cuda" else "eager"  # eager: the static buffers a graph replays, on CPU
    with LLM(None, dtype="bfloat16", executor="inproc", pipeline_parallel_size=pp, cuda_graphs=graphs) as llm:
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)
                   for q in QUESTIONS[:num_prompts]]
        workers = llm.engine.executor.workers
        clock = StepClock(workers)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        got = [o.token_ids for o in outs]
        stages = [{"stage": i, "attention_backend": w.model.attn_backend.name, "block_size": w.block_size,
                   "memory": w.memory_log} for i, w in enumerate(workers)]
        timing = clock.report()
        bubbles = llm.bubble_stats()
    result = _reference_greedy(model_dir, prompts, got, max_tokens, device)
    result.update(generate_s=round(seconds, 2), output_tokens=sum(len(g) for g in got), stages=stages,
                  decode_step_timing=timing, mean_bubble=round(bubbles.mean_bubble_fraction, 3),
                  sample_text=outs[0].text[:160])
    return result


def _random_llama_dir(path: Path, shape: dict[str, Any], layers: int, device: str) -> Path:
    """A Llama with random bf16 weights from a config, saved as an HF directory (no tokenizer: token ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**shape, "num_hidden_layers": layers}, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model: Any = LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def throughput(device: str, layers: int, requests: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    import random

    from ppserve.engine.llm import LLM
    from ppserve.request import SamplingParams

    shape = LLAMA3_8B if device == "cuda" else LLAMA3_SHRUNK
    with tempfile.TemporaryDirectory(prefix="ppserve-gpu-check-") as tmp:
        t0 = time.perf_counter()
        model_dir = _random_llama_dir(Path(tmp) / "llama", shape, layers, device)
        build_s = time.perf_counter() - t0
        rng = random.Random(0)
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(prompt_len)] for _ in range(requests)]
        t0 = time.perf_counter()
        with LLM(str(model_dir), dtype="bfloat16", executor="inproc") as llm:
            start_s = time.perf_counter() - t0
            worker = llm.engine.executor.workers[0]
            llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up (Triton compiles)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
            seconds = time.perf_counter() - t0
            generated = sum(len(o.token_ids) for o in outs)
            memory = worker.memory_log
            backend = worker.model.attn_backend.name
    return {"model": {**shape, "num_hidden_layers": layers, "dtype": "bfloat16", "weights": "random"},
            "attention_backend": backend, "requests": requests, "prompt_len": prompt_len, "output_len": output_len,
            "build_s": round(build_s, 1), "start_s": round(start_s, 1), "generate_s": round(seconds, 2),
            "output_tokens_per_s": round(generated / seconds, 1),
            "total_tokens_per_s": round((generated + requests * prompt_len) / seconds, 1), "memory": memory}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: this run must not use a GPU
    cuda = args.device == "cuda"
    layers = args.layers or (LLAMA3_8B["num_hidden_layers"] if cuda else LLAMA3_SHRUNK["num_hidden_layers"])
    requests = args.requests or (64 if cuda else 4)
    prompt_len = args.prompt_len or (512 if cuda else 64)
    output_len = args.output_len or (128 if cuda else 8)
    check = Check(Path(args.out))
    check.report["device"] = args.device
    check.report["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    check.phase("environment", lambda: environment(args.device))
    if not check.report["phases"]["environment"]["ok"]:
        check.write()
        return 1
    check.phase("gpu_tests", lambda: gpu_tests(args.device))
    for pp in (1, 2):
        check.phase(f"default_model_pp{pp}", functools.partial(default_model, args.device, pp, args.prompts,
                                                               args.max_tokens))
    check.phase("throughput", lambda: throughput(args.device, layers, requests, prompt_len, output_len))
    check.report["ok"] = check.ok
    path = check.write()
    print(f"gpu check {'passed' if check.ok else 'FAILED'}: {path}", flush=True)
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
