"""The MoE cost term (sched/moe_cost.py) and the simulator's MoE model tables and roofline; no torch."""

from __future__ import annotations

import pytest

from ppserve.sched.moe_cost import Experts, experts_touched, moe_mlp_weights
from ppserve.sim.cost_model import ModelSpec, RooflineCostModel, load_hardware, load_model_spec


def test_experts_touched_grows_from_k_to_all_experts():
    assert experts_touched(128, 8, 0) == 0.0
    assert experts_touched(128, 8, 1) == pytest.approx(8.0)  # one decode reads its k experts
    for tokens in (2, 16, 64):
        assert experts_touched(128, 8, tokens) <= min(128, 8 * tokens)
    assert experts_touched(8, 2, 64) == pytest.approx(8.0)  # a chunk touches them all
    with pytest.raises(ValueError, match="top_k 9"):
        experts_touched(8, 9, 4)


def test_a_decode_reads_k_experts_a_prefill_reads_them_all():
    moe = Experts(num_experts=8, top_k=2, expert_intermediate_size=16)
    per_token, read = moe_mlp_weights(4, moe, 1)
    expert, router = 3 * 4 * 16, 4 * 8
    assert (per_token, read) == (2 * expert + router, pytest.approx(2 * expert + router))
    assert moe_mlp_weights(4, moe, 1000)[1] == pytest.approx(8 * expert + router)


@pytest.mark.parametrize(("name", "total", "active"), [("mixtral-8x7b", 46.7, 12.9),
                                                       ("mixtral-8x22b", 140.6, 39.2),
                                                        ("qwen3-30b-a3b", 30.5, 3.3),
                                                        ("qwen3-235b-a22b", 235.1, 22.2)])
def test_moe_tables_have_the_published_parameter_counts(name, total, active):
    spec = load_model_spec(name)
    assert spec.num_params / 1e9 == pytest.approx(total, abs=0.1)
    assert spec.active_params / 1e9 == pytest.approx(active, abs=0.1)


def test_qwen3_235b_at_tp8_replicates_its_four_kv_heads():
    spec = load_model_spec("qwen3-235b-a22b")
    assert spec.q_dim == 8192 and spec.kv_heads_per_rank(8) == 1


def test_the_roofline_prices_a_moe_decode_by_the_experts_it_touches():
    hw = load_hardware("h100")
    moe = load_model_spec("qwen3-235b-a22b")
    cost = RooflineCostModel(moe, hw, num_stages=4, tp=8)
    # Memory-bound decode: one token reads 8 of 128 experts, 64 tokens most of them.
    assert cost.linear_time(64) > 5 * cost.linear_time(1)
    dense_twin = ModelSpec("dense", moe.num_layers, moe.hidden_size, moe.num_heads, moe.num_kv_heads,
                           moe.num_experts * moe.expert_intermediate_size, moe.vocab_size,
                           head_dim=moe.head_dim)
    assert dense_twin.layer_params_per_rank(8) == pytest.approx(moe.layer_params_per_rank(8), rel=0.01)
    assert cost.linear_time(1) < 0.2 * RooflineCostModel(dense_twin, hw, num_stages=4, tp=8).linear_time(1)


def test_bad_moe_tables_are_refused():
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelSpec("bad", 2, 64, 4, 4, 128, 256, num_experts=8, experts_per_token=9,
                  expert_intermediate_size=32)


def test_the_partition_prices_a_sparse_layer_by_the_experts_a_token_uses():
    """Cost-aware partitioning: a sparse layer costs its k experts and router per token, not all experts,
    so beside a big LM head the last stage of an MoE model holds fewer layers than a dense twin's."""
    from dataclasses import dataclass

    from ppserve.sched.moe_cost import mlp_weights_per_token
    from ppserve.sched.partition import initial_ranges

    @dataclass(frozen=True)
    class Moe:
        num_experts: int = 64
        top_k: int = 2
        expert_intermediate_size: int = 256
        sparse_layers: tuple[int, ...] = tuple(range(1, 24))  # layer 0 dense

    @dataclass(frozen=True)
    class Shape:
        num_layers: int = 24
        hidden_size: int = 1024
        intermediate_size: int = 64 * 256
        num_heads: int = 16
        num_kv_heads: int = 4
        vocab_size: int = 150_000
        head_dim: int = 128
        moe: Moe | None = Moe()

    @dataclass(frozen=True)
    class Par:
        pipeline_parallel_size: int = 2
        layer_partition: tuple[int, ...] | None = None
        partition_mode: str = "cost"

    sparse = 2 * 3 * 1024 * 256 + 1024 * 64
    assert mlp_weights_per_token(Shape()) == pytest.approx((23 * sparse + 3 * 1024 * 64 * 256) / 24)
    assert mlp_weights_per_token(Shape(moe=None)) == 3 * 1024 * 64 * 256
    moe_split, dense_split = initial_ranges(Par(), Shape()), initial_ranges(Par(), Shape(moe=None))
    assert moe_split[1][1] - moe_split[1][0] < dense_split[1][1] - dense_split[1][0]
