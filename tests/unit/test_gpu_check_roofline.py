"""The roofline phase's schedule arithmetic and its sweep points (ppserve/gpu_check/roofline.py), and the
prompts every timed run draws (ppserve/gpu_check/prompts.py): no torch, no device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ppserve.config import SchedulerConfig
from ppserve.gpu_check.prompts import FIRST_TOKEN, PromptSource
from ppserve.gpu_check.roofline import decode_max_tokens, measured, plan, prefill_steps, token_budget
from ppserve.sched.cost import BatchShape
from ppserve.sim import SimConfig, WorkloadRequest, simulate


@dataclass
class ShapeRecorder:
    """A one-stage cost model that keeps every microbatch's (prefill tokens, decode tokens)."""

    num_stages: int = 1
    shapes: list[tuple[int, int]] = field(default_factory=list)

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        self.shapes.append((shape.num_prefill_tokens, shape.num_decode_tokens))
        return 1e-3 + 1e-6 * shape.num_tokens

    def transfer_time(self, shape: BatchShape) -> float:
        return 0.0


def full_decode_steps(batch: int, prompt: int, budget: int, max_tokens: int) -> int:
    """Decode-only microbatches of all `batch` requests when the engine's own scheduler (pp 1, as the
    roofline phase runs it) gets them at once."""
    cost = ShapeRecorder()
    config = SimConfig(scheduler=SchedulerConfig(token_budget=budget, max_num_seqs=batch),
                       max_model_len=prompt + max_tokens + 16)
    simulate([WorkloadRequest(0.0, prompt, max_tokens) for _ in range(batch)], cost, config)
    return sum(1 for pf, dc in cost.shapes if pf == 0 and dc == batch)


@pytest.mark.parametrize("cuda", [True, False])
def test_every_batch_of_the_plan_decodes_all_together_for_its_steps(cuda: bool) -> None:
    p = plan(cuda)
    budget = token_budget(p)
    for b in p["batches"]:
        max_tokens = decode_max_tokens(b, p["prompt"], budget, p["decode_steps"])
        # decode_steps timed, and one more whose time would come back with a step that never runs.
        assert full_decode_steps(b, p["prompt"], budget, max_tokens) >= p["decode_steps"] + 1, b


def test_the_former_fixed_max_tokens_never_decodes_128_together() -> None:
    """512-token prompts under a 2,048-token budget: B=128 takes ~33 microbatches to prefill, and requests
    of 24 tokens finish before the last prompt is in."""
    assert full_decode_steps(128, 512, 2048, 24) == 0
    assert prefill_steps(128, 512, 2048) > 24


def test_prefill_steps_bound() -> None:
    assert prefill_steps(1, 512, 2048) == 1
    assert prefill_steps(4, 512, 2048) == 2  # 3 decodes may sit beside the chunks: 2,045 prompt tokens a step
    assert prefill_steps(256, 512, 2048) == -(-256 * 512 // (2048 - 255))
    with pytest.raises(ValueError, match="no prompt tokens"):
        prefill_steps(9, 16, 8)


class FakeEngine:
    def __init__(self, unfinished: list[str]) -> None:
        self.unfinished = list(unfinished)
        self.cancelled: list[str] = []

    def unfinished_ids(self) -> list[str]:
        return list(self.unfinished)

    def cancel(self, rid: str) -> bool:
        self.cancelled.append(rid)
        self.unfinished.remove(rid)
        return True


class FakeLLM:
    def __init__(self, unfinished: list[str]) -> None:
        self.engine = FakeEngine(unfinished)


def test_a_failed_point_keeps_its_error_and_leaves_an_idle_engine() -> None:
    llm = FakeLLM(["r7", "r8"])

    def fails() -> dict[str, Any]:
        raise RuntimeError("no decode-only microbatch of 256 sequences")

    assert measured(llm, {"batch": 32}, lambda: {"steps": 16}) == {"batch": 32, "steps": 16}
    point = measured(llm, {"batch": 256}, fails)
    assert point == {"batch": 256, "error": "RuntimeError: no decode-only microbatch of 256 sequences"}
    assert llm.engine.cancelled == ["r7", "r8"] and not llm.engine.unfinished


def test_prompts_of_one_source_never_share_a_first_block() -> None:
    p = plan(True)
    source = PromptSource(128256, seed=0)
    runs = [source.draw([p["prompt"]] * b) for b in p["batches"]]
    runs += [source.draw([n] * p["repeats"]) for n in p["prefill"]]
    prompts = [q for run in runs for q in run]
    assert [len(run) for run in runs] == p["batches"] + [p["repeats"]] * len(p["prefill"])
    assert len({q[0] for q in prompts}) == len(prompts)  # a distinct first token: a distinct first block
    assert all(FIRST_TOKEN <= t < 128256 for q in prompts for t in q)
    assert PromptSource(512, seed=3).draw([8, 2]) == PromptSource(512, seed=3).draw([8, 2])  # seeded
    small = PromptSource(FIRST_TOKEN + 2, seed=0)
    small.draw([4, 4])
    with pytest.raises(ValueError, match="first tokens left"):
        small.draw([4])
