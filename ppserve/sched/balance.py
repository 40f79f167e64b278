"""Balanced microbatch formation: how big the next microbatch is, so that the pipeline stays full.

A pipeline of p stages keeps p microbatches in flight (p + 1 with the token ring, whose extra one is the
oldest decode group's next step: the decodes still form p groups); it is balanced when consecutive microbatches
cost the same on every stage (ARCHITECTURE.md §3, "Balanced formation"). Two numbers shape the next microbatch:

- **Decode quota.** Each decoding request rides in one in-flight microbatch at a time (its next token
  needs the last one), so the decodes split into p groups that follow each other around the pipeline.
  The next microbatch takes about 1/p of *all* decoding requests, those in flight included:
  min(ceil(D / p), ceil(R / F)) with D decoding requests, R of them ready now, F free slots. The first
  term keeps every group near D/p and moves a surplus on to the next microbatch (so groups even out
  as requests come and go); the second spreads what is ready over the slots still empty, so p = 4
  slots and 9 decodes give 3, 2, 2, 2 rather than 3, 3, 3 and an idle stage.
- **Fair share.** The microbatch is filled to an equal part of the work in reach: (work in flight +
  work schedulable now) / p, never more than the budget; in predicted time on the slowest stage once
  the scheduler's step-cost model is calibrated (`Scheduler._time_share`: a microbatch's time is not
  its tokens; each stage pays a floor per step, attention grows with context, the last stage pays the
  LM head per sampled token), in tokens before. Saturated, the share is the budget itself (plain Sarathi-Serve): the work in
  reach fills every share, or requests wait beyond the free seats (then `max_num_seqs`, not demand,
  bounds what is in reach, and a smaller budget would only cut throughput). With little work, a lone
  prompt is cut into p chunks that follow each other down the pipeline instead of one chunk that
  visits the stages one at a time; a token share is never below a quarter of the budget
  (`MIN_SHARE_OF_BUDGET`: a smaller chunk beside the decodes balances nothing, the step's floor
  dominates, and it only delays a short prompt; in predicted time the floor is a time, `min_chunk_tokens`:
  the chunk that costs what the step's floor costs, at most that quarter: on a GPU, whose floor is
  the weights' read, about the ridge point), except while several prompts fill an empty pipeline
  (nothing in flight, no decode): there the floor would only make the first microbatch the longest,
  with every stage behind it waiting for all of it. A chunk that follows its prompt's in-flight chunk takes only the
  budget the other work leaves: ranked with the other prefills, one prompt's chunks took the prefill
  part of consecutive microbatches, and its short last chunk (next to a sequence cap full of decodes)
  left every few microbatches short of the budget, which a saturated pipeline pays as bubbles.
- **Rounds, while requests keep arriving** (`scheduler.balance_rounds` = k, default 4). A pipeline
  idles about (p - 1) * (T_k - T_k+1) each time the microbatch time falls (the decode ring's groups
  wait for the longer microbatch to come round): the bubble follows how far and how often the
  microbatch time drops. Shared over one round, each prompt that arrives among decode-only
  microbatches lifts p of them and drops back. With k > 1, while requests keep arriving
  (`ArrivalWatch`), the work in reach is shared among k rounds (k * p microbatches): the prefill runs
  in thinner chunks beside the decodes, the next prompt comes before they run out, and the microbatch
  time stays level. Thinner, but never below `ROUNDS_MIN_CHUNKS` minimum chunks (`min_chunk_tokens`,
  the chunk that costs a step's floor) unless one round's share is thinner still: a chunk near the
  floor's cost barely shortens its microbatch, so cutting it finer lowers no drop and only adds steps
  to its prompt. Without that floor k = 4 was a trade (simulator, conversation trace): Llama-2-70B
  A100 PP4xTP4 at 2 / 4 / 8 req/s, bubble 10.0 / 11.1 / 14.7 % -> 7.7 / 6.8 / 7.6 %, TTFT p50
  -13..-17 %, but Llama-3-70B on H100s (PP4xTP2, PP8xTP1, PP2xTP4), where a chunk's tokens cost little
  beside the floor, TTFT p50 +20..+49 %: its prompts went from ~4 chunks of ~250 tokens to ~8 of ~125,
  each a step. With the floor at two minimum chunks, k = 4 against k = 1 is no worse in mean bubble,
  TTFT p50, TBT p99 or throughput in any of those setups (`benchmarks/bench_balance_rounds.py`:
  bubble 10.0 / 11.1 / 14.7 -> 9.1 / 9.1 / 10.5 % on A100, 7.8 / 12.9 / 9.3 -> 6.2 / 11.5 / 7.4 % on
  H100; TTFT p50 0.85-1.00x; TBT p99 0.50-0.77x); the TTFT tail moves by -25..+17 %. A floor of 1.5
  gives lower bubbles on A100 and 1.07x TTFT p50 on H100; 3 gives back most of the gain.
  When the arrivals stop (the end of a burst, a batch given all at once) no later prompt would keep
  the level, the drop comes whatever the share, and thinner chunks would only delay the last prompts:
  one round then, whatever k (Sarathi's GPT-3 case, 512 requests at t=0, with k = 4 in every state:
  its last prompts' decodes ran on alone, makespan +3.4 %, bubble 4.3 -> 5.6 %; with the watch,
  identical to k = 1). One round too while several prompts fill an empty pipeline (nothing in flight,
  no decode: nothing to keep level; `ppserve demo`'s eight prompts, arriving over gRPC a few at a time,
  had TTFT p50 140-145 ms at k = 4 against 89-103 at k = 1).

- **Filling an empty pipeline.** Several prompts and nothing in flight, no decode: every stage behind the
  first microbatch waits for all of it, and no decode needs keeping level. In predicted time the fill is
  cut into equal microbatches, as many as end it soonest (`fill_microbatches`): m microbatches of a work
  W, each paying the step's floor f, keep p stages busy until about (m + p - 1)(f + W / m), least at
  m = sqrt((p - 1) W / f), rounded down (a microbatch also costs a dispatch and hops the model leaves
  out); never fewer than the token budget allows, and where only the budget bounds it, the whole budget
  (saturated). The fill keeps that share, prompts arriving meanwhile included, until its first decode is
  back (`Scheduler._fill_share_s`). It was one round, p shares, for its first microbatch only: the regime
  suite's multi-turn bursts (32 prompts, 2048 tokens, into an empty PP4 pipeline with a 512-token
  budget) went as a whole-budget microbatch (one round was saturated) and then the ~160-token shares of
  four rounds, and stage 0 idled 52 ms a burst for the first's round trip. Cut by the rule: bubble
  3.42 -> 2.38 %, TTFT p50 179 -> 137 ms (the best formation there now; `vllm` 165); bursty 10.36 ->
  10.05 %, TTFT p99 -1.2 %; every other regime identical. The demo's eight prompts (194 tokens; on two
  CPU stages a floor of ~5 ms and ~0.24 ms a token) go as three microbatches of whole prompts (81, 68,
  45 tokens) instead of 100 + 94. Uncalibrated, in tokens, the fill takes one round's share.

- **Equal chunks.** A share in predicted time cuts a prompt that does not fit whole into equal chunks
  (`TimeBudget(even_chunks=True)`): the chunk takes the rest's tokens divided by the number of chunks
  the time granted now would need, at most one token over that grant (the grant is a share rounded down,
  and a prompt of exactly two shares would go in three; not with a token budget of 16 or less, whose
  share lets no rest past it). Cut greedily, a prompt's chunks were full
  grants and then its rest, which either took a microbatch of its own or, a little over a grant, went
  whole past the share (`MIN_REST_OF_BUDGET`). A 1,123-token prompt beside three decodes went as chunks
  of 217-221 tokens and a last one of 246 (12.3 ms against ~10.9, its share), followed by decode-only
  microbatches of 5.7 ms: a drop the ring paid as 11 ms of idle time on every stage. Equal, it goes as
  six chunks of 187-188. Regime suite (Llama-2-70B A100 PP4xTP4, conversation trace at 2 / 4 / 8 req/s):
  bubble 5.76 / 4.26 / 5.26 -> 5.27 / 4.09 / 5.09 %, TTFT p50 -0.6..-3.0 %, TTFT p99 -1..-6 %, TBT p99
  -1.5..-8 %; decode-heavy 2.84 -> 2.77 %, bursty 10.05 -> 10.36 %, the other regimes within 0.11 points.

Functions over numbers, and one small tracker (`ArrivalWatch`) the scheduler feeds arrival times from
its injected clock; the scheduler gathers the numbers. No torch, no clock reads of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.sched.cost import PipelineCost

__all__ = ["MIN_REST_OF_BUDGET", "MIN_SHARE_OF_BUDGET", "ROUNDS_MIN_CHUNKS", "ArrivalWatch", "decode_quota", "fair_share", "fill_microbatches",
           "min_chunk_tokens"]

# A token share is never cut below this part of the budget. Next to a microbatch's decodes a stage's
# time is mostly its per-step floor (weights read, launches), so a smaller chunk balances almost
# nothing and only spreads a short prompt over more microbatches: its TTFT grows by up to p - 1 steps
# (decode-heavy chat in the regime suite: 1.21x the best formation's TTFT without the floor, 1.00x with
# it). A share in predicted time keeps the same floor: never below the decodes it takes plus a chunk of
# this part of the budget, or less where a chunk that size costs more than the step's floor
# (`min_chunk_tokens`).
MIN_SHARE_OF_BUDGET = 0.25

# A share in predicted time never leaves a prompt a rest of this part of the budget or less: the chunk
# takes it whole (the token budget allowing). In Sarathi's GPT-3 case a last chunk cut to 223 of its 224
# tokens left a 1-token rest, which cost its request a microbatch of its own and the pipeline a short
# one (bubble 3.9 -> 4.2 %, reduced suite); a rest as large as the quarter-budget floor, taken whole,
# overfilled microbatches instead (conversation trace: bubble +0.9 pp, TTFT p50 +5-10 %).
MIN_REST_OF_BUDGET = 1 / 16

# Shared over more than one round, a chunk is at least this many minimum chunks (`min_chunk_tokens`;
# in tokens, before the cost model is calibrated, this many quarter budgets), or one round's share where
# that is thinner (see "Rounds" in the module doc; 1.5, 2 and 3 measured there).
ROUNDS_MIN_CHUNKS = 2.0

# Requests count as still arriving while the last one came less than this many mean gaps ago: a
# Poisson stream leaves a longer silence 5 % of the time (e^-3). The mean gap is a moving average of
# the last ~10 gaps (weight 0.1): it follows a change of rate within a few arrivals.
STREAM_GAPS = 3.0
GAP_WEIGHT = 0.1


@dataclass
class ArrivalWatch:
    """Whether requests are still arriving as a stream, from their arrival times on the scheduler's
    clock: the last arrival came less than `STREAM_GAPS` mean gaps ago. Requests that all came at one
    instant (a batch, a burst) make no stream: their gaps are zero."""

    last_s: float | None = None
    mean_gap_s: float | None = None

    def arrived(self, now_s: float) -> None:
        if self.last_s is not None:
            gap = max(0.0, now_s - self.last_s)
            self.mean_gap_s = gap if self.mean_gap_s is None else self.mean_gap_s + GAP_WEIGHT * (gap - self.mean_gap_s)
        self.last_s = now_s

    def streaming(self, now_s: float) -> bool:
        if self.last_s is None or self.mean_gap_s is None:
            return False
        return now_s - self.last_s < STREAM_GAPS * self.mean_gap_s


def decode_quota(num_decoding: int, num_ready: int, num_stages: int, free_slots: int) -> int:
    """How many of the `num_ready` schedulable decodes the next microbatch takes (see the module doc);
    `free_slots` is how many of the `num_stages` in-flight slots are empty."""
    if num_ready <= 0 or free_slots <= 0:
        return 0
    per_group = math.ceil(max(num_decoding, num_ready) / num_stages)
    per_free_slot = math.ceil(num_ready / free_slots)
    return max(1, min(per_group, per_free_slot))


def fair_share(work_in_reach: float, num_shares: int, cap: float, floor: float = 0.0) -> float:
    """The next microbatch's share of the work in reach (split `num_shares` ways), at least `floor` and
    at most `cap` (the budget)."""
    return min(cap, max(floor, work_in_reach / num_shares))


def fill_microbatches(stages: Sequence[tuple[float, float]], num_stages: int) -> int:
    """How many equal microbatches an empty pipeline's fill is cut into; `stages`: per stage, its floor per
    step and the fill's work there (seconds).

    m microbatches of a work W with a floor f each keep a pipeline of p stages busy until about
    (m + p - 1) (f + W / m): few, and the stages behind the first wait for a long one; many, and each pays
    its floor. That ends soonest at m = sqrt((p - 1) W / f), taken here on the stage that wants the most,
    rounded down: each microbatch also costs what the model leaves out (its dispatch, its hops). A stage
    whose fit has no floor (an online fit can put it at zero) asks for one round, p microbatches, as a
    share does: the formula would ask for as many microbatches as tokens."""
    count = 1
    for floor_s, work_s in stages:
        wanted = math.floor(math.sqrt((num_stages - 1) * work_s / floor_s)) if floor_s > 0 else num_stages
        count = max(count, wanted)
    return count


def min_chunk_tokens(cost: PipelineCost, token_budget: int) -> int:
    """The smallest chunk a share in predicted time cuts a prompt to beside its decodes: the longest
    chunk that adds at most a stage's per-step floor to that stage, on the stage where that chunk is
    longest, and never more than a quarter of the budget (`MIN_SHARE_OF_BUDGET`, the token share's floor).

    The floor argument is about time, not tokens: a chunk that costs much less than the step's floor
    balances nothing and only spreads a prompt over more microbatches. On a GPU the floor is the
    weights' read and a token's cost its compute, so the chunk is about the ridge point (the
    simulator's A100 roofline: 98 tokens for a Llama-2-70B PP4xTP4 stage, 90 for GPT-3 TP8xPP8,
    against the quarter budgets 128 and 64). Where a token costs more next to the floor the chunk is
    smaller, and a quarter budget kept whole would be a long microbatch for the other stages to wait
    behind (the demo on one machine: a 113-token prompt arriving beside decodes took one 75 ms step
    where its neighbours took 25 ms). The default model on a 2-core Xeon, bf16, one thread a stage:
    floor 17 ms, 0.33 ms a token, so 53 tokens."""
    cap = math.ceil(token_budget * MIN_SHARE_OF_BUDGET)
    if not cost.stages:
        return cap
    return max(stage.max_tokens(stage.floor_s, 0, cap) for stage in cost.stages)
