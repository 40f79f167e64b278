"""A stage's step-cost prior, timed at start-up, so the scheduler's cost model is calibrated from the
first microbatch (ARCHITECTURE.md#how-a-microbatch-is-formed, "Balanced formation").

The scheduler shares work by predicted time once its online cost model is calibrated (sched/cost.py),
and by tokens before, with a quarter-budget floor per chunk that suits a GPU. The online fit needs a few
microbatches per stage, and on a real pipeline the first microbatches are exactly when prompts arrive,
so a split by tokens then can be badly uneven (docs/decisions.md#startup-step-cost-prior). So after the
warm-up (every path's first-call costs paid) each stage times a few microbatch shapes on its own KV cache
(decodes, a pair of chunk sizes, a mix, and a chunk and decodes after a long context) and fits the same
`StepCost` the online model fits, which then refines it with the serving stream's own times.

The shapes are timed as the stage's step is (its layers, the last stage's LM head), best of a few runs,
synchronized on a GPU (start-up only: nothing serves yet); what a real step has and they do not (its
prepare span, decode graphs) is the online fit's to correct. A stage whose kernels run under Triton's
interpreter (`StageModel.interpreted`, seconds a step) times only the short shapes, once each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ppserve.request import SamplingParams
from ppserve.sched.cost import StepCost, StepCostFit, features
from ppserve.worker.memory import StageMemory

REPEATS = 3  # runs per shape; the fastest counts (a shared host's noise only adds time)
# A shape whose first run took this long runs LONG_REPEATS times: a host's jitter (a descheduled slice,
# a page fault) is a smaller part of it, and a third run of the long shapes would be most of a CPU stage's
# start-up. Under tensor parallelism every run is a forward with collectives, so the ranks decide on the
# slowest rank's first run (`TPContext.max_over_group`): ranks deciding on their own could differ in their
# run counts and hang in an all-reduce.
LONG_SHAPE_S = 0.1
LONG_REPEATS = 2
# The long context of the shapes that price attention (cache room allowing): far enough from the short
# one that a key's cost stands apart from a token's, short enough to time in a blink on any device
# (docs/decisions.md#startup-step-cost-prior).
LONG_CONTEXT = 1024


def startup_shapes(cached: int, chunk: int, seqs: int, long_context: int = 0,
                   long_seqs: int = 0) -> list[tuple[list[int], list[int]]]:
    """(query tokens, sequence lengths) per sequence of the timed microbatches.

    After `cached` tokens: one decode (the floor), `seqs` decodes (what a decode adds, its sampling
    included), a chunk of `chunk` tokens and one of half that (a token's cost), and the half chunk
    beside the decodes (a mixed step, as Sarathi-Serve forms them). After `long_context` tokens, when
    it is longer: both chunks again and `long_seqs` decodes, so that attention's keys (which grow
    with the context) are told from tokens (which do not): at one short context a chunk's keys move
    almost in step with its tokens, and a decode's keys, tokens and sample all move together, so those
    five shapes alone leave the split between them to noise. A chunk samples one row where a decode
    samples every row, which tells the last stage's LM head from its layers."""
    half = max(2, chunk // 2)
    shapes = [([1], [cached + 1]), ([1] * seqs, [cached + 1] * seqs), ([half], [cached + half])]
    if chunk > half:
        shapes.append(([chunk], [cached + chunk]))
    shapes.append(([half] + [1] * seqs, [cached + half] + [cached + 1] * seqs))
    if long_context > cached:
        shapes.append(([half], [long_context + half]))
        if chunk > half:
            shapes.append(([chunk], [long_context + chunk]))
        if long_seqs > 0:
            shapes.append(([1] * long_seqs, [long_context + 1] * long_seqs))
    return shapes


def long_shapes(memory: StageMemory, kv_cache: list[torch.Tensor], chunk: int, seqs: int) -> tuple[int, int]:
    """(long context, decodes after it) that fit the stage's cache and its model's positions; (0, 0)
    when only the short context fits."""
    bs, blocks = memory.block_size, kv_cache[0].shape[1]
    context = min(LONG_CONTEXT, memory.arch.max_position_embeddings - chunk, blocks * bs - chunk)
    if context <= 0:
        return 0, 0
    return context, min(seqs, blocks // -(-(context + 1) // bs))


def measure_startup_cost(memory: StageMemory, kv_cache: list[torch.Tensor]) -> StepCost:
    """Time `startup_shapes` on the stage's own cache (zeroed again after each) and fit its StepCost."""
    cached, chunk, seqs = memory.warm_shapes(kv_cache)
    greedy = SamplingParams(temperature=0.0)
    cuda = memory.device.type == "cuda"
    # Under Triton's interpreter (a GPU kernel's CPU check) a step takes seconds, a long context minutes:
    # the short shapes once each give a prior in the right units, and the online fit corrects it.
    interpreted = memory.model.interpreted
    tp = memory.model.tp
    long = (0, 0) if interpreted else long_shapes(memory, kv_cache, chunk, seqs)
    samples: list[tuple[Sequence[tuple[int, int]], int, float]] = []
    for query_lens, seq_lens in startup_shapes(cached, chunk, seqs, *long):
        if _blocks_needed(seq_lens, memory.block_size) > kv_cache[0].shape[1]:
            continue  # the mix in a cache sized for the decodes alone
        best, runs, repeats = float("inf"), 0, 1
        while runs < repeats:
            if cuda:
                torch.cuda.synchronize(memory.device)
            t0 = time.perf_counter()
            memory.scratch_forward(query_lens, seq_lens, greedy, kv_cache)
            if cuda:
                torch.cuda.synchronize(memory.device)
            best, runs = min(best, time.perf_counter() - t0), runs + 1
            if runs == 1 and not interpreted:
                first = tp.max_over_group(best, memory.device)  # every TP rank runs the same number of times
                repeats = REPEATS if first < LONG_SHAPE_S else LONG_REPEATS
        chunks = [(q, n - q) for q, n in zip(query_lens, seq_lens, strict=True)]
        samples.append((chunks, len(query_lens), best))
    return fit_startup_cost(samples)


def fit_startup_cost(samples: Sequence[tuple[Sequence[tuple[int, int]], int, float]]) -> StepCost:
    """A StepCost from (chunks as (tokens, context), sampled rows, seconds) per timed microbatch: the
    online model's own least squares (non-negative, `solve_nonnegative`), every sample weighed alike.
    Where the cache left room for the long-context shapes every coefficient is told apart; where it did
    not, the fit's weak ridge splits what the short ones leave open, which a prior may do: serving's own
    times decide it."""
    fit = StepCostFit(forgetting=1.0, min_samples=1, refit_every=1)
    for chunks, sampled, seconds in samples:
        fit.observe(features(chunks, sampled), seconds)
    return fit.cost


def _blocks_needed(seq_lens: Sequence[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in seq_lens)
