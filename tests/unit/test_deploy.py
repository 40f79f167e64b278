"""The replicas' pure parts: merged expositions and GetStats, the application's arguments, and the Serve
router's ranks over ppserve.route's policies (with stand-ins for Serve's replica objects)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ppserve.deploy.merge import label_exposition, merge_expositions, merge_stats
from ppserve.route import prefix_keys

A = """# HELP ppserve:num_requests_running Requests holding KV blocks.
# TYPE ppserve:num_requests_running gauge
ppserve:num_requests_running{model_name="m"} 2.0
# HELP ppserve:ttft_seconds TTFT.
# TYPE ppserve:ttft_seconds histogram
ppserve:ttft_seconds_bucket{le="0.1",model_name="m"} 1.0
ppserve:ttft_seconds_bucket{le="+Inf",model_name="m"} 3.0
ppserve:ttft_seconds_count{model_name="m"} 3.0
ppserve:ttft_seconds_sum{model_name="m"} 0.5
# HELP plain A sample without labels.
# TYPE plain gauge
plain 1.0
"""


def test_expositions_merge_into_one_family_each_with_replica_labels() -> None:
    merged = merge_expositions([label_exposition(A, "replica", "r1"), label_exposition(A, "replica", 'r"2')])
    fams = {f.name: f for f in text_string_to_metric_families(merged)}  # the parser refuses duplicates
    running = fams["ppserve:num_requests_running"].samples
    assert {s.labels["replica"] for s in running} == {"r1", 'r"2'}
    assert len(fams["ppserve:ttft_seconds"].samples) == 8
    assert {s.labels["replica"] for s in fams["plain"].samples} == {"r1", 'r"2'}
    assert merged.count("# TYPE ppserve:ttft_seconds histogram") == 1


def test_stats_sum_counts_and_recompute_rates() -> None:
    from ppserve.server.gen import ppserve_pb2 as pb

    a = pb.Stats(
        running=1,
        kv_blocks_total=10,
        prefix_cache_hits=30,
        prefix_cache_queries=100,
        prefix_cache_hit_rate=0.3,
        mean_bubble_fraction=0.2,
        uptime_s=5,
        spec_decode_num_accepted_tokens_per_pos=[3, 1],
        workers=[pb.Worker(pid=1)],
    )
    b = pb.Stats(
        running=2,
        kv_blocks_total=10,
        prefix_cache_hits=70,
        prefix_cache_queries=100,
        prefix_cache_hit_rate=0.7,
        mean_bubble_fraction=0.4,
        uptime_s=9,
        spec_decode_num_accepted_tokens_per_pos=[2],
        workers=[pb.Worker(pid=2)],
    )
    m = merge_stats([a, b])
    assert (m.running, m.kv_blocks_total, m.uptime_s) == (3, 20, 9)
    assert m.prefix_cache_hit_rate == pytest.approx(0.5)
    assert m.mean_bubble_fraction == pytest.approx(0.3)
    assert list(m.spec_decode_num_accepted_tokens_per_pos) == [5, 1]
    assert [w.pid for w in m.workers] == [1, 2]
    with pytest.raises(ValueError, match="no replica"):
        merge_stats([])


def test_app_arguments_are_checked() -> None:
    from ppserve.deploy.app import read_args, replica_config

    s = read_args({"replicas": "2", "routing": "round-robin", "set": ["scheduler.token_budget=64"]})
    assert s["replicas"] == 2 and s["routing"] == "round-robin"
    assert "parallel.executor=ray" in replica_config(s)[1]
    auto = read_args({"replicas": "auto", "min_replicas": 1, "max_replicas": 3})
    assert auto["autoscaling"]["max_replicas"] == 3
    for bad, match in [
        ({"replica": 2}, "unknown"),
        ({"replicas": 0}, "replicas"),
        ({"replicas": "auto", "min_replicas": 3, "max_replicas": 1}, "min_replicas"),
        ({"routing": "random"}, "routing"),
        ({"set": ["scheduler.token_budget=-1"]}, "token_budget"),
        ({"config": 3}, "mapping"),
    ]:
        with pytest.raises(ValueError, match=match):
            read_args(bad)


def _replica(uid: str, serving: bool = True) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats={"serving": serving})


def _router(policy: str) -> Any:
    from ppserve.deploy.router import PipelineRouter

    router = PipelineRouter.__new__(PipelineRouter)  # Serve's constructor needs a running controller
    router.initialize_state(policy=policy)
    return router


def _pending(routing: dict[str, Any], rid: str = "x") -> Any:
    return SimpleNamespace(kwargs={"routing": routing}, metadata=SimpleNamespace(internal_request_id=rid))


def _route(router: Any, replicas: list[Any], routing: dict[str, Any], rid: str) -> str:
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(routing, rid)))
    chosen = ranks[0][0].replica_id
    router.on_request_routed(_pending(routing, rid), chosen, None)
    return str(chosen.unique_id)


def test_router_follows_the_prefix_pins_and_skips_rebuilding_replicas() -> None:
    router = _router("prefix")
    replicas = [_replica("a"), _replica("b")]
    keys = prefix_keys(list(range(64)), 16)
    first = _route(router, replicas, {"keys": keys}, "1")
    longer = prefix_keys(list(range(64)) + list(range(100, 132)), 16)
    assert _route(router, replicas, {"keys": longer}, "2") == first
    assert router.ongoing[first] == 2
    router.on_request_completed(replicas[0].replica_id if first == "a" else replicas[1].replica_id, "1")
    assert router.ongoing[first] == 1
    pinned = asyncio.run(router.choose_replicas(replicas, _pending({"replica": "b"})))
    assert [[r.replica_id.unique_id for r in rank] for rank in pinned] == [["b"]]
    assert asyncio.run(router.choose_replicas(replicas, _pending({"replica": "gone"}))) == []
    rebuilding = [_replica("a", serving=first != "a"), _replica("b", serving=first != "b")]
    assert _route(router, rebuilding, {"keys": keys}, "3") != first  # its prefix's replica is rebuilding


def test_router_round_robin_alternates() -> None:
    router = _router("round-robin")
    replicas = [_replica("a"), _replica("b")]
    keys = prefix_keys(list(range(64)), 16)
    assert [_route(router, replicas, {"keys": keys}, str(i)) for i in range(4)] == ["a", "b", "a", "b"]


def test_router_avoids_the_replica_that_refused() -> None:
    router = _router("prefix")
    replicas = [_replica("a"), _replica("b")]
    keys = prefix_keys(list(range(64)), 16)
    first = _route(router, replicas, {"keys": keys}, "1")
    assert _route(router, replicas, {"keys": keys, "avoid": first}, "2") != first
    assert _route(router, replicas[:1], {"keys": keys, "avoid": "a"}, "3") == "a"  # no other one


def test_a_shared_system_prompt_does_not_pull_new_conversations_together() -> None:
    router = _router("prefix")
    replicas = [_replica("a"), _replica("b")]
    system = list(range(32))  # two blocks every conversation starts with
    first = _route(router, replicas, {"keys": prefix_keys(system + list(range(100, 260)), 16)}, "1")
    other = _route(router, replicas, {"keys": prefix_keys(system + list(range(300, 460)), 16)}, "2")
    assert other != first  # the less loaded one: a system prompt is no conversation's history
