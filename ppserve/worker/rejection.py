"""Speculative decoding's verification on the last stage: which drafted tokens a request keeps, and the
token after them, with the output distribution exactly that of sampling one token at a time.

Row j of a request is the model's logits after its known tokens and drafts[:j]; its target p_j is what
`sample` would draw from at that output position (penalties and min_tokens with that row's own history,
then temperature, top-k, top-p, min-p). Every row is sampled as `sample` samples it, with the uniform
`sample` uses at that position, and a draft is accepted while it equals its row's sample; the first row
that disagrees emits its sample and ends the request's tokens. For a draft that is a point mass this is
the standard rule in another order: a draft d is accepted with probability p_j(d), and on rejection the
emitted token is distributed as p_j without d, renormalised. Sampling first keeps one more property: a
seeded request's tokens are those it gets without drafts, token for token, whatever was drafted. Greedy
rows are the same rule with the argmax. Every row is sampled on the device at once and read back once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ppserve.request import SamplingParams, TokenLogprob
from ppserve.worker.host_sync import allowed_read
from ppserve.worker.sampler import greedy, penalised_logits, sampled_ids, top_logprobs


def _check(logits: Tensor, params: Sequence[SamplingParams], drafts: Sequence[Sequence[int]],
           output_indices: Sequence[int], histories: Sequence[tuple[Sequence[int], int]] | None) -> None:
    n = len(params)
    if len(drafts) != n or len(output_indices) != n or (histories is not None and len(histories) != n):
        raise ValueError(f"{n} requests but {len(drafts)} draft lists, {len(output_indices)} output positions"
                         + ("" if histories is None else f" and {len(histories)} histories"))
    rows = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != rows:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {n} requests with "
                         f"{rows - n} drafts: each request needs len(drafts) + 1 rows, {rows} in all")
    vocab = logits.shape[1]
    for i, d in enumerate(drafts):
        if any(not 0 <= t < vocab for t in d):
            raise ValueError(f"request {i}'s drafts {list(d)} hold ids outside the vocabulary of {vocab}")


def speculative_sample(logits: Tensor, params: Sequence[SamplingParams], drafts: Sequence[Sequence[int]],
                       output_indices: Sequence[int],
                       histories: Sequence[tuple[Sequence[int], int]] | None = None,
                       stop_ids: Sequence[int] = ()
                       ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Verify each request's drafts: (the tokens each emits: its accepted drafts and one more; one
    log-probability per emitted token from the raw row that produced it, where its params ask for them).

    `logits` [sum(len(d) + 1), V]: request i's len(drafts[i]) + 1 consecutive rows, row j after
    drafts[i][:j]; `output_indices[i]` the output position of its row 0; `histories[i]` (prompt + outputs
    so far, prompt length), needed where penalties or min_tokens apply; `stop_ids` the model's
    end-of-sequence ids. A request with no drafts samples as `sample` does, and a seeded one emits what
    `sample` emits at each position whatever its drafts."""
    _check(logits, params, drafts, output_indices, histories)
    if not params:
        return [], []
    row_params = [sp for sp, d in zip(params, drafts, strict=True) for _ in range(len(d) + 1)]
    row_positions = [o + j for o, d in zip(output_indices, drafts, strict=True) for j in range(len(d) + 1)]
    row_histories = None
    if histories is not None and any(sp.processes_logits for sp in params):
        row_histories = [((*ids, *d[:j]), prompt) if sp.processes_logits else ((), 0)
                         for sp, d, (ids, prompt) in zip(params, drafts, histories, strict=True)
                         for j in range(len(d) + 1)]
    raw = logits
    logits = penalised_logits(logits, row_params, row_histories, stop_ids)
    # The step's one read of the device: every row's test and token (and the logprobs asked for).
    with allowed_read():
        if all(sp.greedy for sp in params):
            emitted = greedy(logits)
        else:
            emitted = sampled_ids(logits, row_params, row_positions).tolist()
        tokens: list[list[int]] = []
        emitting_rows: list[list[int]] = []
        start = 0
        for d in drafts:
            kept = 0
            while kept < len(d) and emitted[start + kept] == d[kept]:
                kept += 1
            rows = list(range(start, start + kept + 1))
            tokens.append([emitted[r] for r in rows])
            emitting_rows.append(rows)
            start += len(d) + 1
        logprobs: list[list[TokenLogprob] | None] = [None] * len(params)
        wanted = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if wanted:
            flat = [r for i in wanted for r in emitting_rows[i]]
            lps = top_logprobs(raw.index_select(0, torch.tensor(flat, dtype=torch.long, device=raw.device)),
                               [emitted[r] for r in flat],
                               [params[i].logprobs or 0 for i in wanted for _ in emitting_rows[i]])
            at = 0
            for i in wanted:
                logprobs[i] = lps[at:at + len(emitting_rows[i])]
                at += len(emitting_rows[i])
    return tokens, logprobs
