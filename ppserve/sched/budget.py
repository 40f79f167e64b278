"""Token-budget accounting for one microbatch: grants chunks until the budget or the seat cap is spent."""

from __future__ import annotations


class TokenBudget:
    """Grants tokens to requests for one microbatch.

    `token_budget=None` means no token limit (orca/static admit whole prompts); `max_seqs` caps the number
    of requests in the microbatch.
    """

    def __init__(self, token_budget: int | None, max_seqs: int | None = None) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.tokens_used = 0
        self.num_seqs = 0

    @property
    def tokens_left(self) -> int | None:
        return None if self.token_budget is None else self.token_budget - self.tokens_used

    @property
    def has_seat(self) -> bool:
        return self.max_seqs is None or self.num_seqs < self.max_seqs

    def can_fit(self, num_tokens: int) -> bool:
        left = self.tokens_left
        return self.has_seat and (left is None or num_tokens <= left)

    def chunk(self, wanted: int) -> int:
        """How many of `wanted` tokens fit now (0 when no seat or no tokens are left)."""
        if not self.has_seat:
            return 0
        left = self.tokens_left
        return wanted if left is None else max(0, min(wanted, left))

    def spend(self, num_tokens: int) -> None:
        left = self.tokens_left
        if num_tokens <= 0 or (left is not None and num_tokens > left) or not self.has_seat:
            raise AssertionError(f"budget overdrawn: {num_tokens} tokens with {left} left, seats {self.num_seqs}")
        self.tokens_used += num_tokens
        self.num_seqs += 1
