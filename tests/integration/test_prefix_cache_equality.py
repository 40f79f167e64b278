"""Prefix caching changes nothing in the tokens: greedy float32 output with caching on equals caching off
and transformers, at pp 1/2/3, tp 2, odd budgets, preemption and eviction under KV pressure, a fully
cached block-aligned prompt, n > 1 siblings in one microbatch and a prompt that follows another's
in-flight chunk; and a chat's next turn hits the previous answer."""

from __future__ import annotations

import json

import pytest

from ppserve import LLM, SamplingParams
from tests.oracle import random_prompts, reference_greedy

MAX_NEW = 10
BLOCK = 4


@pytest.fixture(scope="module")
def prompts():
    system = random_prompts(1, (24,))[0]  # 6 full blocks shared by every prompt but the last
    tails = random_prompts(2, (1, 5, 9, 17, 30))
    # system: block-aligned
    return [system + t for t in tails] + [system, system, random_prompts(3, (13,))[0]]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


def generate(model_dir, prompts, n=1, **kwargs):
    """Greedy tokens of every prompt (n choices each), the scheduler's prefix-cache counters, preemptions."""
    with LLM(str(model_dir), dtype="float32", block_size=BLOCK, **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, n=n))
        s = llm.engine.scheduler
        return [o.token_ids for o in outs], s.blocks, s.num_preemptions


@pytest.mark.parametrize("pp,budget", [(1, 7), (2, 13), (3, 24)])
def test_caching_on_equals_transformers(tiny_llama_dir, prompts, expected, pp, budget):
    on, blocks, _ = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=pp,
                             token_budget=budget)
    assert on == expected
    # every prompt after the first shares most of the system prompt
    assert blocks.num_hit_tokens >= 5 * 24 - 8


def test_caching_off_equals_transformers(tiny_llama_dir, prompts, expected):
    off, blocks, _ = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=2,
                              token_budget=13, enable_prefix_caching=False)
    assert off == expected
    assert blocks.num_hit_tokens == 0 and blocks.num_cached == 0


def test_tensor_parallel_pipeline_with_caching(ray_session, tiny_llama_dir, prompts, expected):
    got, blocks, _ = generate(tiny_llama_dir, prompts, pipeline_parallel_size=2, tensor_parallel_size=2,
                              token_budget=16)
    assert got == expected and blocks.num_hit_tokens > 0


def test_preemption_and_eviction_under_kv_pressure(tiny_llama_dir, prompts, expected):
    """A cache smaller than the working set: requests are preempted (and re-hit what survives of their
    blocks) and cached blocks are evicted for new ones; the tokens do not change."""
    got, blocks, preemptions = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=2,
                                        token_budget=16, num_kv_blocks=24)
    assert got == expected
    assert preemptions > 0 and blocks.num_hit_tokens > 0 and blocks.num_evictions > 0


def test_n_choices_share_the_prompt_in_one_microbatch(tiny_llama_dir, prompts, expected):
    """Greedy n=3: three requests with one prompt, admitted in the same step; the second and third hit
    the blocks the first one's chunk fills in that very microbatch."""
    got, blocks, _ = generate(tiny_llama_dir, prompts[4:5], n=3, executor="inproc", token_budget=200)
    assert got == [expected[4]] * 3
    assert blocks.num_hit_tokens == 2 * (len(prompts[4]) - 1) // BLOCK * BLOCK


def test_next_chat_turn_hits_the_previous_answer(tiny_llama_dir, prompts, tmp_path):
    first = prompts[1]
    with LLM(str(tiny_llama_dir), dtype="float32", block_size=BLOCK, executor="inproc",
             pipeline_parallel_size=2, token_budget=16) as llm:
        sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        answer = llm.generate([first], sp)[0].token_ids
        turn2 = first + answer + random_prompts(4, (6,))[0]
        out = llm.generate([turn2], sp)[0]
        got = out.token_ids
        cached = llm.engine.scheduler.blocks.num_hit_tokens
        trace = json.loads(llm.save_trace(tmp_path / "trace.json").read_text())
    assert out.num_cached_tokens == cached
    # The trace's counter track: the hit rate and cached blocks as they changed, ending at the engine's.
    samples = [e["args"] for e in trace["traceEvents"] if e.get("ph") == "C" and e["name"] == "prefix cache"]
    assert samples and samples[-1]["hit_rate"] > 0 and samples[-1]["cached_blocks"] > 0
    # The answer's KV is computed for all but its last token (sampled, never fed back).
    assert cached >= (len(first) + len(answer) - 1) // BLOCK * BLOCK
    assert got == reference_greedy(tiny_llama_dir, [turn2], MAX_NEW)[0]
