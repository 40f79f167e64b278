"""Sampling and stop rules through the real engine: seeds, top-k/top-p, stop strings and ids, eos."""

from __future__ import annotations

import pytest
import torch

from ppserve import LLM, SamplingParams
from ppserve.worker.sampler import sample


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", token_budget=16, block_size=4, num_kv_blocks=128) as llm:
        yield llm


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], sp)[0].token_ids
    crowd = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], sp)[1].token_ids
    assert alone == crowd
    other = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    k1 = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.8, top_k=1, seed=3, ignore_eos=True))
    assert k1[0].token_ids == greedy


def test_sampler_top_p_and_top_k_masks():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    for seed in range(20):
        t = sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=seed)], [0])[0]
        assert t in (1, 2)
        t = sample(logits, [SamplingParams(temperature=1.0, top_p=0.3, seed=seed)], [0])[0]
        assert t == 1  # the top token alone carries more than 30 % of the mass


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    stop_at = greedy[3]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(stop_at) + 1]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10))[0]
    eos = llm.engine.eos_token_ids
    if any(t in eos for t in greedy):
        assert out.finish_reason == "stop"
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_stop_strings_and_detokenization(default_model_dir):
    with LLM(str(default_model_dir), dtype="float32", token_budget=64) as llm:
        tok = llm.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
        full = llm.generate([prompt], SamplingParams(max_tokens=16))[0]
        assert full.text.strip() == "The capital of France is Paris."
        assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
        cut = llm.generate([prompt], SamplingParams(max_tokens=16, stop=["France"]))[0]
        assert cut.finish_reason == "stop" and cut.text.strip() == "The capital of"
        # Multibyte characters are never split across streamed pieces.
        emoji = llm.generate(["Répète: ça va, 東京 🚀 ok"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert "\ufffd" not in emoji.text
