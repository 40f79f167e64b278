"""Fault injection for pipelines (Ray actors or stage processes): signal one stage mid-run, stream the
rest."""

from __future__ import annotations

import os
import signal
import time

from ppserve import LLM, SamplingParams

MAX_NEW = 24  # exactness against transformers is a float32 property: every engine here pins float32


def stage_pid(llm: LLM, stage: int) -> int:
    return next(w.pid for w in llm.engine.executor.describe() if w.stage == stage)


def run_with_kill(llm: LLM, prompts, kill_stage: int | None, kill_after_steps: int,
                  sig: int = signal.SIGKILL):
    """Drive engine.step() ourselves; signal one stage after N steps. Returns streamed tokens per prompt."""
    eng = llm.engine
    sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    streamed: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    steps, killed_at = 0, None
    first_token_after_kill = None
    while eng.has_unfinished:
        deltas = eng.step()
        for d in deltas:
            streamed[d.request_id].extend(d.token_ids)
            if d.finished:
                reasons[d.request_id] = d.finish_reason
        if killed_at is not None and first_token_after_kill is None and any(d.token_ids for d in deltas):
            first_token_after_kill = time.perf_counter() - killed_at
        steps += 1
        if kill_stage is not None and steps == kill_after_steps:
            assert eng.has_unfinished, "kill mid-run"
            os.kill(stage_pid(llm, kill_stage), sig)
            killed_at = time.perf_counter()
    return [streamed[r] for r in ids], [reasons.get(r) for r in ids], first_token_after_kill
