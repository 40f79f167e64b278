"""bfloat16: ppserve against transformers run in bfloat16 on the same weights (SmolLM2-135M-Instruct).

bf16 is checked by tolerance and agreement, not equality: two correct bf16 implementations round
differently and drift apart after a few dozen tokens (ARCHITECTURE.md#tests-and-benchmarks). The float32
fast path is untouched: exactness stays with test_model.py and test_equality_default.py.
"""

from __future__ import annotations

import pytest
import torch

from ppserve import LLM, SamplingParams
from ppserve.model.attention import AttentionMetadata, allocate_kv_cache
from ppserve.model.loader import read_hf_config
from tests.oracle import default_prompts, greedy_continuations

MAX_NEW = 16
AGREE_FIRST = 4  # greedy tokens that must agree on every prompt


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    return default_prompts(AutoTokenizer.from_pretrained(str(default_model_dir)))


@pytest.fixture(scope="module")
def hf_bf16(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def _ppserve_bf16_model(model_dir):
    from pathlib import Path

    from ppserve.model.loader import iter_weights
    from ppserve.model.registry import build_stage_model, describe_model

    arch = describe_model(read_hf_config(Path(model_dir)))
    model = build_stage_model(arch, 0, arch.num_layers, dtype=torch.bfloat16)
    model.load_weights(iter_weights(Path(model_dir), 0, arch.num_layers, arch.num_layers, need_embed=True,
                                    need_head=True))
    return model.eval(), arch


def test_prefill_logits_within_bf16_tolerance(default_model_dir, prompts, hf_bf16):
    model, arch = _ppserve_bf16_model(default_model_dir)
    block_size = 16
    for p in (prompts[0], prompts[4]):  # a short chat prompt and the 700+ token one
        nb = -(-len(p) // block_size)
        caches = allocate_kv_cache(arch.num_layers, nb + 1, block_size, arch.num_kv_heads, arch.head_dim,
                                   torch.bfloat16, "cpu")
        meta = AttentionMetadata.build([len(p)], [len(p)], [list(range(1, nb + 1))], block_size)
        with torch.inference_mode():
            hidden = model(torch.tensor(p), None, torch.arange(len(p)), caches, meta)
            ours = model.compute_logits(hidden[-1:])[0]
            ref = hf_bf16(torch.tensor([p])).logits[0, -1].float()
        scale = ref.abs().max().item()
        err = (ours - ref).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(ours, ref, dim=0).item()
        print(f"prompt of {len(p)} tokens: max |logit diff| {err:.3f} (logit scale {scale:.1f}), "
              f"cosine {cos:.5f}")
        assert cos > 0.999
        assert err < 0.05 * scale  # a few bf16 ulps of the largest logits
        assert ours.argmax().item() == ref.argmax().item()


def test_greedy_agrees_with_transformers_bf16(default_model_dir, prompts, hf_bf16):
    ref = greedy_continuations(hf_bf16, prompts, MAX_NEW)
    with LLM(str(default_model_dir), dtype="bfloat16", token_budget=64) as llm:
        got = [o.token_ids
               for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
    agree = [next((j for j, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), MAX_NEW)
             for g, r in zip(got, ref, strict=True)]
    print(f"bf16 greedy agreement with transformers bf16 (tokens before the first difference, of {MAX_NEW}): "
          f"{agree}")
    # Where a prompt does not agree on its first tokens, the reference itself must be at a near-tie
    # there (two bf16 implementations may break a tie either way), not at a clear winner. Three of these
    # eight prompts have their first token at a reference margin of 0, 0.125 and 0.25 (one or two bf16
    # steps at logit ~29), so a count of agreeing prompts alone would only measure which way ties fall.
    assert sum(a >= AGREE_FIRST for a in agree) >= len(agree) // 2, agree
    for p, g, r, j in zip(prompts, got, ref, agree, strict=True):
        if j >= AGREE_FIRST:
            continue
        with torch.inference_mode():
            logits = hf_bf16(torch.tensor([p + r[:j]])).logits[0, -1].float()
        margin = (logits[r[j]] - logits[g[j]]).item()
        print(f"prompt of {len(p)} tokens differs at token {j}: reference margin {margin:.3f}")
        assert margin <= 0.25, (j, margin)  # ~2 bf16 ulps at a logit scale of 16-32


def test_kv_cache_dtype_of_its_own(default_model_dir, prompts):
    """A float32 model over a bfloat16 KV cache: twice the blocks from the same memory budget, and greedy
    output that follows the all-float32 run on its first tokens (rounding K/V only perturbs logits
    slightly)."""
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    runs = {}
    for kv in ("auto", "bfloat16"):
        with LLM(str(default_model_dir), dtype="float32", kv_cache_dtype=kv, token_budget=64,
                 overrides=["cache.kv_cache_memory=67108864"]) as llm:
            runs[kv] = ([o.token_ids for o in llm.generate(prompts, params)],
                        llm.engine.stats().kv_blocks_total)
    (full, blocks_full), (half, blocks_half) = runs["auto"], runs["bfloat16"]
    assert blocks_half == 2 * blocks_full
    agree = [next((j for j, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), MAX_NEW)
             for g, r in zip(half, full, strict=True)]
    print(f"bf16 KV cache vs float32 KV cache, tokens before the first difference (of {MAX_NEW}): {agree}")
    assert sum(a >= AGREE_FIRST for a in agree) >= len(agree) - 1, agree
