"""Qwen3, Qwen3-MoE and Mixtral: tiny random HF checkpoints, greedy float32 token-identical to transformers.

The Qwen3-MoE model has four layers with layer 1 dense (mlp_only_layers), so pp=3's even split
[0, 2) [2, 3) [3, 4) puts stage boundaries between sparse layers and one stage holds both kinds.
"""

from __future__ import annotations

import pytest
import torch

from ppserve import LLM, SamplingParams
from ppserve.model.loader import load_stage_model, read_hf_config
from ppserve.model.registry import describe_model
from tests.model_helpers import make_tiny_qwen3_dir
from tests.oracle import greedy_continuations, ppserve_greedy, random_prompts, reference_greedy

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, (1, 9, 30, 70))


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return make_tiny_qwen3_dir(tmp_path_factory.mktemp("qwen3moe") / "m", arch="qwen3_moe")


@pytest.fixture(scope="module")
def qwen3_moe_expected(qwen3_moe_dir, prompts):
    return reference_greedy(qwen3_moe_dir, prompts, MAX_NEW)


def test_qwen3_moe_is_described_with_its_dense_layer(qwen3_moe_dir):
    arch = describe_model(read_hf_config(qwen3_moe_dir))
    assert arch.architecture == "Qwen3MoeForCausalLM" and arch.head_dim == 32 and arch.hidden_size == 64
    assert arch.moe is not None and arch.moe.sparse_layers == (0, 2, 3)
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.expert_intermediate_size) == (8, 2, 32)
    cfg = read_hf_config(qwen3_moe_dir)
    sparse_every_other = describe_model({**cfg, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert sparse_every_other.moe.sparse_layers == (1, 3)


@pytest.mark.parametrize(("pp", "budget"), [(2, 13), (3, 7)])  # odd budgets: chunked prefills (pp=1: below)
def test_qwen3_moe_equals_transformers_in_process(qwen3_moe_dir, prompts, qwen3_moe_expected, pp, budget):
    got, _ = ppserve_greedy(qwen3_moe_dir, prompts, MAX_NEW, executor="inproc", pipeline_parallel_size=pp,
                            token_budget=budget, block_size=4)
    assert got == qwen3_moe_expected


def test_qwen3_moe_with_preemption(qwen3_moe_dir, prompts, qwen3_moe_expected):
    got, preemptions = ppserve_greedy(qwen3_moe_dir, prompts, MAX_NEW, executor="inproc",
                                      pipeline_parallel_size=2, token_budget=32, block_size=4,
                                      num_kv_blocks=24)
    assert preemptions > 0
    assert got == qwen3_moe_expected


def test_qwen3_moe_on_a_ray_pipeline_with_tp(ray_session, qwen3_moe_dir, prompts, qwen3_moe_expected):
    """pp=2 x tp=2: every rank holds half of each expert's intermediate dimension, read from the slices."""
    got, _ = ppserve_greedy(qwen3_moe_dir, prompts, MAX_NEW, pipeline_parallel_size=2, tensor_parallel_size=2,
                            token_budget=16, block_size=4)
    assert got == qwen3_moe_expected


@pytest.mark.parametrize(("arch", "fused", "pp"),
                         [("qwen3", False, 2), ("mixtral", False, 3), ("qwen3_moe", True, 1)])
def test_other_families_and_the_fused_layout_equal_transformers(tmp_path, prompts, arch, fused, pp):
    model_dir = make_tiny_qwen3_dir(tmp_path / arch, arch=arch, fused=fused, num_layers=3, experts=4, seed=1)
    prompts = prompts[1:]  # a prefill in two or more chunks each; transformers' Mixtral is slow on CPU
    got, _ = ppserve_greedy(model_dir, prompts, MAX_NEW, executor="inproc", pipeline_parallel_size=pp,
                            token_budget=11, block_size=4)
    assert got == reference_greedy(model_dir, prompts, MAX_NEW)


def test_bf16_agrees_with_transformers_bf16(qwen3_moe_dir, prompts):
    """bf16 drifts on both sides (and a router near a tie may pick another expert): agreement, not
    equality."""
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.bfloat16).eval()
    prompts, new = prompts[1:3], 8
    ref = greedy_continuations(ref_model, prompts, new)
    with LLM(str(qwen3_moe_dir), dtype="bfloat16", executor="inproc", pipeline_parallel_size=2,
             token_budget=16, block_size=4) as llm:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
    agree = [next((j for j, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), new)
             for g, r in zip(got, ref, strict=True)]
    print(f"bf16 Qwen3-MoE greedy agreement (tokens before the first difference, of {new}): {agree}")
    assert max(agree) >= 4 and min(agree) >= 1, agree


def test_unsupported_moe_configs_are_refused_by_field(qwen3_moe_dir):
    cfg = read_hf_config(qwen3_moe_dir)
    for field, value in [("shared_expert_intermediate_size", 64), ("n_group", 4), ("topk_group", 2),
                         ("scoring_func", "sigmoid"), ("n_shared_experts", 1)]:
        with pytest.raises(ValueError, match=f"{field}="):
            describe_model({**cfg, field: value})
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        describe_model({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="use_sliding_window"):
        describe_model({**cfg, "use_sliding_window": True})


def test_a_checkpoint_missing_an_expert_is_refused(qwen3_moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(qwen3_moe_dir / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(state, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((qwen3_moe_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.gate_up: expert 5 up"):
        load_stage_model(broken, 2, 4)


def test_qwen3_moe_through_grpc_and_http(qwen3_moe_dir, prompts, qwen3_moe_expected, tmp_path):
    """The front doors serve an MoE model as any other: token-id prompts over gRPC equal transformers, and the
    OpenAI-compatible HTTP API answers with the same number of tokens."""
    import httpx

    from tests.server_helpers import ready_client, running_server, set_args

    with running_server(tmp_path, *set_args(f"model.model={qwen3_moe_dir}",
                                            "parallel.pipeline_parallel_size=1", "parallel.executor=inproc",
                                            "cache.block_size=4")) as server, \
            ready_client(server) as client:
        got = [client.generate(p, max_tokens=MAX_NEW, ignore_eos=True, temperature=0.0).token_ids
               for p in prompts[:2]]
        assert got == qwen3_moe_expected[:2]
        assert server.http_url is not None
        name = httpx.get(f"{server.http_url}/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(f"{server.http_url}/completions", timeout=60, json={
            "model": name, "prompt": prompts[1], "max_tokens": 5, "temperature": 0.0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5


def test_both_layouts_give_each_tp_rank_the_same_expert_slices(tmp_path):
    """Rank 1 of 2 reads the second half of every expert's intermediate dimension, from per-expert tensors
    and from the fused ones alike (no process group needed to load)."""
    from ppserve.model.parallel import TPContext

    hub, fused = (make_tiny_qwen3_dir(tmp_path / name, arch="mixtral", num_layers=1, experts=4, fused=f,
                                      seed=3)
                  for name, f in (("hub", False), ("fused", True)))
    a, b = (load_stage_model(d, 0, 1, TPContext(rank=1, size=2)).layers[0].mlp.experts for d in (hub, fused))
    assert a.gate_up.weight.shape == (4, 2 * 16, 64)
    assert torch.equal(a.gate_up.weight, b.gate_up.weight) and torch.equal(a.down.weight, b.down.weight)
    from safetensors import safe_open

    with safe_open(str(hub / "model.safetensors"), framework="pt") as f:
        up = f.get_tensor("model.layers.0.block_sparse_moe.experts.2.w3.weight")  # [32, 64]
    assert torch.equal(a.gate_up.weight[2, 16:], up[16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_q_and_k_norms_in_one_pass_equal_two_norms_then_the_rotation(qwen3_moe_dir, dtype):
    """Qwen3's q and k head norms and the rotation after them in one op (float32: one norm over both head
    groups in torch ops; bf16: the fused kernel, in place) equal each head through its own RMSNorm and then
    the rotation, bit for bit."""
    from ppserve.model import ops
    from ppserve.model.layers import RotaryEmbedding

    attn = load_stage_model(qwen3_moe_dir, 0, 1).layers[0].self_attn.to(dtype)
    hq, hkv, d, t = 4, 2, 32, 5
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.arange(7, 7 + t), dtype)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)  # a strided view, as the forward pass hands it
    normed = torch.cat((ops.rms_norm(qk[:, :hq].reshape(-1, d), attn.q_norm.weight,
                                     attn.q_norm.eps).view(t, hq, d),
                        ops.rms_norm(qk[:, hq:].reshape(-1, d), attn.k_norm.weight,
                                     attn.k_norm.eps).view(t, hkv, d)),
                       dim=1)
    expected = RotaryEmbedding.apply(normed, cos, sin, inplace=True)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    assert not torch.equal(attn.q_norm.weight, attn.k_norm.weight)  # the two weights really differ
    got = ops.qk_norm_rope_(qk, attn.q_norm.weight, attn.k_norm.weight, hq, cos, sin, attn.q_norm.eps)
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # the V heads untouched
