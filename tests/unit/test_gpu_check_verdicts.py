"""The GPU check's pass/fail rules (ppserve/gpu_check/verdicts.py), as rules: no torch, no device."""

from __future__ import annotations

import pytest

from ppserve.gpu_check.verdicts import AGREE_FIRST, NEAR_TIE, greedy_verdict, logits_verdict


def test_every_prompt_must_agree_unless_it_parts_at_a_near_tie() -> None:
    assert greedy_verdict([24, 24, 24], [None, None, None], 24).ok
    assert greedy_verdict([24, 2], [None, NEAR_TIE / 2], 24).ok  # parted at a tie: two right answers
    assert greedy_verdict([AGREE_FIRST, 7], [1.5, 3.0], 24).ok  # late differences are drift, not errors
    # The old rule passed this: half the prompts agree on their first tokens.
    v = greedy_verdict([24, 0], [None, 2.0], 24)
    assert not v.ok and "clear winner" in v.failures[0]


def test_a_negative_margin_is_not_a_near_tie() -> None:
    # The old rule (margin <= NEAR_TIE) accepted any negative margin.
    v = greedy_verdict([24, 1], [None, -3.0], 24)
    assert not v.ok and "inconsistent reference" in v.failures[0]
    assert greedy_verdict([1], [-NEAR_TIE / 2], 24).ok


def test_a_difference_without_a_margin_fails_and_bad_input_is_refused() -> None:
    assert not greedy_verdict([0], [None], 24).ok
    with pytest.raises(ValueError):
        greedy_verdict([1, 2], [None], 24)
    assert greedy_verdict([2], [None], 2).ok  # fewer tokens than AGREE_FIRST: all of them must agree


def test_teacher_forced_logits_rules() -> None:
    assert logits_verdict("float32", 1024, 1e-3, 20.0, 1.0) == (True, [])
    ok, why = logits_verdict("float32", 999, 1e-3, 20.0, 1.0)
    assert not ok and "fewer than 1000" in why[0]
    ok, why = logits_verdict("bfloat16", 1024, 5.0, 20.0, 0.95)
    assert not ok and len(why) == 2
