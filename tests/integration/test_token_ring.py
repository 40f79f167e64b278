"""The token ring (scheduler.token_ring) on real stages: the last stage hands each step's sampled tokens
to stage 0, which embeds them in a microbatch formed before they came back. Greedy float32 output stays
equal to transformers in process and on Ray (socket links, TP groups, both Ray control planes), with
preemption, and with stop tokens (the one token a stopped request computed on the ring is thrown away)."""

from __future__ import annotations

import pytest

from ppserve import LLM, SamplingParams
from tests.oracle import ppserve_greedy, random_prompts, reference_greedy

MAX_NEW = 16
RING = ["scheduler.token_ring=true"]  # the default; spelled out so these tests keep testing the ring
NO_RING = ["scheduler.token_ring=false"]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(0, (1, 5, 17, 33, 64, 90))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


def _ring_steps(llm: LLM) -> int:
    return llm.engine.scheduler.max_in_flight - llm.engine.scheduler.num_stages


@pytest.mark.parametrize("pp,ring", [(2, True), (3, True), (2, False), (3, False)])
def test_in_process_equals_transformers_with_and_without_the_ring(tiny_llama_dir, prompts, expected, pp,
                                                                  ring):
    got, _ = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, executor="inproc", pipeline_parallel_size=pp,
                            token_budget=24, block_size=4, overrides=RING if ring else NO_RING)
    assert got == expected


@pytest.mark.parametrize("dispatch,pp,tp,link", [("connections", 2, 2, "auto"), ("compiled", 3, 1, "auto"),
                                                  ("connections", 2, 1, "torch")])
def test_ray_ring_equals_transformers(ray_session, tiny_llama_dir, prompts, expected, dispatch, pp, tp, link):
    """The ring over the CPU socket link (auto) and over torch.distributed p2p (gloo here, NCCL on GPUs)."""
    got, _ = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, pipeline_parallel_size=pp,
                            tensor_parallel_size=tp, token_budget=16, block_size=4,
                            overrides=RING + [f"parallel.dispatch={dispatch}", f"parallel.stage_link={link}"])
    assert got == expected


def test_ring_with_preemption(ray_session, tiny_llama_dir, prompts, expected):
    got, preemptions = ppserve_greedy(tiny_llama_dir, prompts, MAX_NEW, pipeline_parallel_size=2,
                                      token_budget=32, block_size=4, num_kv_blocks=40, overrides=RING)
    assert preemptions > 0
    assert got == expected


def test_ring_decodes_ride_and_stop_tokens_lose_nothing(tiny_llama_dir, prompts, expected):
    """Stop on a token each greedy answer reaches midway: the ring has then already computed the next
    token, which must not reach the output. Sampled with a seed, the ring changes nothing either."""
    stops = sorted({row[len(row) // 2] for row in expected})
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=stops),
              SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_k=20, seed=7, ignore_eos=True)]
    runs = {}
    for ring in (False, True):
        with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
                 token_budget=24, block_size=4, overrides=RING if ring else NO_RING) as llm:
            assert _ring_steps(llm) == int(ring)
            runs[ring] = [[(o.token_ids, o.finish_reason) for o in llm.generate(prompts, p)] for p in params]
            if ring:
                assert llm.engine.scheduler.ring is not None
    assert runs[True] == runs[False]
    stopped = runs[True][0]
    assert any(reason == "stop" and tokens[-1] in stops for tokens, reason in stopped)
    for (tokens, reason), full in zip(stopped, expected, strict=True):
        if reason == "stop":
            assert tokens == full[: len(tokens)]  # up to the stop token or eos, nothing after it
