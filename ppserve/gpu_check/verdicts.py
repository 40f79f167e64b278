"""The rules the correctness phases pass or fail by, apart from any torch so they are unit-tested as rules.

Greedy agreement: two correct implementations part ways only where the model is at a near-tie (two
logits within rounding of each other). So every prompt must agree with the reference on its first
AGREE_FIRST tokens, unless its first difference is a near-tie in the reference's own logits: the margin
between the reference's token and ours, |margin| <= NEAR_TIE. A negative margin means the reference's
forward prefers our token although its generate picked the other: beyond NEAR_TIE that is not a tie
but an inconsistent reference, and fails too. One prompt that fails fails the phase (a majority is not
enough: half the prompts agreeing would hide a kernel that is wrong for one sequence length).

Teacher-forced logits (the figure that does not depend on where greedy paths split): over >= 1,000
positions, top-1 agreement with the reference where the reference's own top two are more than a tie
apart, and the largest logit error against the logits' scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

AGREE_FIRST = 4
NEAR_TIE = 0.25  # logits: ~2 bf16 steps at logit ~30, ~4 at ~10
MIN_POSITIONS = 1000  # teacher-forced positions a GPU run must cover
# dtype -> (largest |error| / largest |reference logit|, top-1 agreement at decided positions)
LOGIT_LIMITS = {"float32": (1e-3, 1.0), "bfloat16": (0.1, 0.99)}


@dataclass
class GreedyVerdict:
    ok: bool
    tokens_before_first_difference: list[int]
    failures: list[str] = field(default_factory=list)


def greedy_verdict(first_difference: Sequence[int], margins: Sequence[float | None], num_tokens: int) -> GreedyVerdict:
    """`first_difference[i]`: tokens prompt i agreed on before the first difference (num_tokens if none);
    `margins[i]`: the reference's logit of its token minus ours at that difference (None if none)."""
    if len(first_difference) != len(margins) or not first_difference:
        raise ValueError("one first-difference index and one margin per prompt, at least one prompt")
    need = min(AGREE_FIRST, num_tokens)
    failures = []
    for i, (j, m) in enumerate(zip(first_difference, margins, strict=True)):
        if j >= need:
            continue
        if m is None:
            failures.append(f"prompt {i}: differs at token {j} with no margin measured")
        elif abs(m) > NEAR_TIE:
            what = "a clear winner" if m > 0 else "an inconsistent reference (negative margin)"
            failures.append(f"prompt {i}: differs at token {j}, margin {m:+.3f}: {what}, not a near-tie")
    return GreedyVerdict(not failures, list(first_difference), failures)


def logits_verdict(dtype: str, positions: int, max_abs_err: float, max_abs_ref: float, top1_decided: float,
                   need_positions: int = MIN_POSITIONS) -> tuple[bool, list[str]]:
    """Whether teacher-forced logits in `dtype` are close enough; the reasons when not."""
    rel_limit, top1_limit = LOGIT_LIMITS[dtype]
    reasons = []
    if positions < need_positions:
        reasons.append(f"{positions} positions compared, fewer than {need_positions}")
    if max_abs_err > rel_limit * max(max_abs_ref, 1.0):
        reasons.append(f"max |logit error| {max_abs_err:.3g} over {rel_limit:g} x the logits' scale {max_abs_ref:.3g}")
    if top1_decided < top1_limit:
        reasons.append(f"top-1 agreement {top1_decided:.4f} at decided positions, under {top1_limit}")
    return not reasons, reasons
