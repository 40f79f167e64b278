"""Random prompts that the prefix cache cannot serve from one another.

A timed run must compute what its figure claims: a prefill TFLOP/s figure needs the whole prompt
computed, a TTFT figure a cold prompt. The engine keeps prefix caching on, as served; instead no two
prompts of one `PromptSource` start with the same token, so none shares a first KV block (of any block
size) with another, and a cached block can never stand in for a timed one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

FIRST_TOKEN = 3  # below it: pad, bos, eos in the check models' configs


class PromptSource:
    """Random token prompts over [FIRST_TOKEN, vocab), seeded; each starts with a token no earlier prompt
    from this source started with."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.unused_firsts = list(range(FIRST_TOKEN, vocab))
        self.rng.shuffle(self.unused_firsts)

    def draw(self, lengths: Sequence[int]) -> list[list[int]]:
        """One prompt per entry of `lengths`, that many tokens each."""
        if any(n < 1 for n in lengths):
            raise ValueError(f"a prompt needs at least one token, got lengths {list(lengths)}")
        if len(lengths) > len(self.unused_firsts):
            raise ValueError(f"{len(lengths)} more prompts asked of a source with {len(self.unused_firsts)} "
                             "first tokens left")
        return [[self.unused_firsts.pop()]
                + [self.rng.randrange(FIRST_TOKEN, self.vocab) for _ in range(n - 1)]
                for n in lengths]
