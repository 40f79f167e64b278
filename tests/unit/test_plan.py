"""`ppserve plan`: enumeration and memory feasibility on hand-built cases, the pruned rate search on a
stub system of known capacity, the report and the winner's config; the planner never imports torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from ppserve.config import load_config
from ppserve.metrics.capacity import SLO, Probe
from ppserve.plan import search as search_module
from ppserve.plan.cli import add_parser  # noqa: F401  (the command's module imports without torch)
from ppserve.plan.inputs import model_spec_from_hf
from ppserve.plan.report import pareto_front, table_rows, write_report
from ppserve.plan.search import Candidate, PlanContext, probe, probe_requests, search
from ppserve.plan.space import Cluster, Deployment, SearchSpace, WorkloadShape, enumerate_deployments
from ppserve.sched.cost import BatchShape
from ppserve.sim.cost_model import HardwareSpec, ModelSpec, load_hardware, load_model_spec
from ppserve.sim.workload import WorkloadRequest

# 8 layers of 15.2M weights (hidden 1024, 8 heads of 128, 2 KV heads, SwiGLU 4096) + two 32.8M tables:
# 187M parameters, 374 MB in bf16.
MODEL = ModelSpec("hand", num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=2, intermediate_size=4096,
                  vocab_size=32000, max_model_len=2048)
GB = 1e9


def gpu(mem_gb: float) -> HardwareSpec:
    return HardwareSpec("toy", peak_flops=100e12, mem_bw=1e12, mem_bytes=mem_gb * GB, nvlink_bw=100e9,
                        inter_node_bw=10e9, kv_mem_fraction=1.0)


WORK = WorkloadShape(mean_tokens=500, max_tokens=2048)
ONE_KNOB = SearchSpace(policies=("sarathi",), token_budgets=(512,), max_num_seqs=(64,), min_kv_requests=4)


def shapes(feasible: list[Deployment]) -> set[tuple[int, int, int]]:
    return {(d.pp, d.tp, d.replicas) for d in feasible}


def test_enumeration_keeps_what_fits_and_says_why_the_rest_does_not():
    # 0.3 GB per GPU: 374 MB of weights fit on no single GPU; two ways split, 187 MB (pp) or ~190 MB (tp).
    feasible, rejected = enumerate_deployments(MODEL, Cluster(gpu(0.3), gpus_per_node=4), ONE_KNOB, WORK)
    assert shapes(feasible) == {(2, 1, 2), (1, 2, 2), (4, 1, 1), (2, 2, 1), (1, 4, 1)}
    assert [(r.pp, r.tp) for r in rejected] == [(1, 1)]
    assert "does not fit on 1 x toy" in rejected[0].reason and "stage 0 holds 0.4 GB" in rejected[0].reason
    # Every deployment uses the whole cluster, with the layers split evenly.
    assert all(d.gpus == 4 for d in feasible)
    assert {d.layer_counts for d in feasible if d.pp == 4} == {(2, 2, 2, 2)}


def test_kv_blocks_per_replica_by_hand():
    feasible, _ = enumerate_deployments(MODEL, Cluster(gpu(0.3), gpus_per_node=4), ONE_KNOB, WORK)
    d = next(d for d in feasible if (d.pp, d.tp) == (1, 4))
    # tp 4 over 2 KV heads: one replicated head of 128 per rank, K and V, 8 layers, 2 bytes: 4096 B/token.
    # q+o and MLP split, K/V replicated
    per_rank = 2 * 1024 * 1024 // 4 + 3 * 1024 * 4096 // 4 + 2 * 1024 * 128
    weights = (8 * per_rank + 2 * 32000 * 1024 / 4) * 2
    assert d.num_blocks == int((0.3 * GB - weights) // (4096 * 16))


def test_rejections_name_heads_nodes_packing_and_a_kv_cache_too_small():
    odd = replace(MODEL, num_heads=12, num_kv_heads=3, hidden_size=1536)
    _, rej = enumerate_deployments(odd, Cluster(gpu(80), gpus_per_node=2, nodes=1), ONE_KNOB, WORK)
    assert any(r.tp == 2 and "neither divides nor is a multiple of hand's 3 KV heads" in r.reason
               for r in rej)
    _, rej = enumerate_deployments(MODEL, Cluster(gpu(80), gpus_per_node=2, nodes=2), ONE_KNOB, WORK)
    assert {(r.pp, r.tp) for r in rej} == {(1, 4)} and "exceeds the 2 GPUs of a node" in rej[0].reason
    _, rej = enumerate_deployments(MODEL, Cluster(gpu(80), gpus_per_node=4, nodes=3), ONE_KNOB, WORK)
    assert ({(r.pp, r.tp) for r in rej if "does not pack onto nodes of 4" in r.reason}
            == {(3, 1), (6, 1), (3, 2)})
    _, rej = enumerate_deployments(MODEL, Cluster(gpu(80), gpus_per_node=4, nodes=4), ONE_KNOB, WORK)
    assert {(r.pp, r.tp) for r in rej if "exceeds hand's 8 layers" in r.reason} == {(16, 1)}
    # 374.3 MB of weights fit in 0.38 GB, but the 5.7 MB left hold 691 tokens of 8 KB (2 x 256 x 2 B x 8
    # layers).
    feasible, rej = enumerate_deployments(MODEL, Cluster(gpu(0.38), gpus_per_node=1), ONE_KNOB, WORK)
    assert not feasible and "KV cache of 688 tokens" in rej[0].reason  # 43 blocks of 16
    assert "smaller than the longest request (2048)" in rej[0].reason


def test_every_policy_and_setting_is_enumerated_per_shape():
    space = SearchSpace(policies=("sarathi", "vllm"), token_budgets=(256, 1024), max_num_seqs=(64, 128),
                        vllm_max_num_seqs=(32,), min_kv_requests=1)
    feasible, _ = enumerate_deployments(MODEL, Cluster(gpu(80), gpus_per_node=1), space, WORK)
    assert [(d.policy, d.token_budget, d.max_num_seqs) for d in feasible] == [
        ("sarathi", 256, 64), ("sarathi", 256, 128), ("sarathi", 1024, 64), ("sarathi", 1024, 128),
        ("vllm", 2048, 32)]  # vllm: whole prompts up to max(context, 2048) tokens
    with pytest.raises(ValueError, match="policies must be among"):
        SearchSpace(policies=("fifo",))


def test_model_spec_from_an_hf_config():
    q = model_spec_from_hf({"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
                            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600,
                            "vocab_size": 151936, "max_position_embeddings": 40960, "hidden_act": "silu"},
                            "qwen3")
    assert q.num_params == load_model_spec("qwen3-32b").num_params and q.q_dim == 8192
    with pytest.raises(ValueError, match="none of"):
        model_spec_from_hf({"hidden_size": 8}, "broken")


# --- the search, on a stub system whose capacity is known ----------------------------------------

# Requests/s the whole deployment sustains, by (pp, tp) and token budget.
TRUE_CAPACITY = {(1, 2): 9.0, (2, 1): 10.0, (1, 1): 2.0}
BUDGET_FACTOR = {256: 0.8, 512: 1.0, 1024: 1.3}


def true_capacity(d: Deployment) -> float:
    return TRUE_CAPACITY[(d.pp, d.tp)] * d.replicas * BUDGET_FACTOR[d.token_budget]


def stub_probe(ctx: PlanContext, d: Deployment, rate: float) -> Probe:
    """Meets the SLO exactly up to the true capacity; TBT grows with the budget."""
    return Probe(rate, rate <= true_capacity(d), tbt_p99_s=d.token_budget * 1e-4, sched_delay_p50_s=0.1,
                 extra={"ttft_p90_s": 0.2})


def stub_context(cluster: Cluster) -> PlanContext:
    reqs = tuple(WorkloadRequest(0.0, 200, 50) for _ in range(10))
    return PlanContext(load_model_spec("llama3-8b"), cluster, reqs, SLO(0.2), prober=stub_probe)


def small_space() -> tuple[Cluster, list[Deployment]]:
    cluster = Cluster(load_hardware("a100"), gpus_per_node=2)
    space = SearchSpace(policies=("sarathi",), token_budgets=(256, 512, 1024), max_num_seqs=(64,))
    feasible, _ = enumerate_deployments(load_model_spec("llama3-8b"), cluster, space,
                                        WorkloadShape(500, 2048))
    return cluster, feasible


@pytest.mark.parametrize("jobs", [1, 2])
def test_search_finds_the_known_capacities_pruned_and_ranked(jobs: int):
    cluster, feasible = small_space()
    assert shapes(feasible) == {(1, 1, 2), (2, 1, 1), (1, 2, 1)}
    ranked = search(stub_context(cluster), feasible, jobs=jobs, refine=2, keep_shapes=0.5, coarse_evals=12)
    # Shapes: tp1·pp2 (10/GPU-pair at budget 512), tp2·pp1 (9), tp1·pp1 x2 (4): the last is pruned, so
    # only its representative (budget 512) was searched.
    searched = {(d.pp, d.tp, d.token_budget) for d in (c.deployment for c in ranked)}
    assert searched == {(2, 1, 256), (2, 1, 512), (2, 1, 1024), (1, 2, 256), (1, 2, 512), (1, 2, 1024),
                        (1, 1, 512)}
    assert [c.capacity_per_gpu for c in ranked] == sorted((c.capacity_per_gpu for c in ranked), reverse=True)
    for c in ranked:
        truth = true_capacity(c.deployment)
        assert c.capacity <= truth  # never a failing rate
        assert c.capacity >= truth / (1.051 if c.refined else 1.26)  # bracketed to 5 % (refined) or 25 %
        assert len({p.rate for p in c.result.probes}) == len(c.result.probes)
    assert [c.refined for c in ranked[:2]] == [True, True]
    best = ranked[0].deployment
    assert (best.pp, best.tp, best.token_budget) == (2, 1, 1024)


def test_equal_capacities_rank_in_the_deployments_order_whatever_order_the_probes_finish(monkeypatch):
    """Settings that serve alike tie: which of them is refined, and the table's order, must not follow
    the process pool's completion order (it did, and two runs of one plan listed them differently)."""
    cluster, feasible = small_space()
    ctx = replace(stub_context(cluster),
                  prober=lambda c, d, rate: Probe(rate, rate <= 4.0, tbt_p99_s=0.01, sched_delay_p50_s=0.1))
    monkeypatch.setattr(search_module, "estimate_rate", lambda c, d: 8.0)  # every search takes the same steps
    in_order = search(ctx, feasible, jobs=1, refine=2)
    finish_reversed = search_module._run_all

    def reversed_completion(*args, **kwargs):
        return dict(reversed(list(finish_reversed(*args, **kwargs).items())))

    monkeypatch.setattr(search_module, "_run_all", reversed_completion)
    again = search(ctx, feasible, jobs=1, refine=2)
    assert [(c.deployment, c.refined) for c in again] == [(c.deployment, c.refined) for c in in_order]
    per_gpu = [c.capacity_per_gpu for c in in_order]
    tied = [feasible.index(c.deployment) for c in in_order if c.capacity_per_gpu == per_gpu[0]]
    assert len(tied) > 1 and tied == sorted(tied)


