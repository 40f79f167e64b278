"""The simulator's model and hardware tables: explicit head_dim, KV heads split or replicated over tp,
weights per stage, and the shipped configs (hand-computed figures, no torch)."""

from __future__ import annotations

import statistics

import pytest

from ppserve.sched.cost import BatchShape
from ppserve.sim.cost_model import (
    CONFIG_DIR,
    ModelSpec,
    RooflineCostModel,
    kv_cache_blocks,
    load_hardware,
    load_model_spec,
    stage_weight_bytes,
)
from ppserve.sim.lengths import ARXIV_SUMMARIZATION_LIKE, SHAREGPT4_LIKE
from ppserve.sim.simulator import SimConfig, simulate
from ppserve.sim.workload import WorkloadRequest


def spec(**kw: object) -> ModelSpec:
    base = dict(name="m", num_layers=4, hidden_size=64, num_heads=8, num_kv_heads=2, intermediate_size=128,
                vocab_size=100)
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


def test_head_dim_defaults_to_a_split_of_the_hidden_size_and_can_be_given():
    assert spec().head_dim == 8 and spec().q_dim == 64
    wide = spec(head_dim=16)  # Qwen3-like: 8 heads of 16 on a 64-wide residual stream
    assert wide.q_dim == 128 and wide.kv_dim == 32
    # q (64x128) + o (128x64) + k, v (64x32 each) + 3 MLP matrices (64x128)
    assert wide.layer_params == 64 * 128 * 2 + 2 * 64 * 32 + 3 * 64 * 128
    with pytest.raises(ValueError, match="give head_dim"):
        spec(hidden_size=60)
    with pytest.raises(ValueError, match="num_kv_heads 3 must divide"):
        spec(num_kv_heads=3)


