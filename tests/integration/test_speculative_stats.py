"""Speculative decoding's figures on a real (tiny) pipeline: the engine's stats, /metrics, GetStats'
conversion, a benchmark run's report and the trace all show the drafts, consistently."""

from __future__ import annotations

import dataclasses

from ppserve import LLM, SamplingParams
from ppserve.bench.harness import replay
from ppserve.bench.report import policy_table
from ppserve.engine.stats import EngineStats
from ppserve.metrics.trace import to_chrome_trace
from ppserve.request import Request
from ppserve.sched import speculation
from ppserve.sched.proposers import Proposer
from ppserve.server import convert
from ppserve.server.cli import format_stats
from ppserve.server.metrics import ServerMetrics
from ppserve.sim.workload import WorkloadRequest
from tests.oracle import random_prompts
from tests.server_helpers import metric_samples

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


class ContinuationProposer(Proposer):
    """Drafts the greedy continuation decoding without drafts gave, every other proposal with its second
    token wrong: drafts accepted in full and in part at every decode (a random tiny model repeats itself
    too rarely for prompt lookup to guarantee any)."""

    def __init__(self, continuation: dict[tuple[int, ...], list[int]]) -> None:
        self.continuation = continuation
        self.calls = 0

    def propose(self, req: Request, k: int) -> list[int]:
        self.calls += 1
        n = len(req.output_token_ids)
        drafts = list(self.continuation.get(tuple(req.prompt_token_ids), [])[n:n + k])
        if len(drafts) > 1 and self.calls % 2 == 0:
            drafts[1] = (drafts[1] + 1) % 256
        return drafts


def test_speculation_shows_in_stats_metrics_reports_and_trace(tiny_llama_dir, monkeypatch) -> None:
    prompts = random_prompts(5, (8, 12, 20))
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_llama_dir), executor="inproc", dtype="float32", block_size=4) as plain:
        outs = plain.generate(prompts, greedy)
    continuation = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs, strict=True)}
    monkeypatch.setattr(speculation, "proposer_for", lambda config: ContinuationProposer(continuation))
    with LLM(str(tiny_llama_dir), executor="inproc", dtype="float32", block_size=4, token_budget=32,
             pipeline_parallel_size=2, speculative_config=SPEC) as llm:
        engine = llm.engine
        llm.generate(prompts, greedy)
        c = engine.stats()
        counters = engine.scheduler.spec.counters
        assert c.spec_decode_num_drafts > 0 and c.spec_decode_num_draft_tokens >= c.spec_decode_num_drafts
        assert 0 < c.spec_decode_num_accepted_tokens < c.spec_decode_num_draft_tokens
        assert sum(c.spec_decode_num_accepted_tokens_per_pos) == c.spec_decode_num_accepted_tokens
        assert c.spec_decode_num_accepted_tokens_per_pos == tuple(counters.accepted_per_pos)
        assert c.spec_decode_mean_acceptance_length == (
            1 + c.spec_decode_num_accepted_tokens / c.spec_decode_num_drafts)

        stats = EngineStats(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
        m = ServerMetrics("tiny")
        m.refresh(stats)
        s = metric_samples(m)
        assert s["ppserve:spec_decode_num_drafts_total{}"] == c.spec_decode_num_drafts
        assert s["ppserve:spec_decode_num_draft_tokens_total{}"] == c.spec_decode_num_draft_tokens
        assert s["ppserve:spec_decode_num_accepted_tokens_total{}"] == c.spec_decode_num_accepted_tokens
        per_pos = {k: v for k, v in s.items()
                   if k.startswith("ppserve:spec_decode_num_accepted_tokens_per_pos_total{")}
        assert len(per_pos) == len(c.spec_decode_num_accepted_tokens_per_pos)
        assert sum(per_pos.values()) == c.spec_decode_num_accepted_tokens
        assert convert.stats_from_proto(convert.stats_to_proto(stats)) == stats
        assert f"speculation  {c.spec_decode_num_drafts} drafts" in format_stats(stats)

        # The trace: the engine's schedule spans and the stages' compute spans of speculated microbatches.
        spans = engine.collect_spans()
        sched = [sp for sp in spans if sp.kind == "schedule" and sp.num_draft_tokens]
        assert sum(sp.num_draft_tokens for sp in sched) == c.spec_decode_num_draft_tokens
        assert sum(sp.num_accepted_tokens or 0 for sp in sched) == c.spec_decode_num_accepted_tokens
        assert {sp.step_id for sp in spans if sp.kind == "compute" and sp.num_draft_tokens} == {
            sp.step_id for sp in sched}
        args = [e["args"] for e in to_chrome_trace(spans)["traceEvents"]
                if e.get("ph") == "X" and e["name"] == "schedule" and "num_draft_tokens" in e["args"]]
        assert len(args) == len(sched) and all("num_accepted_tokens" in a for a in args)

        # A benchmark run's own figures: the difference over the run, in its summary and the printed table.
        run = replay(engine, [WorkloadRequest(0.0, 12, 8), WorkloadRequest(0.0, 20, 8)], prompts[1:],
                     progress=False)
        after = engine.stats()
        d = run.meta["spec_decode"]
        assert d["num_drafts"] == after.spec_decode_num_drafts - c.spec_decode_num_drafts > 0
        assert 0 < d["num_accepted_tokens"] <= d["num_draft_tokens"]
        assert sum(d["num_accepted_tokens_per_pos"]) == d["num_accepted_tokens"]
        assert "mean acceptance length" in policy_table([run.summary()])


def test_stats_without_speculation_are_zero(tiny_llama_dir) -> None:
    with LLM(str(tiny_llama_dir), executor="inproc", dtype="float32", block_size=4) as llm:
        llm.generate(random_prompts(1, (8,)), SamplingParams(max_tokens=4, ignore_eos=True))
        c = llm.engine.stats()
        assert (c.spec_decode_num_drafts, c.spec_decode_num_draft_tokens, c.spec_decode_num_accepted_tokens,
                c.spec_decode_num_accepted_tokens_per_pos) == (0, 0, 0, ())
        assert not c.speculated