def test_search_is_deterministic_and_probes_are_seeded():
    cluster, feasible = small_space()
    a = search(stub_context(cluster), feasible, jobs=1, refine=2)
    b = search(stub_context(cluster), feasible, jobs=1, refine=2)
    assert [(c.deployment, c.result.probes) for c in a] == [(c.deployment, c.result.probes) for c in b]
    # The real probe: one replica on the simulator, the same figures twice at the same seed.
    ctx = replace(stub_context(cluster), prober=None, duration_s=2.0, min_requests=10)
    d = next(d for d in feasible if d.pp == 2 and d.token_budget == 512)
    first, again = probe(ctx, d, 4.0), probe(ctx, d, 4.0)
    assert first == again and first.ok and first.extra["num_requests"] == 10  # 4 req/s x 2 s < min_requests
    # cycled past the trace's 10
    assert probe(replace(ctx, duration_s=10.0), d, 4.0).extra["num_requests"] == 40


def test_a_plan_probe_replays_the_requests_a_real_capacity_probe_of_the_trace_replays(tmp_path):
    """`plan_then_run.py` sets the planner's capacity against `bench capacity --on real`'s: both must replay
    the same requests. A planner pool of the trace's first --num-requests rows, cycled, planned 5.7 output
    tokens a request against real probes of 11.6 (the first 195 rows of splitwise_conv at 0.05)."""
    from ppserve.bench.suites import probe_workload
    from ppserve.bench.workloads import WorkloadSpec
    from ppserve.metrics.capacity import ProbeSize
    from ppserve.plan.inputs import workload

    trace = tmp_path / "t.csv"
    # Rows whose lengths grow with the row: a pool that cycled its first rows would replay short requests
    # only.
    trace.write_text("num_prefill_tokens,num_decode_tokens\n"
                     + "".join(f"{100 + 10 * i},{5 + i}\n" for i in range(300)))
    estimates, pool, desc = workload(str(trace), 20, MODEL.max_model_len, seed=3, prefill_scale=0.5,
                                     decode_scale=0.5)
    assert ([(r.prompt_len, r.output_len) for r in estimates]
            == [(50 + 5 * i, round((5 + i) / 2) or 1) for i in range(20)])
    assert len(pool) == 300 and pool[:20] == estimates and "first 20 rows" in desc
    ctx = PlanContext(MODEL, Cluster(gpu(80), 1, 1), tuple(pool), SLO(0.1, 2.0), duration_s=10.0,
                      min_requests=20, seed=3)
    spec = WorkloadSpec(source=f"trace:{trace}", num_requests=20, prefill_scale=0.5, decode_scale=0.5, seed=3,
                        max_model_len=MODEL.max_model_len)
    for rate in (1.0, 7.5, 25.0):  # below the minimum, between, past the 20 rows the estimates read
        real = probe_workload(spec, rate, ProbeSize(10.0, 20, 20_000))
        planned = probe_requests(ctx, rate)
        assert len(planned) == max(20, math.ceil(10 * rate))
        assert [(r.prompt_len, r.output_len) for r in planned] == [(r.prompt_len, r.output_len) for r in real]
        assert [r.arrival_s for r in planned] == pytest.approx([r.arrival_s for r in real], abs=1e-12)
    # Past the trace's end the pool cycles.
    assert len(probe_requests(ctx, 40.0)) == 400 and probe_requests(ctx, 40.0)[300].prompt_len == 50


