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
    other = llm.generate([[5, 6, 7]],
                         SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    k1 = llm.generate([[5, 6, 7]],
                      SamplingParams(max_tokens=8, temperature=0.8, top_k=1, seed=3, ignore_eos=True))
    assert k1[0].token_ids == greedy


def test_sampler_top_p_and_top_k_masks():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    for seed in range(20):
        t = sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=seed)], [0])[0][0]
        assert t in (1, 2)
        t = sample(logits, [SamplingParams(temperature=1.0, top_p=0.3, seed=seed)], [0])[0][0]
        assert t == 1  # the top token alone carries more than 30 % of the mass


def test_sampled_tokens_follow_the_filtered_distribution():
    """The sampler draws from softmax(logits / T) restricted to top-k / top-p: frequencies over
    many independent rows of one batch match the expected probabilities."""
    torch.manual_seed(0)
    n = 6000
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))[None, :].repeat(n, 1)
    tokens, _ = sample(logits, [SamplingParams(temperature=1.0)] * n, [0] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=0.025, rtol=0)
    # top_k=2 renormalises over the two most likely; temperature 0.5 squares the odds (0.5 : 0.25 -> 4 : 1)
    tokens, _ = sample(logits, [SamplingParams(temperature=0.5, top_k=2)] * n, [0] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.8, 0.2, 0.0, 0.0]), atol=0.025, rtol=0)
    # top_p=0.7: the nucleus is {0, 1} (0.5 before token 1, 0.75 before token 2)
    tokens, _ = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * n, [0] * n)
    assert set(tokens) == {0, 1}


def test_a_mixed_batch_is_decided_with_one_transfer_to_the_host(monkeypatch):
    """Greedy, seeded and unseeded rows in one batch: no per-request .item() sync, one list of ids back."""
    calls = {"item": 0, "tolist": 0}
    for name in calls:
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    from ppserve.model.ops import native

    monkeypatch.setattr(native, "greedy_argmax", lambda: None)
    logits = torch.randn(6, 50)
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.2, top_k=5, seed=2),
              SamplingParams(), SamplingParams(temperature=0.9)]
    tokens, _ = sample(logits, params, [0, 3, 0, 1, 0, 2])
    assert calls == {"item": 0, "tolist": 1}
    assert tokens[0] == int(logits[0].argmax()) and tokens[4] == int(logits[4].argmax())


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 40)
    sp = SamplingParams(temperature=1.0, seed=77)
    alone = sample(logits[1:2], [sp], [5])[0]
    crowd = sample(logits, [SamplingParams(temperature=1.0), sp, SamplingParams(temperature=0.5, seed=3)],
                   [0, 5, 0])[0]
    assert crowd[1] == alone[0]


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    stop_at = greedy[3]
    out = llm.generate([[5, 6, 7]],
                       SamplingParams(max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True))[0]
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


# ---- penalties, min_tokens, logprobs --------------------------------------------------------------
def _history(prompt, outputs):
    return prompt + outputs, len(prompt)


def test_repetition_penalty_matches_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    from ppserve.worker.sampler import process_logits

    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    prompt, outputs = [3, 7, 7, 11], [7, 20, 3, 42]
    for penalty in (0.7, 1.3, 2.0):
        ours = process_logits(logits, SamplingParams(repetition_penalty=penalty), *_history(prompt, outputs),
                              ())
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + outputs]),
                                                           logits[None].clone())[0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_min_tokens_matches_transformers_processor():
    from transformers import MinNewTokensLengthLogitsProcessor

    from ppserve.worker.sampler import process_logits

    logits = torch.randn(50)
    prompt, eos = [1, 2, 3], [2, 9]
    sp = SamplingParams(min_tokens=3)
    for outputs in ([], [4], [4, 5], [4, 5, 6]):
        ids = torch.tensor([prompt + outputs])
        theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos)(ids, logits[None].clone())[0]
        ours = process_logits(logits, sp, *_history(prompt, outputs), eos)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # A request's own stop ids are kept out too (the sampler adds them to the model's eos ids).
    tokens, _ = sample(torch.zeros(1, 10) + torch.arange(10.0),
                       [SamplingParams(min_tokens=2, stop_token_ids=[9])], [0], histories=[_history([1], [])],
                       stop_ids=[8])
    assert tokens == [7]


