"""Routing policies: given a request's prefix keys and each live replica's load, name the replica.

- `RoundRobin`: replicas in turn, blind to prefixes (what a plain load balancer does).
- `PowerOfTwo`: the less loaded of two replicas drawn at random (load-aware, prefix-blind).
- `PrefixAffinity`: the replica that was last sent the request's longest known prefix, where that prefix
  is a whole earlier prompt (the request continues it: a conversation's next turn) or at least half of
  the request's keys, unless that replica is loaded well beyond the least loaded one; otherwise
  `PowerOfTwo`. Without the first condition a prefix every request has (a system prompt) would pull all
  new conversations onto the replica that saw it first. The router remembers, per block key, the
  replica it routed that block to: an approximation of each replica's cache that needs no call to the
  replicas, and one that a replica's own eviction can make stale (a miss then costs only a recompute).
  Conversations stick: a turn's prompt begins with the previous turn's, so its deepest known key is there.

A load is what the caller can see cheaply and the same way for every replica: requests routed and not yet
finished. `choose` does not record; `record` is called once the request is sent, so a send that fails
leaves no trace.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol


class RoutingPolicy(Protocol):
    name: str

    def choose(self, keys: Sequence[bytes], loads: Mapping[str, float]) -> str: ...

    def record(self, keys: Sequence[bytes], replica: str) -> None: ...

    def forget(self, replica: str) -> None: ...


def _live(loads: Mapping[str, float]) -> list[str]:
    if not loads:
        raise ValueError("no replica to route to")
    return sorted(loads)


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, keys: Sequence[bytes], loads: Mapping[str, float]) -> str:
        live = _live(loads)
        replica = live[self._turn % len(live)]
        self._turn += 1
        return replica

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class PowerOfTwo:
    name = "power-of-two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: Sequence[bytes], loads: Mapping[str, float]) -> str:
        live = _live(loads)
        if len(live) == 1:
            return live[0]
        a, b = self._rng.sample(live, 2)
        return a if loads[a] <= loads[b] else b

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class PrefixAffinity:
    """`abs_slack` and `rel_slack` bound affinity: the prefix's replica is passed over only when its load
    exceeds the least loaded replica's by more than `abs_slack` requests and by more than `rel_slack`
    times, so short bursts keep their cache and a hot prefix cannot pile everything onto one replica."""

    name = "prefix"

    def __init__(self, abs_slack: float = 8.0, rel_slack: float = 1.5, min_share: float = 0.5,
                 max_keys: int = 1 << 18, seed: int = 0) -> None:
        if abs_slack < 0 or rel_slack < 1 or not 0 <= min_share <= 1 or max_keys < 1:
            raise ValueError(f"need abs_slack >= 0, rel_slack >= 1, 0 <= min_share <= 1 and max_keys >= 1; "
                             f"got {abs_slack}, {rel_slack}, {min_share}, {max_keys}")
        self.abs_slack, self.rel_slack, self.max_keys = abs_slack, rel_slack, max_keys
        self.min_share = min_share
        self._ends: OrderedDict[bytes, None] = OrderedDict()  # keys that ended a routed request's keys
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block key -> replica; least recent first
        self._fallback = PowerOfTwo(seed)
        self.num_affine = 0  # choices that followed a known prefix
        self.num_overloaded = 0  # choices where the prefix's replica was passed over for its load

    def owner(self, keys: Sequence[bytes], loads: Mapping[str, float]) -> str | None:
        """The live replica that was sent the deepest of `keys`, if any."""
        return self.owner_depth(keys, loads)[0]

    def owner_depth(self, keys: Sequence[bytes], loads: Mapping[str, float]) -> tuple[str | None, int]:
        """`owner`, and how many of `keys` its prefix covers."""
        for depth in range(len(keys), 0, -1):
            replica = self._owner.get(keys[depth - 1])
            if replica is not None and replica in loads:
                return replica, depth
        return None, 0

    def choose(self, keys: Sequence[bytes], loads: Mapping[str, float]) -> str:
        _live(loads)
        replica, depth = self.owner_depth(keys, loads)
        continues = depth > 0 and keys[depth - 1] in self._ends
        if replica is not None and (continues or depth >= self.min_share * len(keys)):
            least = min(loads.values())
            load = loads[replica]
            if load - least <= self.abs_slack or load <= self.rel_slack * least:
                self.num_affine += 1
                return replica
            self.num_overloaded += 1
        return self._fallback.choose(keys, loads)

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        if keys:
            self._ends[keys[-1]] = None
            self._ends.move_to_end(keys[-1])
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)
        while len(self._ends) > self.max_keys:
            self._ends.popitem(last=False)

    def forget(self, replica: str) -> None:
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]


POLICIES = ("prefix", "round-robin", "power-of-two")


def make_policy(name: str, seed: int = 0) -> RoutingPolicy:
    if name == "prefix":
        return PrefixAffinity(seed=seed)
    if name == "round-robin":
        return RoundRobin()
    if name == "power-of-two":
        return PowerOfTwo(seed)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