def test_the_report_ranks_draws_and_writes_a_config_serve_loads(tmp_path):
    cluster, feasible = small_space()
    ranked = search(stub_context(cluster), feasible, jobs=1, refine=2)
    settings = {"model": "llama3-8b", "cluster": "1 x 2 a100", "workload": "stub", "slo": {"tbt_p99_s": 0.2}}
    paths = write_report(tmp_path, ranked, [], settings, serve_model="/models/llama3-8b")
    assert {p.name for p in paths.values()} == {"plan.json", "plan.md", "pareto.png", "winner.yaml"}
    cfg = load_config(paths["winner"])  # what `ppserve serve --config` does with it
    best = ranked[0].deployment
    assert (cfg.parallel.pipeline_parallel_size, cfg.parallel.tensor_parallel_size) == (best.pp, best.tp)
    assert cfg.parallel.layer_partition == best.layer_counts == (16, 16)
    assert (cfg.scheduler.policy, cfg.scheduler.token_budget,
            cfg.scheduler.max_num_seqs) == ("sarathi", 1024, 64)
    assert cfg.model.model == "/models/llama3-8b" and cfg.cache.block_size == 16
    assert "run 1 of these" in paths["winner"].read_text()
    data = json.loads(paths["json"].read_text())
    assert [r["deployment"] for r in data["ranked"]] == [c.deployment.label for c in ranked]
    assert data["ranked"][0]["capacity_req_s"] == ranked[0].capacity


