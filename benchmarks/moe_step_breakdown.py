"""Where a decode step's milliseconds go, ppserve (pp=1, in process) against transformers `generate`,
per phase.

Each phase is a function or module `forward` wrapped in a timer that counts its exclusive time (a phase
called inside another is subtracted from the outer one), switched on only while measuring. A decode-only
figure is a run of N new tokens less a run of 1 (the prefill), best of `repeats`, divided by N - 1.
The timers add ~1 us per call, to both sides alike, and `restore` takes them out again. Used by
`bench_moe.py --parts breakdown`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


class PhaseTimers:
    """Exclusive seconds per phase name; several functions may share one name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._children: list[float] = []
        self._wrapped: list[tuple[Any, str, Any]] = []
        self.on = False

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[phase] += elapsed - self._children.pop()
                if self._children:
                    self._children[-1] += elapsed

        self._wrapped.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        """Put back what `wrap` replaced (an attribute the owner only inherited is removed again)."""
        for owner, attr, original in reversed(self._wrapped):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._wrapped.clear()

    def measure(self, run: Callable[[int], object], new_tokens: int, repeats: int) -> dict[str, Any]:
        """Milliseconds per decode step: the wall time and each phase, best of `repeats`."""
        best: tuple[float, dict[str, float]] | None = None
        for _ in range(repeats):
            self.on = True
            self.seconds.clear()
            start = time.perf_counter()
            run(1)
            prefill_wall, prefill = time.perf_counter() - start, dict(self.seconds)
            self.seconds.clear()
            start = time.perf_counter()
            run(new_tokens)
            wall = time.perf_counter() - start - prefill_wall
            self.on = False
            phases = {name: s - prefill.get(name, 0.0) for name, s in self.seconds.items()}
            if best is None or wall < best[0]:
                best = (wall, phases)
        assert best is not None
        steps = new_tokens - 1
        wall, phases = best
        per_step = {name: 1e3 * s / steps for name, s in sorted(phases.items(), key=lambda kv: -kv[1])}
        per_step["(outside the timed calls)"] = 1e3 * (wall - sum(phases.values())) / steps
        return {"step_ms": 1e3 * wall / steps, "phases_ms": per_step}


def ppserve_timers() -> PhaseTimers:
    import ppserve.engine.llm_engine as llm_engine
    import ppserve.model.attention as attention
    import ppserve.model.layers as layers
    import ppserve.model.moe as moe
    import ppserve.model.qwen3 as qwen3
    import ppserve.sched.scheduler as scheduler
    import ppserve.worker.stage_worker as stage_worker

    timers = PhaseTimers()
    for owner, attr, phase in [
        (llm_engine.LLMEngine, "step", "engine: the rest of a step (core, executor, output processing)"),
        (scheduler.Scheduler, "schedule", "scheduler: schedule"),
        (scheduler.Scheduler, "update_from_output", "scheduler: update_from_output"),
        (stage_worker.StageWorker, "prepare", "stage: prepare (apply the diff, input batch)"),
        (stage_worker.StageWorker, "_forward", "model: the rest (rope cos/sin, layer loop)"),
        (layers.VocabParallelEmbedding, "forward", "model: embedding"),
        (layers.RMSNorm, "forward", "model: RMS norms (incl. q/k norms)"),
        (layers.RMSNorm, "add_and_norm", "model: RMS norms (incl. q/k norms)"),
        (qwen3.Qwen3Attention, "forward", "attention: rope, reshapes"),
        (layers.QKVParallelLinear, "forward", "attention: qkv / o projections"),
        (layers.RowParallelLinear, "forward", "attention: qkv / o projections"),
        (attention.SdpaBackend, "forward", "attention: KV write + attention"),
        (attention.CpuPagedBackend, "forward", "attention: KV write + attention"),
        (moe.SparseMoeBlock, "forward", "MoE: block glue"),
        (moe.TopKRouter, "forward", "MoE: router (linear, softmax, top-k)"),
        (moe.moe_ops, "experts", "MoE: experts (sort, matmuls, unsort, weighted sum)"),
        (layers.ParallelLMHead, "logits_on_first_rank", "LM head"),
        (stage_worker, "sample", "sampler"),
        (stage_worker.StageWorker, "_sample", "stage: sampling glue"),
    ]:
        timers.wrap(owner, attr, phase)
    return timers


def transformers_timers(model: torch.nn.Module) -> PhaseTimers:
    """Class-level timers for the Qwen3-MoE classes, instance-level for `model`'s linear layers."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as hf

    timers = PhaseTimers()
    for owner, attr, phase in [
        (hf.Qwen3MoeForCausalLM, "forward", "model: the rest (causal-LM wrapper, masks, rope)"),
        (hf.Qwen3MoeAttention, "forward", "attention: rope, reshapes, KV cache, attention"),
        (hf.Qwen3MoeRMSNorm, "forward", "model: RMS norms (incl. q/k norms)"),
        (hf.Qwen3MoeTopKRouter, "forward", "MoE: router (linear, softmax, top-k)"),
        (hf.Qwen3MoeExperts, "forward", "MoE: experts (sort, matmuls, unsort, weighted sum)"),
        (hf.Qwen3MoeSparseMoeBlock, "forward", "MoE: block glue"),
    ]:
        timers.wrap(owner, attr, phase)
    inner: Any = model.model
    timers.wrap(model.lm_head, "forward", "LM head")
    timers.wrap(inner.embed_tokens, "forward", "model: embedding")
    for layer in inner.layers:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            timers.wrap(getattr(layer.self_attn, proj), "forward", "attention: qkv / o projections")
    return timers

