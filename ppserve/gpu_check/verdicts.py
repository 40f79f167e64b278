"""The rules the correctness phases pass or fail by, apart from any torch so they are unit-tested as rules.

Greedy agreement: two correct implementations part ways only where the model is at a near-tie (two
logits within rounding of each other). So every prompt must agree with the reference on its first
AGREE_FIRST tokens, unless its first difference is a near-tie in the reference's own logits: the margin
between the reference's token and ours, |margin| <= NEAR_TIE. A negative margin means the reference's
forward prefers our token although its generate picked the other: beyond NEAR_TIE that is not a tie
but an inconsistent reference, and fails too. One prompt that fails fails the phase (a majority is not
enough: half the prompts agreeing would hide a kernel that is wrong for one sequence length).

The check's verdict: each phase passed, failed, or was not run (never started, or nothing to run there:
no CUDA, no pytest, every test skipped). Not run is neither a pass nor a failure: the check fails (exit
status 1) on a failure only, and says what it did not run.

Teacher-forced logits (the figure that does not depend on where greedy paths split): over >= 1,000
positions, top-1 agreement where the reference's own top two are more than a tie apart, and the largest
logit error against the logits' scale. A run whose reference ties at more than MAX_NEAR_TIE_FRACTION of
its positions fails (its check model is too flat to show a wrong kernel; see models.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

AGREE_FIRST = 4
NEAR_TIE = 0.25  # logits: ~2 bf16 steps at logit ~30, ~4 at ~10
MIN_POSITIONS = 1000  # teacher-forced positions a GPU run must cover
MAX_NEAR_TIE_FRACTION = 0.25  # of the teacher-forced positions, at most this many near-ties
# dtype -> (largest |error| / largest |reference logit|, top-1 agreement at decided positions)
LOGIT_LIMITS = {"float32": (1e-3, 1.0), "bfloat16": (0.1, 0.99)}


PASS, FAIL, NOT_RUN = "pass", "FAIL", "not run"


def phase_status(result: dict[str, Any]) -> str:
    """A phase's status from its JSON: `not_run` (the reason) says it did not run, else `ok` decides."""
    if result.get("not_run"):
        return NOT_RUN
    return PASS if result.get("ok") else FAIL


def check_verdict(phases: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The phases by status, in their order: {"passed": [...], "failed": [...], "not_run": [...]}."""
    status = {name: phase_status(r) for name, r in phases.items()}
    return {key: [n for n, st in status.items() if st == want]
            for key, want in (("passed", PASS), ("failed", FAIL), ("not_run", NOT_RUN))}


def verdict_line(verdict: dict[str, list[str]]) -> str:
    """FAILED if a phase failed, else incomplete if one was not run, else passed; the phases by name."""
    head = "FAILED" if verdict["failed"] else "incomplete" if verdict["not_run"] else "passed"
    parts = [f"{len(verdict['passed'])} passed"]
    for key, label in (("failed", "failed"), ("not_run", "not run")):
        names = verdict[key]
        parts.append(f"{len(names)} {label}" + (f" ({', '.join(names)})" if names else ""))
    return f"gpu check {head}: " + ", ".join(parts)


# pytest's last line under -q: "3 passed, 2 skipped, 1 warning in 4.1s", "34 skipped, 11 deselected in 1.8s".
PYTEST_PASSED = re.compile(r"\b(\d+) passed\b")
PYTEST_NO_TESTS = 5  # pytest's exit status when it collected no test


def pytest_status(returncode: int, last_line: str) -> str:
    """A pytest run of the gpu-marked tests: PASS only if it ended clean with a test passed; clean without
    one (every test skipped or deselected, none collected) it tested nothing: NOT_RUN; else FAIL."""
    passed = sum(int(n) for n in PYTEST_PASSED.findall(last_line))
    if returncode == 0 and passed > 0:
        return PASS
    return NOT_RUN if returncode in (0, PYTEST_NO_TESTS) else FAIL


@dataclass
class GreedyVerdict:
    ok: bool
    tokens_before_first_difference: list[int]
    failures: list[str] = field(default_factory=list)


def greedy_verdict(first_difference: Sequence[int], margins: Sequence[float | None],
                   num_tokens: int) -> GreedyVerdict:
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
                   need_positions: int = MIN_POSITIONS,
                   near_tie_fraction: float = 0.0) -> tuple[bool, list[str]]:
    """Whether teacher-forced logits in `dtype` are close enough; the reasons when not."""
    rel_limit, top1_limit = LOGIT_LIMITS[dtype]
    reasons = []
    if positions < need_positions:
        reasons.append(f"{positions} positions compared, fewer than {need_positions}")
    if near_tie_fraction > MAX_NEAR_TIE_FRACTION:
        reasons.append(f"{near_tie_fraction:.0%} of the positions are near-ties, over "
                       f"{MAX_NEAR_TIE_FRACTION:.0%}: top-1 agreement tells nothing there")
    if max_abs_err > rel_limit * max(max_abs_ref, 1.0):
        reasons.append(f"max |logit error| {max_abs_err:.3g} over {rel_limit:g} x the logits' scale "
                       f"{max_abs_ref:.3g}")
    if top1_decided < top1_limit:
        reasons.append(f"top-1 agreement {top1_decided:.4f} at decided positions, under {top1_limit}")
    return not reasons, reasons
