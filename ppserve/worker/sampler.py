"""Logits -> token ids on the last stage: penalties, min_tokens, greedy, temperature, top-k, top-p,
min-p, per-request seeds, log-probabilities.

Each step pays only for what its requests ask (ARCHITECTURE.md#the-life-of-a-microbatch):
- greedy rows: a row-wise argmax of the logits, bit-exact;
- temperature alone: one softmax-like pass and an inverse-CDF draw from one uniform per row, found in
  two levels (a block of 256 tokens, then a token in it): nothing sorted, no noise over the vocabulary;
- top-k (with or without top-p): torch.topk of the largest k the batch asks for, then top-p over those;
- top-p without top-k: the nucleus threshold from a histogram of mass over the probabilities' float
  bits (a radix search with no sort on a GPU; one round and a sort of one bin on a CPU);
- min-p: a mask of the tokens below min_p times the most likely one's probability.
Rows are grouped by what they ask; within a group every row's parameters are tensors: no Python loop
over rows and no host sync until the one transfer of the chosen ids.

A seeded request's uniform is a counter-based hash of (seed, output position), on the device: its output
is reproducible whatever the batch or preemption history. Penalties and min_tokens follow transformers'
processors (and OpenAI's presence and frequency penalties), filters transformers' order; log-probabilities
are the model's own (a log-softmax of the raw logits), the sampled token's and the k most likely.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ppserve.model import ops
from ppserve.request import SamplingParams, TokenLogprob
from ppserve.worker.host_sync import allowed_read

BLOCK = 256  # tokens per block of the two-level inverse CDF: 49,152 tokens are 192 blocks

# splitmix64's constants as signed int64 (torch has no unsigned 64-bit arithmetic; products wrap).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def greedy(logits: Tensor) -> list[int]:
    """Row-wise argmax: the native kernel on CPU float32 (docs/decisions.md#native-argmax), torch.argmax
    elsewhere; the same indices either way (first maximum, NaN wins)."""
    return ops.argmax(logits)


# ---- per-row uniforms -----------------------------------------------------------------------------
def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def seeded_uniforms(seeds: Tensor, positions: Tensor) -> Tensor:
    """Uniforms in [0, 1) float64, a pure function of (seed, output position): splitmix64 of the seed,
    then of that plus the position, so neighbouring seeds and positions do not share streams."""
    z = _splitmix64(_splitmix64(seeds) + positions)
    return _shift_right(z, 11).double() * 2.0**-53


def _as_int64(value: int) -> int:
    """Any Python int as the signed int64 with the same low 64 bits."""
    return ((value % (1 << 64)) ^ (1 << 63)) - (1 << 63)


def _row_uniforms(params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device) -> Tensor:
    """[N] float64 uniforms: seeded rows from their (seed, position), the others from torch's generator."""
    u = torch.rand(len(params), dtype=torch.float64, device=device)
    if any(sp.seed is not None for sp in params):
        seeds = _device_tensor([_as_int64(sp.seed or 0) for sp in params], torch.int64, device)
        seeded = _device_tensor([sp.seed is not None for sp in params], torch.bool, device)
        u = torch.where(seeded, seeded_uniforms(seeds, _device_tensor(list(positions), torch.int64, device)),
                        u)
    return u


def _device_tensor(values: list[int] | list[float] | list[bool], dtype: torch.dtype,
                   device: torch.device) -> Tensor:
    """A small host list on the device without a sync: pinned and copied asynchronously on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ---- drawing from unnormalised weights ------------------------------------------------------------
def _pick(cum: Tensor, target: Tensor) -> Tensor:
    """For cumulative sums cum [n, m] (float64, nondecreasing) and targets [n] in [0, cum[:, -1]): the
    first index whose cumulative sum exceeds the target, i.e. a token of positive weight."""
    # Keep the target strictly below the row's total, so rounding never walks past the last positive weight.
    target = torch.minimum(target, torch.nextafter(cum[:, -1], torch.zeros_like(target)))
    return torch.searchsorted(cum, target[:, None], right=True)[:, 0].clamp_(max=cum.shape[1] - 1)


def draw(weights: Tensor, u: Tensor) -> Tensor:
    """One index per row of weights [n, V] (>= 0, float32, each row with positive mass), drawn with
    probability proportional to its weight by the uniforms u [n]: the inverse CDF in two levels, a
    float64 cumulative sum over blocks of BLOCK tokens, then one within the chosen block. The float64
    sums keep every token's chance exact to ~1e-16 (a float32 cumulative sum over 49k tokens would
    round the tail's weights away)."""
    n, vocab = weights.shape
    if vocab <= BLOCK:
        cum = weights.double().cumsum(-1)
        return _pick(cum, u * cum[:, -1])
    nblocks = -(-vocab // BLOCK)
    padded = (weights if vocab == nblocks * BLOCK
              else torch.nn.functional.pad(weights, (0, nblocks * BLOCK - vocab))).view(n, nblocks, BLOCK)
    # Block sums in float32 (a sum of 256 is exact to ~1e-7 of itself; summing in float64 would first
    # copy all [n, V] weights), then accumulated over the blocks in float64.
    block_cum = padded.sum(-1).double().cumsum(-1)  # [n, nblocks]
    target = u * block_cum[:, -1]
    block = _pick(block_cum, target)  # [n]
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = padded.gather(1, block[:, None, None].expand(n, 1, BLOCK))[:, 0].double().cumsum(-1)  # [n, BLOCK]
    # A target just short of the block's end can exceed its own float64 sum by rounding: _pick caps it.
    return block * BLOCK + _pick(inner, (target - before).clamp_(min=0.0))


def _weights(logits: Tensor, inv_temperature: Tensor) -> Tensor:
    """exp((logits - row max) / T) [n, V] float32: unnormalised probabilities whose maximum is 1."""
    top = logits.amax(-1, keepdim=True)
    return torch.sub(logits, top).mul_(inv_temperature[:, None]).exp_()


def _min_p_mask_(weights: Tensor, min_p: Tensor | None) -> Tensor:
    """Zero the weights below min_p times the row's largest weight, in place (the largest survives)."""
    if min_p is not None:
        top = weights.amax(-1, keepdim=True)
        weights.masked_fill_(weights < min_p[:, None] * top, 0.0)
    return weights


def nucleus_threshold(weights: Tensor, top_p: Tensor) -> Tensor:
    """[n] float32: the smallest weight of each row's nucleus (the most likely tokens whose mass first
    reaches top_p of the row's total; the token crossing it stays). On a CPU, by sorting only the tokens
    of the one coarse bin the threshold falls in (`_nucleus_threshold_cpu`); elsewhere by the radix
    search (`_nucleus_threshold_radix`), which needs no host sync."""
    if weights.device.type == "cpu":
        return _nucleus_threshold_cpu(weights, top_p)
    return _nucleus_threshold_radix(weights, top_p)


def _nucleus_threshold_cpu(weights: Tensor, top_p: Tensor) -> Tensor:
    """The nucleus threshold on a CPU: one histogram of mass over the weights' exponent and top 3
    mantissa bits (the radix search's first round) finds the bin the threshold falls in and the mass
    above it; then only that bin's tokens (weights within 12.5 % of each other) are sorted, all rows in
    one sort keyed by (row, weight), and summed in float64 from the mass above. On a CPU the radix
    search's later rounds are slow (nearly every token falls in one bin, and a scatter-add into one
    address runs at its latency; docs/decisions.md#top-p-threshold-cpu). A sort needs the subset's size
    on the host, a sync a GPU should not pay. A row whose bin came out empty (NaN weights) takes the
    radix search's answer."""
    n = weights.shape[0]
    bits = weights.contiguous().view(torch.int32)
    coarse = (bits >> 20).long()  # [n, V]: the exponent and 3 mantissa bits; 0..1016 for weights in [0, 1]
    hist = torch.zeros(n, 1024, dtype=weights.dtype).scatter_add_(1, coarse.clamp_(0, 1023), weights).double()
    target = top_p.double() * hist.sum(-1)
    above = hist.flip(-1).cumsum(-1).flip(-1)  # above[d]: the mass of bins >= d
    digit = ((above >= target[:, None]).sum(-1) - 1).clamp_(min=0)  # the bin the threshold falls in
    carried = torch.where(digit < 1023, above.gather(1, (digit + 1).clamp(max=1023)[:, None])[:, 0], 0.0)
    rows, cols = (coarse == digit[:, None]).nonzero(as_tuple=True)
    order = (rows * (1 << 31) + (0x7FFFFFFF - bits[rows, cols].long())).argsort()  # by row, heaviest first
    rows, cols = rows[order], cols[order]
    vals = weights[rows, cols]
    counts = torch.bincount(rows, minlength=n)
    starts = counts.cumsum(0) - counts
    mass = vals.double()
    cum = mass.cumsum(0)
    base = torch.where(starts > 0, cum[(starts - 1).clamp(min=0)], 0.0)  # the rows before, in the running sum
    before = cum - mass - base[rows] + carried[rows]  # each token's row mass from above, excluding it
    kept = torch.bincount(rows, weights=(before < target[rows]).double(), minlength=n).long().clamp_(min=1)
    # Indexing copies, so the empty rows below are filled in a tensor of this function's own.
    threshold = (vals[(starts + kept - 1).clamp(max=max(0, vals.numel() - 1))] if vals.numel()
                 else weights.new_empty(n))
    empty = counts == 0
    if bool(empty.any()):
        threshold[empty] = _nucleus_threshold_radix(weights[empty], top_p[empty])
    return threshold


def _nucleus_threshold_radix(weights: Tensor, top_p: Tensor) -> Tensor:
    """The nucleus threshold found without sorting (for devices where a host sync costs).

    Weights >= 0 have float bit patterns ordered like their values, and weights <= 1.0 (0x3F800000) use
    30 bits. Three rounds of a radix search, 10 bits each: every token's bits above this round's digit
    are compared with the threshold's found so far, so a histogram of mass has a bin below (dropped),
    1024 bins for the tokens that share the prefix, and a bin above; its suffix sums give the last digit
    whose mass from above still reaches the target. A round is ~5 passes of fixed shape over the rows
    (a sort of 49k tokens costs ~100), with no sync."""
    n = weights.shape[0]
    bits = weights.contiguous().view(torch.int32)
    prefix = torch.zeros(n, 1, dtype=torch.int32, device=weights.device)  # the threshold's bits found so far
    target = None
    for shift in (20, 10, 0):
        # Bin 0: below the prefix; 1 + digit: sharing it; 1025: above it. The first round has no prefix
        # (the clamp then only keeps a NaN row in range).
        key = (bits >> shift) - ((prefix << 10) - 1)
        bins = key.clamp_(0, 1025).long()
        hist = torch.zeros(n, 1026, dtype=weights.dtype, device=weights.device).scatter_add_(1, bins, weights)
        hist = hist.double()
        if target is None:
            target = top_p.double()[:, None] * hist.sum(-1, keepdim=True)
        above = hist.flip(-1).cumsum(-1).flip(-1)[:, 1:1025]  # above[d]: the mass of digits >= d and higher
        # Rounding can leave even digit 0 a hair short of the target: it is then the answer.
        digit = ((above >= target).sum(-1, keepdim=True) - 1).clamp_(min=0)
        prefix = (prefix << 10) | digit.to(torch.int32)
    return prefix.view(torch.float32)[:, 0]


# ---- the row groups -------------------------------------------------------------------------------
def _params(params: Sequence[SamplingParams], name: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _device_tensor([getattr(sp, name) for sp in params], dtype, device)


def _min_p(params: Sequence[SamplingParams], device: torch.device) -> Tensor | None:
    return _params(params, "min_p", torch.float32, device) if any(sp.min_p > 0 for sp in params) else None


def _full_weights(logits: Tensor, params: Sequence[SamplingParams]) -> tuple[Tensor, Tensor | None]:
    """Rows with neither top-k nor top-p: temperature (and min-p) over the whole vocabulary."""
    inv_t = 1.0 / _params(params, "temperature", torch.float32, logits.device)
    return _min_p_mask_(_weights(logits, inv_t), _min_p(params, logits.device)), None


def _nucleus_weights(logits: Tensor, params: Sequence[SamplingParams]) -> tuple[Tensor, Tensor | None]:
    """Rows with top-p and no top-k: the sort-free threshold over the whole vocabulary."""
    device = logits.device
    weights = _weights(logits, 1.0 / _params(params, "temperature", torch.float32, device))
    threshold = nucleus_threshold(weights, _params(params, "top_p", torch.float32, device))
    weights.masked_fill_(weights < threshold[:, None], 0.0)
    return _min_p_mask_(weights, _min_p(params, device)), None


def _top_k_weights(logits: Tensor, params: Sequence[SamplingParams]) -> tuple[Tensor, Tensor | None]:
    """Rows with top-k (and maybe top-p): torch.topk of the batch's largest k, each row keeping its own
    first k, then top-p over what is left (sorted already) and min-p; the columns are the topk's ids."""
    device, vocab = logits.device, logits.shape[-1]
    ks = [min(sp.top_k, vocab) for sp in params]
    values, ids = logits.topk(max(ks), dim=-1)  # sorted, largest first
    weights = torch.sub(values, values[:, :1]).mul_(
        1.0 / _params(params, "temperature", torch.float32, device)[:, None])
    weights = weights.exp_()
    rank = torch.arange(values.shape[1], device=device)
    weights.masked_fill_(rank[None, :] >= _device_tensor(ks, torch.int64, device)[:, None], 0.0)
    if any(sp.top_p < 1.0 for sp in params):
        probs = weights.double() / weights.sum(-1, dtype=torch.float64, keepdim=True)
        mass_before = probs.cumsum(-1) - probs
        weights.masked_fill_(mass_before >= _params(params, "top_p", torch.float64, device)[:, None], 0.0)
    return _min_p_mask_(weights, _min_p(params, device)), ids


def _group(sp: SamplingParams, vocab: int) -> int:
    if 0 < sp.top_k < vocab:
        return 2
    return 1 if sp.top_p < 1.0 else 0


# What each group draws from: (weights [n, m] float32 >= 0, the vocabulary id of each column [n, m], or
# None where column j is token j). The one definition of a sampled row's distribution: `sampled_ids`
# draws from it, `target_weights` spreads it over the vocabulary, speculative verification tests drafts
# against it.
GROUP_WEIGHTS = (_full_weights, _nucleus_weights, _top_k_weights)


def row_groups(params: Sequence[SamplingParams], vocab: int) -> dict[int, list[int]]:
    """The rows of each group, in order: -1 for greedy rows, else an index into GROUP_WEIGHTS."""
    members: dict[int, list[int]] = {}
    for i, sp in enumerate(params):
        members.setdefault(-1 if sp.greedy else _group(sp, vocab), []).append(i)
    return members


def sampled_ids(logits: Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> Tensor:
    """[N] int64 on the device: greedy rows by argmax, the others drawn by their group."""
    device, vocab = logits.device, logits.shape[-1]
    ids = torch.empty(len(params), dtype=torch.int64, device=device)
    u = _row_uniforms(params, positions, device)
    for group, rows in row_groups(params, vocab).items():
        whole = len(rows) == len(params)
        index = None if whole else _device_tensor(rows, torch.int64, device)
        x = logits if index is None else logits.index_select(0, index)
        if group < 0:
            chosen = x.argmax(-1)
        else:
            weights, columns = GROUP_WEIGHTS[group](x.float(), [params[i] for i in rows])
            chosen = draw(weights, u if index is None else u[index])
            if columns is not None:
                chosen = columns.gather(1, chosen[:, None])[:, 0]
        if index is None:
            return chosen
        ids.index_copy_(0, index, chosen)
    return ids


def target_weights(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """[N, V] float32 unnormalised weights (>= 0, zero outside top-k / top-p / min-p): for a sampled row
    exactly what `sampled_ids` draws from, spread over the vocabulary; for a greedy row a one-hot at
    its argmax (it is not sampled: callers take the argmax)."""
    device, vocab = logits.device, logits.shape[-1]
    out = torch.zeros(len(params), vocab, dtype=torch.float32, device=device)
    for group, rows in row_groups(params, vocab).items():
        index = _device_tensor(rows, torch.int64, device)
        x = logits.index_select(0, index)
        if group < 0:
            weights = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device).scatter_(
                1, x.argmax(-1, keepdim=True), 1.0)
        else:
            dense, columns = GROUP_WEIGHTS[group](x.float(), [params[i] for i in rows])
            weights = dense if columns is None else torch.zeros(
                len(rows), vocab, dtype=torch.float32, device=device).scatter_(1, columns, dense)
        out.index_copy_(0, index, weights)
    return out


# ---- penalties and log-probabilities ---------------------------------------------------------------
def process_logits(logits: Tensor, sp: SamplingParams, token_ids: Sequence[int], num_prompt_tokens: int,
                   stop_ids: Sequence[int]) -> Tensor:
    """One row [V] with the request's penalties and min_tokens applied (a new tensor): `apply_penalties`
    on a batch of one."""
    return apply_penalties(logits[None], [sp], [(token_ids, num_prompt_tokens)], [stop_ids])[0]


def apply_penalties(logits: Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[tuple[Sequence[int], int]],
                    stop_ids: Sequence[Sequence[int]]) -> Tensor:
    """Rows [N, V] with each request's penalties and min_tokens applied, all rows at once (a new tensor).

    `histories[i]`: (prompt followed by the outputs so far, prompt length); `stop_ids[i]`: the ids
    min_tokens keeps out. Repetition (transformers') divides the positive and multiplies the negative
    logits of every token seen in prompt or output; frequency and presence (OpenAI's) subtract per
    output occurrence and once per token output. Every index comes over in one pinned copy, padded to
    the longest row with an extra column V that the results drop; a row without a penalty is computed
    with neutral factors (x * 1, x / 1, x - 0: the same values)."""
    n, vocab = logits.shape
    device = logits.device
    width = max((len(ids) for ids, _ in histories), default=0)
    stop_width = max((len(s) for s in stop_ids), default=0)
    flat: list[int] = []
    for (ids, num_prompt), stops, sp in zip(histories, stop_ids, params, strict=True):
        outputs = len(ids) - num_prompt
        flat.extend(ids)
        flat.extend([vocab] * (width - len(ids)))
        flat.extend([0] * num_prompt + [1] * outputs + [0] * (width - len(ids)))  # 1: an output position
        blocked = stops if outputs < sp.min_tokens else ()
        flat.extend(blocked)
        flat.extend([vocab] * (stop_width - len(blocked)))
    packed = _device_tensor(flat, torch.int64, device).view(n, 2 * width + stop_width)
    tokens, is_output, stops_t = packed[:, :width], packed[:, width:2 * width], packed[:, 2 * width:]
    factors = _device_tensor([v for sp in params for v in (sp.repetition_penalty, sp.frequency_penalty,
                                                           sp.presence_penalty)],
                             logits.dtype, device).view(n, 3)
    rep, freq, pres = factors[:, :1], factors[:, 1:2], factors[:, 2:3]
    padded = torch.cat([logits, logits.new_zeros(n, 1)], dim=1)
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device).scatter_(1, tokens, True)
    out = torch.where(seen, torch.where(padded < 0, padded * rep, padded / rep), padded)
    counts = torch.zeros_like(padded).scatter_add_(1, tokens, is_output.to(padded.dtype))
    out = out - (counts * freq + (counts > 0).to(padded.dtype) * pres)
    blocked_mask = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device).scatter_(1, stops_t, True)
    out = out.masked_fill(blocked_mask, float("-inf"))
    return out[:, :vocab]


def penalised_logits(logits: Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[tuple[Sequence[int], int]] | None,
                     stop_ids: Sequence[int]) -> Tensor:
    """Rows [N, V] as `sample` draws from them: `apply_penalties` on the rows whose params process logits,
    with the model's stop ids plus the request's own (only its own with ignore_eos) kept out by
    min_tokens; the same tensor where no row asks."""
    processed = [i for i, sp in enumerate(params) if sp.processes_logits]
    if not processed:
        return logits
    if histories is None:
        raise ValueError("penalties and min_tokens need the requests' token histories")
    stops = [(*stop_ids, *params[i].stop_token_ids) if not params[i].ignore_eos else params[i].stop_token_ids
             for i in processed]
    whole = len(processed) == len(params)
    index = None if whole else _device_tensor(processed, torch.int64, logits.device)
    rows = apply_penalties(logits if index is None else logits.index_select(0, index),
                           [params[i] for i in processed], [histories[i] for i in processed], stops)
    if index is None:
        return rows
    out = logits.clone()
    out.index_copy_(0, index, rows)
    return out


def top_logprobs(logits: Tensor, tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """For rows of raw logits [N, V]: (log-probability of tokens[i], the ks[i] most likely (id, logprob))."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(
        1, torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
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
    if logits.shape[0] != len(params) or len(output_indices) != len(params):
        raise ValueError(f"{logits.shape[0]} rows of logits and {len(output_indices)} output positions "
                         f"for {len(params)} requests")
    raw = logits
    logits = penalised_logits(logits, params, histories, stop_ids)
    # The step's one read of the device: the ids (and the logprobs asked for with them) go to the engine.
    with allowed_read():
        if not params:
            tokens: list[int] = []
        elif all(sp.greedy for sp in params):
            tokens = greedy(logits)
        else:
            tokens = sampled_ids(logits, params, output_indices).tolist()
        wanted = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        if wanted:
            rows = raw.index_select(0, torch.tensor(wanted, dtype=torch.long, device=raw.device))
            for i, lp in zip(wanted, top_logprobs(rows, [tokens[i] for i in wanted],
                                                  [params[i].logprobs or 0 for i in wanted]), strict=True):
                logprobs[i] = lp
    return tokens, logprobs
