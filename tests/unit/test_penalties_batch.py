"""The batched penalties (`sampler.apply_penalties`) equal the per-row loop they replaced, value for
value in float32, on mixed rows: no penalty, each penalty alone and together, min_tokens blocking stop
ids, repeated tokens, empty outputs and histories of different lengths."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ppserve.request import SamplingParams
from ppserve.worker.sampler import apply_penalties


def loop_reference(row: torch.Tensor, sp: SamplingParams, token_ids: Sequence[int], num_prompt: int,
                   stop_ids: Sequence[int]) -> torch.Tensor:
    """The per-row form, as the sampler computed it before (one row, host copies per penalty)."""
    row = row.clone()
    if sp.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
        vals = row.index_select(0, seen)
        row.index_copy_(0, seen,
                        torch.where(vals < 0, vals * sp.repetition_penalty, vals / sp.repetition_penalty))
    outputs = token_ids[num_prompt:]
    if (sp.frequency_penalty or sp.presence_penalty) and outputs:
        ids = torch.tensor(outputs, dtype=torch.long)
        counts = torch.zeros_like(row).index_add_(0, ids, torch.ones(len(outputs), dtype=row.dtype))
        row -= counts * sp.frequency_penalty + (counts > 0).to(row.dtype) * sp.presence_penalty
    if len(outputs) < sp.min_tokens and stop_ids:
        row[torch.tensor(list(stop_ids), dtype=torch.long)] = float("-inf")
    return row


def test_batched_penalties_equal_the_per_row_loop() -> None:
    rng = random.Random(0)
    vocab = 97
    kinds = [SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.4),
             SamplingParams(presence_penalty=-0.7), SamplingParams(min_tokens=5),
             SamplingParams(repetition_penalty=0.8, frequency_penalty=0.2, presence_penalty=0.5,
                            min_tokens=3)]
    for trial in range(20):
        params = [rng.choice(kinds) for _ in range(rng.randint(1, 7))]
        histories = []
        stops = []
        for _ in params:
            prompt = rng.randint(0, 12)
            outputs = rng.randint(0, 9)
            ids = [rng.randrange(min(vocab, 10 + trial)) for _ in range(prompt + outputs)]  # repeats likely
            histories.append((ids, prompt))
            stops.append(tuple(rng.sample(range(vocab), rng.randint(0, 3))))
        logits = torch.randn(len(params), vocab) * 4
        before = logits.clone()
        got = apply_penalties(logits, params, histories, stops)
        want = torch.stack([loop_reference(logits[i], sp, *histories[i], stops[i])
                            for i, sp in enumerate(params)])
        assert torch.equal(got, want), trial
        assert torch.equal(logits, before)  # the input is left as it was
