"""Greedy output of ppserve equals transformers token for token on SmolLM2-135M-Instruct (float32).

Covers token budgets, KV pressure that forces preemption, and pipeline depths 2 and 3 over Ray.
"""

from __future__ import annotations

import pytest

from tests.oracle import default_prompts, ppserve_greedy, reference_greedy

MAX_NEW = 32


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    return default_prompts(AutoTokenizer.from_pretrained(str(default_model_dir)))


@pytest.fixture(scope="module")
def expected(default_model_dir, prompts):
    return reference_greedy(default_model_dir, prompts, MAX_NEW)


def run(model_dir, prompts, **kwargs):
    return ppserve_greedy(model_dir, prompts, MAX_NEW, **kwargs)


def assert_same(got, expected):
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, (f"prompt {i}: first mismatch at token "
                        f"{next(j for j, (a, b) in enumerate(zip(g, e, strict=False)) if a != b)}")


@pytest.mark.parametrize("budget", [7, 64, 512])
def test_single_stage_budgets(default_model_dir, prompts, expected, budget):
    got, _ = run(default_model_dir, prompts, token_budget=budget)
    assert_same(got, expected)


def test_single_stage_preemption(default_model_dir, prompts, expected):
    # 64 blocks of 16 tokens hold ~1000 tokens: less than the eight prompts need at once.
    got, preemptions = run(default_model_dir, prompts, token_budget=512, num_kv_blocks=64, block_size=16)
    assert preemptions > 0
    assert_same(got, expected)


@pytest.mark.parametrize("pp,budget", [(2, 7), (2, 128), (3, 7), (3, 128)])
def test_pipeline_depths(ray_session, default_model_dir, prompts, expected, pp, budget):
    got, _ = run(default_model_dir, prompts, token_budget=budget, pipeline_parallel_size=pp)
    assert_same(got, expected)


def test_pipeline_preemption(ray_session, default_model_dir, prompts, expected):
    got, preemptions = run(default_model_dir, prompts, token_budget=128, pipeline_parallel_size=2,
                           num_kv_blocks=64, block_size=16)
    assert preemptions > 0
    assert_same(got, expected)
