"""Which replica serves a request: the routing policies, pure Python so that the Ray Serve router
(ppserve/deploy/router.py) and the simulator (ppserve/sim/replicas.py) run the same code.

keys.py hashes a prompt's first blocks exactly as the block manager keys them; policy.py chooses a replica
from those keys and the replicas' loads.
"""

from ppserve.route.keys import prefix_keys
from ppserve.route.policy import POLICIES, PowerOfTwo, PrefixAffinity, RoundRobin, RoutingPolicy, make_policy

__all__ = ["POLICIES", "PowerOfTwo", "PrefixAffinity", "RoundRobin", "RoutingPolicy", "make_policy",
           "prefix_keys"]