def test_presence_and_frequency_penalties_follow_openai_formula():
    from ppserve.worker.sampler import process_logits

    logits = torch.zeros(10)
    prompt, outputs = [5, 5, 5], [1, 1, 2]  # the prompt does not count for these two
    out = process_logits(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                         *_history(prompt, outputs), ())
    expected = torch.zeros(10)
    expected[1] = -(2 * 0.25 + 0.5)
    expected[2] = -(1 * 0.25 + 0.5)
    torch.testing.assert_close(out, expected)


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(logprobs=2, repetition_penalty=3.0), SamplingParams()]
    tokens, lps = sample(logits, params, [0, 0], histories=[_history([1], []), _history([0], [])])
    ref = torch.log_softmax(logits[0], -1)
    assert lps[1] is None and tokens == [2, 0]  # the penalty moved row 0's argmax from 1 to 2
    lp, top = lps[0]
    assert lp == pytest.approx(ref[2].item())  # log-probabilities of the model, before the penalty
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(ref[1].item())


@pytest.mark.parametrize("pp", [1, 2])
def test_penalties_and_min_tokens_equal_transformers_generate(tiny_llama_dir, pp):
    """Greedy float32 with repetition_penalty and min_tokens: token for token transformers' generate."""
    from tests.oracle import _hf

    model = _hf(str(tiny_llama_dir))
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 2]]
    with LLM(str(tiny_llama_dir), dtype="float32", token_budget=16, block_size=4, num_kv_blocks=128,
             pipeline_parallel_size=pp, executor="inproc") as llm:
        plain = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, repetition_penalty=1.8, ignore_eos=True))
        # min_tokens: the greedy first token is made an end-of-sequence id, and may not end the request early.
        stop = plain[0].token_ids[0]
        held = llm.generate(prompts[:1], SamplingParams(max_tokens=12, min_tokens=4, stop_token_ids=[stop],
                                                        ignore_eos=True))[0]
    with torch.inference_mode():
        for p, o in zip(prompts, outs, strict=True):
            g = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                               pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            assert o.token_ids == g[0, len(p):].tolist()
        assert outs[0].token_ids != plain[0].token_ids  # the penalty changed something
        g = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, min_new_tokens=4,
                           eos_token_id=[stop], pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long))
        expected = g[0, len(prompts[0]):].tolist()
        expected = expected[: expected.index(stop) + 1] if stop in expected else expected
        assert held.token_ids == expected and len(held.token_ids) >= 4


def test_logprobs_and_n_through_the_engine(llm):
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, logprobs=2, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [1, 2]], sp)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # the choices differ (seeds 7, 8, 9)
    again = llm.generate([[5, 6, 7], [1, 2]], sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # and each is reproducible
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        for lp, top in o.logprobs:
            assert len(top) == 2 and 0 >= top[0][1] >= top[1][1]
            assert lp <= top[0][1] + 1e-6  # no token is likelier than the most likely one
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, min_tokens=5))


def test_generation_config_supplies_defaults_and_eos(tiny_llama_dir, tmp_path):
    """generation_config.json: its sampling fields are the defaults when a caller sets none, and its
    end-of-sequence ids end a request like the config's."""
    import json
    import shutil

    from ppserve.model.loader import read_generation_defaults

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    with LLM(str(model), dtype="float32", token_budget=16, block_size=4, num_kv_blocks=64) as llm:
        greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    stop = greedy[2]
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.6, "top_k": 0, "max_new_tokens": 5, "repetition_penalty": 1.0,
         "eos_token_id": [stop]}))
    defaults, eos = read_generation_defaults(model)
    assert defaults == {"temperature": 0.0, "top_k": -1, "max_tokens": 5, "repetition_penalty": 1.0}
    assert eos == (stop,)
    with LLM(str(model), dtype="float32", token_budget=16, block_size=4, num_kv_blocks=64) as llm:
        assert stop in llm.engine.eos_token_ids
        assert llm.default_sampling_params() == SamplingParams(**defaults)
        out = llm.generate([[5, 6, 7]])[0]  # no SamplingParams: the model's defaults
        assert out.token_ids == greedy[: greedy.index(stop) + 1] and out.finish_reason == "stop"
        longer = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert longer.token_ids == greedy and longer.finish_reason == "length"
