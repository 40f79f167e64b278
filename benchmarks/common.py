"""Shared helpers of the step-efficiency benchmark: workload files, model FLOPs, latency and memory figures.

Standard library only, so the vLLM runner (its own virtual environment, without ppserve) can use it
too. The prompt text comes from ppserve.bench.prompts (the one home of benchmark prompts).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def trace_prompt_lengths(path: str | Path, n: int, scale: float) -> list[int]:
    """Prompt lengths of the first `n` rows of a request trace (arrived_at, num_prefill_tokens, ...),
    scaled."""
    import csv
    import itertools

    with open(path, newline="", encoding="utf-8") as f:
        rows = [int(r["num_prefill_tokens"]) for r in itertools.islice(csv.DictReader(f), n)]
    if len(rows) < n:
        raise ValueError(f"{path} has {len(rows)} rows, {n} requested")
    return [max(1, round(x * scale)) for x in rows]


@dataclass(frozen=True)
class ModelShape:
    """What FLOP counting needs from a Llama-family config."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        return cls(
            int(cfg["num_hidden_layers"]),
            int(cfg["hidden_size"]),
            int(cfg["intermediate_size"]),
            heads,
            int(cfg.get("num_key_value_heads") or heads),
            int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            int(cfg["vocab_size"]),
        )

    @property
    def linear_params_per_layer(self) -> int:
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return qkv + o + mlp


def workload_flops(shape: ModelShape, prompt_lens: Sequence[int], output_len: int) -> float:
    """Model FLOPs to serve the workload once, with logits only where a token is due.

    Each request computes prompt_len + output_len - 1 tokens (the last sampled token is never fed back);
    a token at position p costs 2 * linear params (per layer) plus 4 * heads * head_dim * (p + 1) for the
    causal QK^T and PV products, and each of the output_len sampled tokens one LM-head GEMV (2 * V * H).
    """
    per_token_linear = 2 * shape.linear_params_per_layer * shape.num_layers
    attn_per_pos = 4 * shape.num_heads * shape.head_dim * shape.num_layers
    total = 0.0
    for plen in prompt_lens:
        n = plen + output_len - 1
        total += n * per_token_linear
        total += attn_per_pos * n * (n + 1) / 2  # sum over positions p of (p + 1)
        total += output_len * 2 * shape.vocab * shape.hidden
    return total


@dataclass
class EngineResult:
    """One engine's figures on one workload; what every runner prints as JSON."""

    engine: str
    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    mean_ttft_s: float
    mean_tbt_s: float
    p99_tbt_s: float
    peak_rss_mib: float
    extra: dict[str, Any]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def latency_figures(start: float, token_times: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """(mean TTFT, mean TBT, p99 TBT) from each request's token timestamps; every request arrived at
    `start`."""
    ttft = [t[0] - start for t in token_times if t]
    gaps = [b - a for t in token_times for a, b in zip(t, t[1:], strict=False)]
    p99 = sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
    return (statistics.fmean(ttft) if ttft else 0.0, statistics.fmean(gaps) if gaps else 0.0, p99)


def peak_rss_mib(pids: Sequence[int] | None = None, with_children: bool = True) -> float:
    """Sum of peak resident memory (VmHWM) of the given processes (default: this one) and, optionally,
    of all their live descendants (engine-core or worker processes)."""
    roots = list(pids) if pids else [os.getpid()]
    seen: set[int] = set()
    todo = list(roots)
    children = _children_map() if with_children else {}
    total_kib = 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total_kib += _vm_hwm_kib(pid)
        todo.extend(children.get(pid, ()))
    return total_kib / 1024


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the parenthesised command name
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def save_workload(path: Path, prompts: list[list[int]], output_len: int, model_dir: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"prompts": prompts, "output_len": output_len, "model_dir": model_dir}))


def load_workload(path: Path) -> tuple[list[list[int]], int, str]:
    d = json.loads(Path(path).read_text())
    return d["prompts"], int(d["output_len"]), d["model_dir"]


# ---------------------------------------------------------------------------------------------
# Seeded prompts and a tiny MoE checkpoint (bench_moe.py; no benchmark imports from tests/)
# ---------------------------------------------------------------------------------------------


def random_prompts(seed: int, lengths: Sequence[int], vocab: int = 256) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths (ids from 3 up: clear of the special ones).
    The same ids as the test suite's oracle gives for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_tiny_qwen3_moe_dir(path: Path, *, hidden: int, intermediate: int, expert_intermediate: int,
                            num_layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                            vocab: int = 256, experts: int = 8, top_k: int = 2,
                            dense_layers: Sequence[int] = (), seed: int = 0) -> Path:
    """Save a random-weight Qwen3-MoE as a real HF directory (`dense_layers` keep a dense MLP): the same
    weights as the test suite's tiny Qwen3-MoE for the same arguments. Needs torch and transformers."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, head_dim=head_dim, intermediate_size=intermediate,
        moe_intermediate_size=expert_intermediate, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, mlp_only_layers=list(dense_layers))
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # peaked logits; routers sharp enough to pick distinct experts
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.15)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path, save_original_format=True)
    return Path(path)


# ---------------------------------------------------------------------------------------------
# Driving an engine step by step (analysis_step_time.py, analysis_step_profile.py)
# ---------------------------------------------------------------------------------------------

CHUNK = 256  # the prompt chunk a mixed step adds beside the decodes


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def run_until_decoding(eng: Any, rids: list[str], max_steps: int = 200) -> None:
    """Step until every request in `rids` has its first token (prefill done)."""
    have: set[str] = set()
    for _ in range(max_steps):
        have.update(r for r in eng.step() if r in rids)
        if have >= set(rids):
            return
    raise RuntimeError("prefill did not finish")


def drain(eng: Any, rids: list[str]) -> None:
    eng.abort(rids)
    while eng.busy():
        eng.step()


def timed_step(eng: Any) -> tuple[float, dict[str, int]]:
    t0 = time.perf_counter()
    gained = eng.step()
    return (time.perf_counter() - t0) * 1e3, gained
