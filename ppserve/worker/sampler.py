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


def _filter_rows(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Rows [N, V] with each row's top-k (k <= 0: all) and then top-p nucleus kept, the rest -inf.
    One sort for the whole batch. Ties with the k-th value stay, and the nucleus is the smallest sorted
    prefix whose mass reaches top_p (the token crossing it stays)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    cum_before = torch.cumsum(probs, dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(cum_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


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


def _race(logits: Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]) -> Tensor:
    """Scores [N, V] whose row-wise argmax is each row's token: the logits for greedy rows; for sampled
    rows the filtered probabilities divided by Exp(1) noise (an exponential race: argmax p_i / E_i is a
    draw from p). So every row of the batch is decided on the device in one argmax, and the sampled
    ids cross to the host in one transfer, with no per-request sync (torch.multinomial + .item() was
    one sync per sampled request). A seeded row draws its noise from its own generator, seeded by
    (seed, output position): reproducible whatever else shares the batch."""
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if not rows:
        return logits
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    temperature = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=device)
    top_k = torch.tensor([params[i].top_k for i in rows], dtype=torch.long, device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=device)
    picked = _filter_rows(logits.index_select(0, index).float() / temperature[:, None], top_k, top_p)
    probs = torch.softmax(picked, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for j, i in enumerate(rows):
        gen = _generator_for(params[i], output_indices[i], device)
        if gen is not None:
            noise[j].exponential_(generator=gen)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero draw would make 0/0 = NaN, which argmax picks
    scores = logits.float().clone()
    scores.index_copy_(0, index, probs / noise)
    return scores


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
    tokens = greedy(_race(logits, params, output_indices)) if logits.shape[0] else []
    wanted = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if wanted:
        rows = raw.index_select(0, torch.tensor(wanted, dtype=torch.long, device=raw.device))
        for i, lp in zip(wanted, top_logprobs(rows, [tokens[i] for i in wanted],
                                              [params[i].logprobs or 0 for i in wanted]), strict=True):
            logprobs[i] = lp
    return tokens, logprobs
