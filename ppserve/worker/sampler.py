"""Logits -> token ids on the last stage: penalties, min_tokens, greedy, temperature, top-k, top-p,
per-request seeds, log-probabilities.

A seeded request draws each token from a generator seeded by (seed, output position), so its
output is reproducible whatever the batch composition or preemption history. Penalties and
min_tokens change a row's logits before it is sampled (the order and the formulas of
transformers' processors, and OpenAI's presence and frequency penalties); log-probabilities are
those of the model's own distribution (a log-softmax of the raw logits, before any of that), the
sampled token's and the k most likely.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ppserve.model import ops
from ppserve.request import SamplingParams, TokenLogprob


def _generator_for(sp: SamplingParams, output_index: int, device: torch.device) -> torch.Generator | None:
    if sp.seed is None:
        return None
    g = torch.Generator(device=device)
    # Mix seed and position so neighbouring positions do not share streams.
    g.manual_seed((sp.seed * 1_000_003 + output_index * 7919) % (2**63 - 1))
    return g


def _filter(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask logits [V] outside top-k and the top-p nucleus with -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        cum_before = torch.cumsum(probs, dim=-1) - probs
        drop = cum_before >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def greedy(logits: Tensor) -> list[int]:
    """Row-wise argmax: the native kernel on CPU float32 (torch's took ~2 ms a step for 37 rows of a 49k
    vocabulary), torch.argmax elsewhere; the same indices either way (first maximum, NaN wins)."""
    return ops.argmax(logits)


def process_logits(logits: Tensor, sp: SamplingParams, token_ids: Sequence[int], num_prompt_tokens: int,
                   stop_ids: Sequence[int]) -> Tensor:
    """One row [V] with the request's penalties and min_tokens applied (a new tensor). `token_ids` are
    the prompt followed by the outputs so far; `stop_ids` the ids min_tokens keeps out (eos, stop ids)."""
    row = logits.clone()
    if sp.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
        vals = row.index_select(0, seen)
        row.index_copy_(0, seen, torch.where(vals < 0, vals * sp.repetition_penalty, vals / sp.repetition_penalty))
    outputs = token_ids[num_prompt_tokens:]
    if (sp.frequency_penalty or sp.presence_penalty) and outputs:
        ids = torch.tensor(outputs, dtype=torch.long, device=row.device)
        counts = torch.zeros_like(row).index_add_(0, ids, torch.ones(len(outputs), dtype=row.dtype, device=row.device))
        row -= counts * sp.frequency_penalty + (counts > 0).to(row.dtype) * sp.presence_penalty
    if len(outputs) < sp.min_tokens and stop_ids:
        row[torch.tensor(list(stop_ids), dtype=torch.long, device=row.device)] = float("-inf")
    return row


def top_logprobs(logits: Tensor, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """For rows of raw logits [N, V]: (log-probability of tokens[i], the ks[i] most likely (id, logprob))."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    k_max = max(ks, default=0)
    top_vals, top_ids = (lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long()))
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    return [(float(chosen[i]), tuple(zip(top_ids_l[i][:k], top_vals_l[i][:k], strict=True)))
            for i, k in enumerate(ks)]


def sample(logits: Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int],
           histories: Sequence[tuple[Sequence[int], int]] | None = None,
           stop_ids: Sequence[int] = ()) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [N, V] float32 -> (N token ids, N log-probabilities or None where not asked for).

    `output_indices[i]` is the position of the token among the request's outputs; `histories[i]` its
    (prompt + outputs, prompt length), needed where penalties or min_tokens apply; `stop_ids` the model's
    end-of-sequence ids (min_tokens also keeps each request's own stop ids out)."""
    if logits.shape[0] != len(params):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} requests")
    raw = logits
    processed = [i for i, sp in enumerate(params) if sp.processes_logits]
    if processed:
        if histories is None:
            raise ValueError("penalties and min_tokens need the requests' token histories")
        logits = logits.clone()
        for i in processed:
            ids, num_prompt = histories[i]
            stops = (*stop_ids, *params[i].stop_token_ids) if not params[i].ignore_eos else params[i].stop_token_ids
            logits[i] = process_logits(logits[i], params[i], ids, num_prompt, stops)
    out = greedy(logits) if logits.shape[0] else []
    for i, sp in enumerate(params):
        if sp.greedy:
            continue
        row = _filter(logits[i].float() / sp.temperature, sp.top_k, sp.top_p)
        probs = torch.softmax(row, dim=-1)
        gen = _generator_for(sp, output_indices[i], logits.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    tokens = [int(t) for t in out]
    wanted = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if wanted:
        rows = raw.index_select(0, torch.tensor(wanted, dtype=torch.long, device=raw.device))
        for i, lp in zip(wanted, top_logprobs(rows, [tokens[i] for i in wanted],
                                              [params[i].logprobs or 0 for i in wanted]), strict=True):
            logprobs[i] = lp
    return tokens, logprobs
