"""Phi-3, the second model family: fused qkv and gate-up checkpoints, token-identical to transformers."""

from __future__ import annotations

import json
import random

import pytest

from ppserve import LLM, SamplingParams
from ppserve.model.loader import read_hf_config
from ppserve.model.registry import describe_model
from tests.model_helpers import make_tiny_llama_dir
from tests.oracle import reference_greedy

MAX_NEW = 12


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("phi3") / "phi3", arch="phi3", num_layers=4, hidden=64,
                               heads=4, kv_heads=2, intermediate=96)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 30, 70)]


@pytest.fixture(scope="module")
def expected(phi3_dir, prompts):
    return reference_greedy(phi3_dir, prompts, MAX_NEW)


def test_the_checkpoint_is_fused_and_described(phi3_dir):
    from safetensors import safe_open

    (path,) = phi3_dir.glob("*.safetensors")
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    assert ("model.layers.0.self_attn.qkv_proj.weight" in names
            and "model.layers.0.mlp.gate_up_proj.weight" in names)
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    arch = describe_model(read_hf_config(phi3_dir))
    assert arch.architecture == "Phi3ForCausalLM" and arch.num_kv_heads == 2 and arch.intermediate_size == 96


@pytest.mark.parametrize("pp", [1, 2])
def test_phi3_equals_transformers_in_process(phi3_dir, prompts, expected, pp):
    with LLM(str(phi3_dir), dtype="float32", executor="inproc", pipeline_parallel_size=pp, token_budget=16,
             block_size=4) as llm:
        got = [o.token_ids
               for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
    assert got == expected


def test_phi3_equals_transformers_on_a_ray_pipeline_with_tp(ray_session, phi3_dir, prompts, expected):
    """pp=2 x tp=2: each rank keeps its slice of every fused tensor."""
    with LLM(str(phi3_dir), dtype="float32", pipeline_parallel_size=2, tensor_parallel_size=2,
             token_budget=16, block_size=4) as llm:
        got = [o.token_ids
               for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
    assert got == expected


def test_unsupported_phi3_variants_are_refused(phi3_dir):
    cfg = read_hf_config(phi3_dir)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        describe_model({**cfg, "partial_rotary_factor": 0.75})
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    with pytest.raises(ValueError, match="longrope"):
        describe_model({**cfg, "rope_scaling": longrope})
    assert describe_model({**cfg, "sliding_window": 2047}).sliding_window == 2047
    json.dumps(cfg)  # the config stays plain JSON