def test_pareto_front_by_hand():
    d = Deployment(1, 1, 1, "sarathi", 512, 64)

    def cand(cap: float, tbt: float) -> Candidate:
        from ppserve.metrics.capacity import CapacityResult

        return Candidate(d, CapacityResult(cap, (cap, None), [Probe(cap, True, tbt, 0.1)]))

    a, b, c, e = cand(10, 0.05), cand(8, 0.03), cand(7, 0.04), cand(12, 0.09)  # c is beaten by b on both
    assert pareto_front([a, b, c, e]) == [b, a, e]
    rows = table_rows([e, a])
    assert [r["tbt_p99_ms"] for r in rows] == [90.0, 50.0] and rows[0]["rank"] == 1


def test_the_planner_never_imports_torch_ray_or_grpc(tmp_path):
    code = (
        "import sys\n"
        "from ppserve.cli import main\n"
        f"rc = main(['plan', '--model', 'smollm2-135m', '--hardware', 'cpu', '--gpus', '2',"
        f" '--tbt-p99-ms', '300',"
        f" '--num-requests', '20', '--duration-s', '3', '--prefill-scale', '0.05', '--decode-scale', '0.05',"
        f" '--policies', 'sarathi', '--token-budgets', '256',"
        f" '--refine', '1', '--jobs', '1', '--no-progress', '--out', {str(tmp_path)!r}])\n"
        "heavy = [m for m in ('torch', 'ray', 'grpc', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert (tmp_path / "winner.yaml").exists()
    load_config(tmp_path / "winner.yaml")


def test_a_fitted_profile_is_re_split_over_another_pp_and_tp(tmp_path):
    from ppserve.plan.resplit import ProfileResplit
    from ppserve.sched.cost import LayerCosts, StepCost
    from ppserve.sched.partition import ranges_from_counts
    from ppserve.sim.cost_model import Profile

    layer = StepCost(floor_s=1e-4, token_s=2e-6, prefill_key_s=1e-9, decode_key_s=3e-9)
    head = StepCost(floor_s=5e-4, token_s=1e-6, sample_s=4e-5)
    measured = Profile(LayerCosts(layer, head).pipeline(ranges_from_counts([5, 3])), transfer_s=2e-4,
                       note="fit")
    resplit = ProfileResplit(measured, (5, 3), tp=1)
    three = resplit.cost_model([3, 3, 2], tp=2)
    shape = BatchShape.uniform(100, 4, 200)
    # Stage k: its layers at the per-token terms halved (tp 2), the floors kept; the head on the last.
    half = StepCost(1e-4, 1e-6, 0.5e-9, 1.5e-9)
    assert three.num_stages == 3 and three.transfer_time(shape) == 2e-4
    assert three.stage_time(0, shape) == pytest.approx(half.times(3).predict(shape))
    assert three.stage_time(2, shape) == pytest.approx(
        half.times(2).plus(StepCost(5e-4, 0.5e-6, 0, 0, 2e-5)).predict(shape))
    one = resplit.cost_model([8], tp=1)  # back to a single stage: no transfer
    assert (one.stage_time(0, shape) == pytest.approx(layer.times(8).plus(head).predict(shape))
            and one.transfer_time(shape) == 0)
    with pytest.raises(ValueError, match="has 2 stages"):
        ProfileResplit(measured, (8,))
    # The planner runs on it: a probe through the simulator priced by the re-split profile.
    model = replace(load_model_spec("smollm2-135m"), num_layers=8)
    cluster = Cluster(load_hardware("cpu"), gpus_per_node=2)
    ctx = PlanContext(model, cluster, tuple(WorkloadRequest(0.0, 64, 8) for _ in range(10)), SLO(0.5), 2.0,
                      cost_model=resplit, min_requests=10)
    d = Deployment(2, 1, 1, "sarathi", 128, 16, (4, 4), 1000, 16)
    assert probe(ctx, d, 1.0).ok


# --- the token budget a TBT SLO allows (plan/slo_budget.py) ---------------------------------------------

def linear_pipeline(stages: int, floor_s: float, token_s: float):
    from ppserve.sched.cost import PipelineCost, StepCost
    from ppserve.sim.cost_model import Profile, ProfileCostModel

    return ProfileCostModel(Profile(PipelineCost((StepCost(floor_s, token_s),) * stages)))


def test_the_slo_budget_is_the_largest_step_that_goes_round_the_pipeline_in_time():
    from ppserve.plan.slo_budget import SLO_BUDGET_MARGIN, slo_token_budget

    # Two stages of 10 ms + 1 ms a token; SLO 100 ms, margin 0.8: 2 * (10 + B) <= 80 ms, so B = 30 tokens,
    # 16 in whole blocks of 16; one stage: 10 + B <= 80, B = 70 -> 64.
    two = linear_pipeline(2, 0.010, 0.001)
    assert slo_token_budget(two, 0.100, context=0, cap=2048, margin=0.8, block_size=1) == 30
    assert slo_token_budget(two, 0.100, context=0, cap=2048, margin=0.8, block_size=16) == 16
    assert slo_token_budget(linear_pipeline(1, 0.010, 0.001), 0.100, context=0, cap=2048, margin=0.8) == 64
    assert slo_token_budget(two, 0.100, context=0, cap=8, margin=0.8) == 8  # below a block: kept as it is
    assert slo_token_budget(two, 0.100, context=0, cap=20, margin=0.8, block_size=1) == 20  # the cap holds
    assert slo_token_budget(two, 0.100, context=0, cap=2048, margin=1.0, block_size=1) == 40
    # The default margin: 10 + B <= 100 * SLO_BUDGET_MARGIN ms on one stage.
    one = linear_pipeline(1, 0.010, 0.001)
    assert (slo_token_budget(one, 0.100, context=0, cap=2048, block_size=1)
            == int(100 * SLO_BUDGET_MARGIN - 10 + 1e-9))
    # A step's floor alone outlasts the SLO around the pipeline: no budget meets it.
    assert slo_token_budget(linear_pipeline(2, 0.045, 0.001), 0.100, context=0, cap=2048) is None
    with pytest.raises(ValueError, match="margin"):
        slo_token_budget(two, 0.100, context=0, cap=2048, margin=0.0)


def test_where_every_grid_budget_outlasts_slo_each_sarathi_setting_gains_the_slos_and_stands_for_its_shape():
    from ppserve.plan.search import _representatives
    from ppserve.plan.slo_budget import with_slo_budgets

    cluster = Cluster(load_hardware("a100"), gpus_per_node=2)
    space = SearchSpace(policies=("sarathi", "vllm"), token_budgets=(256, 512), max_num_seqs=(64, 128))
    feasible, _ = enumerate_deployments(load_model_spec("llama3-8b"), cluster, space,
                                        WorkloadShape(500, 2048))
    # Every stage at 10 ms + 1 ms a token, margin 0.65: 2 * (10 + B) <= 65 ms at pp 2 (B = 22 -> 16),
    # 10 + B <= 65 at pp 1 (B = 55 -> 48); both below the grid's 256.
    out = with_slo_budgets(feasible, lambda d: linear_pipeline(d.pp, 0.010, 0.001), 0.100, mean_prompt=64)
    added = [d for d in out if d.budget_from_slo]
    assert [replace(d, slo_budget=None) for d in out if not d.budget_from_slo] == feasible
    sarathi_settings = {(d.pp, d.tp, d.max_num_seqs) for d in feasible if d.policy == "sarathi"}
    assert {(d.pp, d.tp, d.max_num_seqs) for d in added} == sarathi_settings  # one per setting, none for vllm
    assert ({d.token_budget for d in added if d.pp == 2} == {16}
            and {d.token_budget for d in added if d.pp == 1} == {48})
    assert all(d.policy == "sarathi" and "from SLO" in d.label for d in added)
    assert all(out[i].budget_from_slo for i in _representatives(out).values())
    # Where the grid holds a budget the SLO allows (1 + 0.08 B <= 65 ms at pp 1: 800 tokens, capped at the
    # grid's 512; 2 * (1 + 0.08 B) <= 65 at pp 2: 384) nothing is added; each sarathi deployment is told its
    # shape's SLO budget, and the budget nearest 512 that it allows stands for the shape: 512 at pp 1, 256 at
    # pp 2 (512 would fail the SLO at every rate).
    roomy = with_slo_budgets(feasible, lambda d: linear_pipeline(d.pp, 0.001, 0.00008), 0.100, mean_prompt=64)
    assert [replace(d, slo_budget=None) for d in roomy] == feasible
    assert {(d.pp, d.slo_budget) for d in roomy if d.policy == "sarathi"} == {(1, 512), (2, 384)}
    assert all(d.slo_budget is None for d in roomy if d.policy == "vllm")
    reps = {(roomy[i].pp, roomy[i].token_budget) for i in _representatives(roomy).values()}
    assert reps == {(1, 512), (2, 256)}
