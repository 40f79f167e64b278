"""The Ray Serve request router of the pipeline replicas: ppserve.route's policies behind Serve's
`RequestRouter` extension point (ray.serve.request_router, Ray 2.60).

Each call to a replica carries a `routing` keyword: `{"keys": [...]}` (the prompt's prefix keys, for
requests that generate; with `"avoid": id` when that replica just refused the request) or
`{"replica": id}` (a call meant for one replica: cancel, stats, metrics).
The load a policy sees is this router's own count of requests it routed that have not completed; a
replica whose routing stats say it is not serving (its pipeline is being rebuilt, or it failed) is
passed over while another one serves. The router answers in ranks: the policy's choice first, then the
others by load, so Serve falls through when the first one is at `max_ongoing_requests`.
"""

from __future__ import annotations

import weakref
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ppserve.route import RoutingPolicy, make_policy

_LIVE: weakref.WeakSet[PipelineRouter] = weakref.WeakSet()  # this process's routers, for the ingress


def routers() -> list[PipelineRouter]:
    return list(_LIVE)


def routing_of(pending: PendingRequest | None) -> dict[str, Any]:
    if pending is None:
        return {}
    routing = pending.kwargs.get("routing")
    return routing if isinstance(routing, dict) else {}


class PipelineRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix", **_: Any) -> None:
        self.policy: RoutingPolicy = make_policy(policy)
        self.ongoing: dict[str, int] = {}  # replica -> requests routed there, not completed
        self._counted: dict[str, str] = {}  # internal request id -> replica, for the requests counted
        self.routed: dict[str, int] = {}  # replica -> requests routed there in all
        # Serve may ship this class by value, with copies of this module's globals: register with the
        # imported module, the one the ingress reads.
        import ppserve.deploy.router as imported

        imported._LIVE.add(self)

    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        routing = routing_of(pending_request)
        pinned = routing.get("replica")
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        serving = {i: r for i, r in by_id.items() if (r.routing_stats or {}).get("serving", True)}
        pool = serving or by_id
        avoid = routing.get("avoid")
        if avoid in pool and len(pool) > 1:
            pool = {i: r for i, r in pool.items() if i != avoid}
        if not pool:
            return []
        loads = {i: float(self.ongoing.get(i, 0)) for i in pool}
        choice = self.policy.choose(routing.get("keys") or (), loads)
        rest = sorted((i for i in pool if i != choice), key=lambda i: loads[i])
        return [[pool[choice]], [pool[i] for i in rest]] if rest else [[pool[choice]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        routing = routing_of(pending_request)
        if "replica" in routing:
            return
        rid = replica_id.unique_id
        self.policy.record(routing.get("keys") or (), rid)
        self.ongoing[rid] = self.ongoing.get(rid, 0) + 1
        self.routed[rid] = self.routed.get(rid, 0) + 1
        self._counted[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._counted.pop(internal_request_id, None)
        if rid is not None and self.ongoing.get(rid, 0) > 0:
            self.ongoing[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self.ongoing.pop(replica_id.unique_id, None)
