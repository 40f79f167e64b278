"""The stage's input batch against the metadata built from host lists: over random scheduler traces (small
caches, so preemption recomputes requests and rows are reused), the device block tables kept by diff and
the one-copy upload give every field the backends read, step after step."""

from __future__ import annotations

import random

import pytest
import torch

from ppserve.model.attention import AttentionMetadata
from ppserve.worker.input_batch import InputBatch
from ppserve.worker.staging import StepStaging
from tests.unit.sched_helpers import fake_result, random_scheduler


def reference_meta(batch: InputBatch, out, block_size: int) -> AttentionMetadata:
    tables = [batch.requests[rid].block_ids for rid in out.order]
    ctx = [c + n for c, n in zip(out.num_computed_tokens, out.num_scheduled_tokens, strict=True)]
    return AttentionMetadata.build(list(out.num_scheduled_tokens), ctx, tables, block_size)


@pytest.mark.parametrize("seed", range(4))
def test_device_tables_by_diff_equal_tables_from_lists(seed: int) -> None:
    rng = random.Random(seed)
    s = random_scheduler(rng, pp=1)
    batch = InputBatch(s.blocks.block_size)
    steps = 0
    while s.has_unfinished and steps < 400:
        out = s.schedule()
        if out is None:
            break
        batch.apply(out)
        want = reference_meta(batch, out, s.blocks.block_size)
        got = batch.prepare(out).meta
        for name in ("slot_mapping", "block_tables", "decode_token_idx", "decode_context_lens",
                     "decode_block_tables", "cu_query_lens_t", "cu_context_lens_t"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (steps, name)
        for name in ("query_lens", "context_lens", "cu_query_lens", "decode_seqs", "prefill_seqs",
                     "max_query_len", "max_context_len"):
            assert getattr(got, name) == getattr(want, name), (steps, name)
        s.update_from_output(out,
                             fake_result(out, {rid: rng.randrange(3, 200) for rid in out.sample_request_ids}))
        steps += 1
    assert steps > 10
    assert len(batch.tables.row_of) == len(batch.requests)  # a released request gave its row back


def test_staging_packs_parts_in_order() -> None:
    staging = StepStaging("cpu")
    a, b, c = staging.upload([[1, 2, 3], [], [7]])
    assert a.tolist() == [1, 2, 3] and b.tolist() == [] and c.tolist() == [7]
    assert staging.uploads == 0  # nothing to copy on CPU; on CUDA one upload per call


def test_block_table_rows_and_columns_grow_and_rows_come_back() -> None:
    from ppserve.worker.input_batch import DeviceBlockTables

    t = DeviceBlockTables("cpu", rows=2, width=2)
    rows = [t.assign(f"r{i}") for i in range(5)]
    assert sorted(rows) == list(range(5)) and t.table.shape[0] >= 5
    t.fit_width(9)
    t.apply(torch.tensor([rows[4] * t.table.shape[1] + 8]), torch.tensor([77]))
    assert t.table[rows[4], 8] == 77
    t.release("r4")
    assert t.table[rows[4]].abs().sum() == 0 and t.assign("r9") == rows[4]


@pytest.mark.parametrize("seed", range(3))
def test_drafts_ride_as_a_chunk_of_their_decode(seed: int) -> None:
    """With speculation, a decode's 1 + d positions are one chunk over its KV, every position gets logits,
    and block tables cut after rejected drafts match the scheduler's (the cut columns zeroed), step after
    step."""
    from ppserve.config import SchedulerConfig, SpeculativeConfig
    from ppserve.request import Request, SamplingParams
    from ppserve.sched import Scheduler, StepResult
    from ppserve.sched.proposers import Proposer

    class Random(Proposer):
        def propose(self, req: Request, k: int) -> list[int]:
            return [rng.randrange(3, 50) for _ in range(rng.randrange(0, k + 1))]

    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(token_budget=48, max_num_seqs=8), 60, 4, 256,
                  speculative=SpeculativeConfig(method="ngram", adaptive=False, num_speculative_tokens=5),
                  proposer=Random())
    for i in range(10):
        s.add_request(Request(f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randrange(2, 30))],
                              SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)))
    batch = InputBatch(s.blocks.block_size)
    drafted = 0
    while s.has_unfinished:
        out = s.schedule()
        assert out is not None
        batch.apply(out)
        inp = batch.prepare(out)
        q: list[int] = []
        ctx: list[int] = []
        tables: list[list[int]] = []
        logits = 0
        for rid, n, c in zip(out.order, out.num_scheduled_tokens, out.num_computed_tokens, strict=True):
            assert batch.requests[rid].block_ids == s.requests[rid].block_ids
            q.append(n)
            ctx.append(c + n)
            tables.append(batch.requests[rid].block_ids)
            logits += (n if rid in out.draft_token_ids else 1) if rid in out.sample_request_ids else 0
        want = AttentionMetadata.build(q, ctx, tables, s.blocks.block_size)
        assert inp.meta.query_lens == want.query_lens and inp.meta.context_lens == want.context_lens
        for name in ("block_tables", "decode_block_tables", "slot_mapping"):
            assert torch.equal(getattr(inp.meta, name), getattr(want, name)), name
        assert inp.logits_indices.numel() == logits
        drafted += len(out.draft_token_ids)
        sampled = {rid: rng.randrange(3, 50) for rid in out.sample_request_ids}
        accepted = {rid: rng.randrange(0, len(d) + 1) for rid, d in out.draft_token_ids.items()}
        s.update_from_output(out, StepResult(out.step_id, sampled, num_accepted=accepted))
        s.check_invariants()
    assert drafted > 10
