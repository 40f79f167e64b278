"""The last stage's grammar work: one matcher per constrained request, the token bitmask of each
microbatch's sampled rows, and the matcher's advance by every token the stage samples.

Where it runs and why (ARCHITECTURE.md#structured-outputs): the mask is needed only where the token
is sampled, so it lives on the last stage (TP rank 0, which samples for the stage). It is filled in
the stage's `prepare`, which runs before the stage waits for the previous stage's hidden states: at
pp >= 2 the mask is computed while the stages before it compute, and the decode cycle gains no hop.
The stage sampled every token a matcher needs itself (ring tokens included), so the matchers advance
locally; a matcher that disagrees with the request's tokens (after a preemption by recompute or a
rebuilt stage, where the request arrives again with its outputs) is reset and replays them, which
gives the same state as if nothing had happened.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ppserve.metrics.spans import SpanRecorder
from ppserve.request import SamplingParams
from ppserve.sched.output import SchedulerOutput
from ppserve.structured.backend import Matcher
from ppserve.structured.grammars import GrammarCache
from ppserve.structured.spec import StructuredOutputs
from ppserve.worker.host_sync import allowed_read
from ppserve.worker.input_batch import CachedRequestState
from ppserve.worker.sampler import greedy


@dataclass
class _Tracked:
    spec: StructuredOutputs
    compiled: Future[object]
    matcher: Matcher | None = None
    accepted: list[int] = field(default_factory=list)  # the output tokens the matcher has taken


@dataclass
class StepMask:
    """One microbatch's mask: a row per sampled request (all tokens allowed where it has no grammar)."""

    bitmask: Tensor
    rows: list[int]  # the sampled rows that carry a grammar

    def expanded(self, rows_per_request: Sequence[int]) -> StepMask:
        """The mask over a step's logits rows when a request may have several (speculative decoding:
        1 + drafts each; a request under a grammar never has drafts, so its one row keeps its mask)."""
        first: list[int] = []
        owner: list[int] = []
        for i, n in enumerate(rows_per_request):
            first.append(len(owner))
            owner.extend([i] * n)
        bitmask = self.bitmask.index_select(0, torch.tensor(owner, dtype=torch.long))
        return StepMask(bitmask, [first[i] for i in self.rows])


class GrammarMasks:
    def __init__(self, cache: GrammarCache, recorder: SpanRecorder) -> None:
        self.cache = cache
        self.recorder = recorder
        self._tracked: dict[str, _Tracked] = {}
        self.mask_s = 0.0  # seconds spent filling masks since the last drain (StepResult carries it)

    def track(self, out: SchedulerOutput) -> None:
        """Start compiling each new constrained request's grammar (in the background) and forget the
        released ones."""
        for rid in out.released_request_ids:
            self._tracked.pop(rid, None)
        for new in out.new_requests:
            spec = new.sampling.structured_outputs
            if spec is not None:
                # A request sent again (preempted, then recomputed) starts over: its matcher replays.
                self._tracked[new.request_id] = _Tracked(spec, self.cache.submit(spec, count_hit=False))

    def fill(self, rids: Sequence[str], states: Sequence[CachedRequestState],
             step_id: int) -> StepMask | None:
        """The bitmask for a microbatch's sampled rows (a `grammar_mask` span), or None when no row has a
        grammar."""
        rows = [i for i, rid in enumerate(rids) if rid in self._tracked]
        if not rows:
            return None
        start = time.perf_counter_ns()
        try:
            bitmask = self.cache.backend.allocate_bitmask(len(rids))  # all ones: every token allowed
            for i in rows:
                matcher = self._matcher(rids[i], states[i])
                # Terminated: the request ended on this token (its end-of-sequence); a decode the token ring
                # scheduled before the end was known samples a token the engine throws away.
                if not matcher.is_terminated():
                    matcher.fill(bitmask, i)
        finally:
            end = time.perf_counter_ns()
            self.recorder.record("grammar_mask", start, end, step_id)
        self.mask_s += (end - start) * 1e-9
        return StepMask(bitmask, rows)

    def _matcher(self, rid: str, st: CachedRequestState) -> Matcher:
        tr = self._tracked[rid]
        if tr.matcher is None:
            tr.matcher = self.cache.backend.matcher(self.cache.get(tr.spec, count_hit=False))
        # In step: the matcher took every output token this stage sampled (the usual case, checked in O(1)).
        # A terminated matcher stays as it is: a token after its end is thrown away.
        n = len(st.token_ids) - st.num_prompt_tokens
        in_step = n == len(tr.accepted) and (n == 0 or st.token_ids[-1] == tr.accepted[-1])
        if not in_step and not tr.matcher.is_terminated():
            tr.matcher.reset()
            tr.accepted = []
            for t in st.token_ids[st.num_prompt_tokens:]:
                self._accept(rid, tr, t)
        return tr.matcher

    def apply(self, logits: Tensor, mask: StepMask) -> None:
        """Disallowed tokens' logits to -inf, in place, on the rows that carry a grammar."""
        self.cache.backend.apply_bitmask(logits, mask.bitmask, mask.rows)

    def greedy_tokens(self, logits: Tensor, mask: StepMask,
                      params: Sequence[SamplingParams]) -> list[int] | None:
        """The microbatch's tokens without masking every row, where that is exact and cheaper: on a CPU,
        when every row is greedy with nothing else to apply (no penalties, min_tokens or logprobs). The
        unmasked argmax (the first maximum) is the masked one wherever the grammar allows it; only the
        rows where it does not are masked and taken again. None: mask and sample as usual (on a GPU
        the mask is one kernel, and checking the ids first would read them back a step early)."""
        if logits.device.type != "cpu" or not all(
                sp.greedy and not sp.processes_logits and sp.logprobs is None for sp in params):
            return None
        with allowed_read():  # the step's one read of the ids (on a CPU, nothing to wait for)
            return self._greedy_tokens(logits, mask)

    def _greedy_tokens(self, logits: Tensor, mask: StepMask) -> list[int]:
        tokens = greedy(logits)
        words = mask.bitmask.numpy().view(np.uint32)
        bad = [i for i in mask.rows if not (int(words[i, tokens[i] >> 5]) >> (tokens[i] & 31)) & 1]
        if bad:
            index = torch.tensor(bad, dtype=torch.long)
            rows = logits.index_select(0, index)
            self.cache.backend.apply_bitmask(rows, mask.bitmask.index_select(0, index), range(len(bad)))
            for i, token in zip(bad, greedy(rows), strict=True):
                tokens[i] = token
        return tokens

    def accept(self, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """Advance the matchers of the constrained requests among `rids` by their sampled tokens."""
        for rid, token in zip(rids, tokens, strict=True):
            tr = self._tracked.get(rid)
            if tr is not None and tr.matcher is not None and not tr.matcher.is_terminated():
                self._accept(rid, tr, token)

    @staticmethod
    def _accept(rid: str, tr: _Tracked, token: int) -> None:
        assert tr.matcher is not None
        if not tr.matcher.accept(token):
            raise RuntimeError(f"request {rid}: token {token} is not allowed by its grammar (after "
                               f"{len(tr.accepted)} output tokens); the mask should have kept it out")
        tr.accepted.append(token)
