"""The GPU check's pass/fail rules (ppserve/gpu_check/verdicts.py), as rules: no torch, no device."""

from __future__ import annotations

import pytest

from ppserve.gpu_check.verdicts import (
    AGREE_FIRST,
    FAIL,
    MAX_NEAR_TIE_FRACTION,
    NEAR_TIE,
    NOT_RUN,
    PASS,
    check_verdict,
    greedy_verdict,
    logits_verdict,
    phase_status,
    pytest_status,
    verdict_line,
)


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


def test_a_check_model_that_ties_everywhere_fails_the_logits_rule() -> None:
    assert logits_verdict("bfloat16", 1024, 0.5, 20.0, 1.0, near_tie_fraction=MAX_NEAR_TIE_FRACTION)[0]
    ok, why = logits_verdict("bfloat16", 1024, 0.5, 20.0, 1.0, near_tie_fraction=0.65)
    assert not ok and "near-ties" in why[0]


def test_each_phase_passed_failed_or_was_not_run() -> None:
    assert phase_status({"ok": True}) == PASS
    assert phase_status({"ok": False, "error": "x"}) == FAIL
    assert phase_status({}) == FAIL  # no verdict is no pass
    assert phase_status({"not_run": "out of time"}) == NOT_RUN
    assert phase_status({"ok": False, "not_run": "every test skipped"}) == NOT_RUN
    v = check_verdict({"a": {"ok": True}, "b": {"not_run": "no CUDA"}, "c": {"ok": False}, "d": {"ok": True}})
    assert v == {"passed": ["a", "d"], "failed": ["c"], "not_run": ["b"]}
    assert verdict_line(v) == "gpu check FAILED: 2 passed, 1 failed (c), 1 not run (b)"
    assert (verdict_line({"passed": ["a"], "failed": [], "not_run": []})
            == "gpu check passed: 1 passed, 0 failed, 0 not run")
    assert verdict_line({"passed": ["a"], "failed": [], "not_run": ["b"]}).startswith("gpu check incomplete:")


def test_a_pytest_run_passes_only_if_a_test_passed() -> None:
    assert pytest_status(0, "12 passed, 3 skipped, 1 warning in 4.10s") == PASS
    assert pytest_status(0, "34 skipped, 11 deselected in 1.78s") == NOT_RUN  # no CUDA: all skipped
    assert pytest_status(5, "11 deselected in 0.20s") == NOT_RUN  # nothing collected
    assert pytest_status(0, "") == NOT_RUN
    assert pytest_status(1, "1 failed, 11 passed in 4.10s") == FAIL
    assert pytest_status(2, "1 error in 0.30s") == FAIL