def test_kv_heads_are_split_then_replicated_past_their_count():
    m = spec()  # 2 KV heads
    assert [m.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    # Past 2 ranks K and V are replicated: their weights stop shrinking, the rest keeps splitting.
    split = 2 * 64 * 64 + 3 * 64 * 128
    assert m.layer_params_per_rank(4) == split // 4 + 2 * 64 * 8
    assert m.layer_params_per_rank(8) == split // 8 + 2 * 64 * 8
    m.check_tp(8)
    with pytest.raises(ValueError, match="does not divide"):
        m.check_tp(3)
    with pytest.raises(ValueError, match="neither divides"):
        spec(num_heads=12, num_kv_heads=4, hidden_size=96).check_tp(6)


def test_replicated_kv_heads_cost_memory_and_attention_bandwidth():
    m, hw = spec(num_layers=2), load_hardware("a100")
    # 2 KV heads: tp 2 and tp 4 hold the same KV per token per rank, so the same blocks fit (bar weights).
    kv2 = kv_cache_blocks(m, hw, 1, 2, 16)
    kv4 = kv_cache_blocks(m, hw, 1, 4, 16)
    assert kv4 >= kv2 and kv4 < kv2 * 1.001
    decode = [(1, 4096)] * 8
    t2 = RooflineCostModel(m, hw, 1, 2).attention_time(decode)
    t4 = RooflineCostModel(m, hw, 1, 4).attention_time(decode)
    assert t4 == pytest.approx(t2, rel=0.05)  # bound by reading one KV head either way


def test_stage_weights_put_the_embedding_first_and_the_head_last():
    m = spec(tied_embeddings=True)
    layer = m.layer_params * 2
    table = 100 * 64 * 2
    assert stage_weight_bytes(m, 2, True, True, 1) == 2 * layer + table  # tied: one matrix
    assert stage_weight_bytes(m, 2, True, False, 1) == 2 * layer + table
    assert stage_weight_bytes(m, 2, False, True, 1) == 2 * layer + table  # the last stage needs the head too
    assert stage_weight_bytes(m, 2, False, False, 1) == 2 * layer
    untied = spec()
    assert (stage_weight_bytes(untied, 4, True, True, 2)
            == (4 * untied.layer_params_per_rank(2) + 2 * 50 * 64) * 2)


@pytest.mark.parametrize("name,params_b", [("mistral-7b", 7.24), ("yi-34b", 34.4), ("llama3-70b", 70.6),
                                           ("falcon-180b", 179.5), ("qwen3-32b", 32.8)])
def test_shipped_model_tables_give_their_published_sizes(name: str, params_b: float):
    assert load_model_spec(name).num_params / 1e9 == pytest.approx(params_b, rel=0.01)


def test_qwen3_32b_needs_its_explicit_head_dim():
    q = load_model_spec("qwen3-32b")
    assert q.head_dim == 128 and q.q_dim == 8192 and q.hidden_size == 5120
    q.check_tp(16)  # 8 KV heads replicated twice
    assert q.kv_heads_per_rank(16) == 1


def test_stage_boundaries_inside_a_node_use_nvlink_and_between_nodes_the_nic():
    m, hw = load_model_spec("llama2-70b"), load_hardware("a100")
    placed = RooflineCostModel(m, hw, 8, 2, gpus_per_node=8)  # stages 0-3 on node 0, 4-7 on node 1
    assert [placed.crosses_nodes(s) for s in range(7)] == [False, False, False, True, False, False, False]
    shape = BatchShape.uniform(512)
    nbytes = 512 * m.hidden_size * 2
    assert placed.boundary_transfer_time(0, shape) == pytest.approx(
        hw.nvlink_latency_s + nbytes / (hw.nvlink_bw * hw.link_eff))
    assert placed.boundary_transfer_time(3, shape) == pytest.approx(
        hw.inter_node_latency_s + nbytes / (hw.inter_node_bw * hw.link_eff))
    blind = RooflineCostModel(m, hw, 8, 2)  # no placement: every boundary crosses nodes, as before
    assert all(blind.crosses_nodes(s) for s in range(7))
    assert placed.transfer_time(shape) == blind.transfer_time(shape)  # the slowest boundary


def test_the_simulator_charges_each_boundary_its_own_link():
    m, hw = load_model_spec("llama2-70b"), load_hardware("a100")
    wl = [WorkloadRequest(0.0, 256, 1)]
    gaps, first = {}, {}
    for gpn in (0, 8):
        res = simulate(wl, RooflineCostModel(m, hw, 4, 2, gpus_per_node=gpn), SimConfig(num_blocks=1000))
        compute = [s for s in res.spans if s.kind == "compute"]
        step = min(s.step_id for s in compute)  # the first microbatch finds every stage idle
        first[gpn] = sorted((s for s in compute if s.step_id == step), key=lambda s: s.stage)
        gaps[gpn] = [b.start_ns - a.end_ns for a, b in zip(first[gpn], first[gpn][1:], strict=False)]
    shape = BatchShape.uniform(first[8][0].num_prefill_tokens)
    placed = RooflineCostModel(m, hw, 4, 2, gpus_per_node=8)
    assert gaps[8] == [round(placed.boundary_transfer_time(s, shape) * 1e9) for s in range(3)]
    assert gaps[0][0] > gaps[8][0]  # the inter-node link is the slower one


@pytest.mark.parametrize("dist", [SHAREGPT4_LIKE, ARXIV_SUMMARIZATION_LIKE])
def test_dataset_like_lengths_have_the_published_median_and_p90(dist):
    reqs = dist.sample(4000, max_model_len=10**6, seed=1)
    prompts = sorted(r.prompt_len for r in reqs)
    outputs = sorted(r.output_len for r in reqs)
    assert statistics.median(prompts) == pytest.approx(dist.prompt_median, rel=0.06)
    assert prompts[int(0.9 * len(prompts))] == pytest.approx(dist.prompt_p90, rel=0.08)
    assert statistics.median(outputs) == pytest.approx(dist.output_median, rel=0.06)
    assert outputs[int(0.9 * len(outputs))] == pytest.approx(dist.output_p90, rel=0.08)
    assert dist.sample(50, 4096, seed=1) == dist.sample(50, 4096, seed=1)  # seeded
    assert all(r.prompt_len + r.output_len <= 4096 for r in dist.sample(200, 4096))  # clipped to the context


def test_the_layer_floor_adds_a_fixed_cost_per_layer_to_every_step_and_to_the_schedulers_prior():
    from dataclasses import replace

    m, hw = spec(num_layers=4), load_hardware("a100")
    floored = replace(hw, layer_overhead_s=0.4e-3)
    base, with_floor = RooflineCostModel(m, hw, 2, 1), RooflineCostModel(m, floored, 2, 1)
    for shape in (BatchShape.uniform(0, 1, 128), BatchShape.uniform(512), BatchShape.uniform(0, 64, 4096)):
        for stage in (0, 1):  # 2 layers a stage: 0.8 ms more, whatever the batch
            assert (with_floor.stage_time(stage, shape)
                    == pytest.approx(base.stage_time(stage, shape) + 0.8e-3))
    # The scheduler's prior (least squares over the roofline) carries it as its per-microbatch floor.
    assert with_floor.pipeline_cost().stages[0].floor_s == pytest.approx(
        base.pipeline_cost().stages[0].floor_s + 0.8e-3, abs=1e-5)
    with pytest.raises(ValueError, match="layer_overhead_s must be a finite number >= 0"):
        replace(hw, layer_overhead_s=-1e-3)


def test_the_sarathi_serve_machine_prices_yi_34b_decode_at_the_artifacts_measurement():
    # a100-pcie.yaml is calibrated on Sarathi-Serve's own measurement (osdi-experiments/figure-2/decode.csv):
    # Yi-34B at TP2 decodes a batch at a ~1022-token context in 46.8 ms at batch 1 and 189.3 ms at 128.
    hw = load_hardware("a100-pcie")
    yi = RooflineCostModel(load_model_spec("yi-34b"), hw, 1, 2)
    assert hw.gpus_per_node == 4 and hw.layer_overhead_s > 0
    assert yi.stage_time(0, BatchShape.uniform(0, 1, 1022)) == pytest.approx(46.8e-3, rel=0.02)
    assert yi.stage_time(0, BatchShape.uniform(0, 128, 1022)) == pytest.approx(189.3e-3, rel=0.02)
    # In between the fit is linear in the batch; the measurement is within 25 % of it from batch 16 on.
    for batch, measured in ((16, 77.25e-3), (32, 87.9e-3), (64, 127.8e-3)):
        assert yi.stage_time(0, BatchShape.uniform(0, batch, 1022)) == pytest.approx(measured, rel=0.25)
    # table-2/results.csv's op-level decode of 4: 25.5 ms in Yi's 60 layers' linear layers.
    assert 60 * yi.linear_time(4) == pytest.approx(25.5e-3, rel=0.02)
    # The profiles a plan of ppserve itself uses carry no floor until a GPU run measures one.
    assert load_hardware("a100").layer_overhead_s == load_hardware("h100").layer_overhead_s == 0.0


def test_decode_attention_reads_the_kv_cache_at_its_own_bandwidth_or_the_weights_rate_when_unset():
    from dataclasses import replace

    m, hw = spec(num_layers=2), load_hardware("a100")
    assert hw.decode_attn_bw_eff is None and hw.decode_attn_bw == hw.mem_bw * hw.bw_eff
    decodes = BatchShape.uniform(0, 64, 4096)  # KV-bound: one query per sequence over 4096 keys
    base = RooflineCostModel(m, hw, 1, 1).attention_time(decodes.chunks)
    slow = RooflineCostModel(m, replace(hw, decode_attn_bw_eff=hw.bw_eff / 4), 1, 1)
    assert slow.attention_time(decodes.chunks) == pytest.approx(4 * base)
    # A prefill chunk is priced as before (its kernel is FLOP-bound, not the paged decode kernel).
    chunk = BatchShape.uniform(512).chunks
    assert slow.attention_time(chunk) == RooflineCostModel(m, hw, 1, 1).attention_time(chunk)


def test_the_per_sequence_cost_adds_per_sequence_and_layer():
    from dataclasses import replace

    m, hw = spec(num_layers=4), load_hardware("a100")
    base = RooflineCostModel(m, hw, 2, 1)
    per_seq = RooflineCostModel(m, replace(hw, seq_overhead_s=10e-6), 2, 1)
    shape = BatchShape.uniform(128, 8, 1024)  # one chunk and 8 decodes: 9 sequences, 2 layers a stage
    assert per_seq.stage_time(0, shape) == pytest.approx(base.stage_time(0, shape) + 9 * 2 * 10e-6)


def test_efficiencies_load_from_the_hardware_yaml_and_must_be_fractions(tmp_path):
    hw = load_hardware("a100-pcie")
    assert ((hw.bw_eff, hw.decode_attn_bw_eff, hw.seq_overhead_s, hw.layer_overhead_s)
            == (0.68, None, 16.86e-6, 0.316e-3))
    a40 = load_hardware("a40")  # carried over from the A100 fit
    assert (a40.bw_eff, a40.seq_overhead_s, a40.layer_overhead_s) == (0.68, 16.86e-6, 0.316e-3)
    base = (CONFIG_DIR / "hardware" / "a100.yaml").read_text()
    path = tmp_path / "hw.yaml"
    path.write_text(base + "decode_attn_bw_eff: 5.9e-2\n")  # YAML 1.1 reads this as a string
    assert load_hardware(path).decode_attn_bw_eff == pytest.approx(0.059)
    for key, value in (("decode_attn_bw_eff", "0"), ("bw_eff", "1.2"), ("mfu_eff", "0.0"),
                       ("link_eff", "-0.1"), ("kv_mem_fraction", "1.5")):
        # drop the table's own
        text = "\n".join(line for line in base.splitlines() if not line.startswith(f"{key}:"))
        path.write_text(text + f"\n{key}: {value}\n")
        with pytest.raises(ValueError, match=rf"{key} .*(in \(0, 1\]|>= 0)"):
            load_hardware(path)
    path.write_text(base + "decode_attn_bw_eff: fast\n")
    with pytest.raises(ValueError, match="decode_attn_bw_eff must be a number"):
        load_hardware(path)


def test_fp8_and_int8_matmuls_run_at_the_8_bit_peak_where_the_hardware_has_one():
    from dataclasses import replace

    h100, a100 = load_hardware("h100"), load_hardware("a100")
    assert (h100.fp8_flops, h100.int8_ops) == (1979e12, 1979e12)
    assert (a100.fp8_flops, a100.int8_ops) == (0.0, 624e12)
    assert load_hardware("a100-pcie").int8_ops == 624e12 and load_hardware("a40").int8_ops == 299.3e12
    assert load_hardware("cpu").matmul_flops("int8") == load_hardware("cpu").peak_flops
    fp8 = load_model_spec("llama3-70b-fp8")
    fp8_in_bf16 = replace(fp8, linear_compute="")  # the same bytes, multiplied in bf16
    bf16 = load_model_spec("llama3-70b")
    assert fp8.linear_compute == "fp8"
    on_h100 = [RooflineCostModel(m, h100, 1, 8) for m in (fp8, fp8_in_bf16, bf16)]
    # A 4096-token prefill chunk: the matmuls are compute bound, at twice the rate.
    t_fp8, t_same_bytes, t_bf16 = (c.linear_time(4096) for c in on_h100)
    assert t_fp8 == pytest.approx(t_same_bytes * 989 / 1979) and t_same_bytes == pytest.approx(t_bf16)
    # Only those matmuls: attention and the LM head keep the bf16 rates.
    shape = BatchShape(((4096, 0),), 1, 4096, 0)  # one stage: its LM head samples the chunk's last token
    saved = on_h100[1].stage_time(0, shape) - on_h100[0].stage_time(0, shape)
    assert saved == pytest.approx(80 * (t_same_bytes - t_fp8))
    assert on_h100[0].lm_head_time(1) == on_h100[1].lm_head_time(1)
    # A decode step of one token is memory bound: only the bytes count.
    decode = BatchShape.uniform(0, 1, 1024)
    assert on_h100[0].stage_time(0, decode) == on_h100[1].stage_time(0, decode)
    assert on_h100[0].linear_time(1) == on_h100[1].linear_time(1) < on_h100[2].linear_time(1)
    # Ampere has no FP8 tensor cores: FP8 falls back to the bf16 peak; INT8 doubles it.
    assert a100.matmul_flops("fp8") == a100.peak_flops and a100.matmul_flops("int8") == 624e12
    int8 = replace(fp8, linear_compute="int8")
    on_a100 = [RooflineCostModel(m, a100, 1, 8) for m in (fp8, fp8_in_bf16, int8)]
    assert on_a100[0].linear_time(4096) == on_a100[1].linear_time(4096)
    assert on_a100[2].linear_time(4096) == pytest.approx(on_a100[1].linear_time(4096) * 312 / 624)


def test_an_unknown_matmul_precision_or_a_negative_8_bit_peak_is_refused(tmp_path):
    from dataclasses import replace

    with pytest.raises(ValueError, match="linear_compute must be one of"):
        spec(linear_compute="fp16")
    with pytest.raises(ValueError, match="unknown matmul precision"):
        load_hardware("h100").matmul_flops("int4")
    with pytest.raises(ValueError, match="fp8_flops must be a finite number >= 0"):
        replace(load_hardware("h100"), fp8_flops=-1.0)
    path = tmp_path / "m.yaml"
    path.write_text((CONFIG_DIR / "models" / "llama3-70b.yaml").read_text() + "linear_compute: fp4\n")
    with pytest.raises(ValueError, match="linear_compute"):
        load_model_spec(path)
