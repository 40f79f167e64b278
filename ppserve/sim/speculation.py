"""Speculative decoding in the simulator: a proposer that always drafts, and an acceptance model.

The scheduler's speculation is used unchanged (ppserve/sched/speculation.py decides which decodes carry
drafts and how many); the simulator stands in for the proposer and for the last stage's verification.
`SimProposer` drafts k placeholder tokens for every decode (the simulated tokens are synthetic, so only
the count matters). `AcceptanceModel` verifies them as a workload with per-draft acceptance `acceptance`
would: each draft position is accepted independently with that probability, the first rejection ends the
run, drawn from a seeded RNG so a run is deterministic.
"""

from __future__ import annotations

import random

from ppserve.request import Request
from ppserve.sched.proposers import Proposer

__all__ = ["AcceptanceModel", "SimProposer"]


class SimProposer(Proposer):
    """Proposes k copies of `token` for every request: what a proposer that always has a guess would."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, req: Request, k: int) -> list[int]:
        return [self.token] * max(0, k)


class AcceptanceModel:
    """How many of a verification's drafts are accepted: each with probability `acceptance`, independent
    per position, stopping at the first rejection (so the expected count is a + a**2 + ... + a**n)."""

    def __init__(self, acceptance: float, seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")
        self.acceptance = acceptance
        self._rng = random.Random(seed)

    def accepted(self, num_drafts: int) -> int:
        a, rng = self.acceptance, self._rng
        n = 0
        while n < num_drafts and rng.random() < a:
            n += 1
        return n
