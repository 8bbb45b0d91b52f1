"""Routers: which node serves a request. Each is a small class with `route(request, cluster, free_at_s)`."""

from __future__ import annotations

from kvtier.errors import UserError
from kvtier.sim.cluster import Cluster
from kvtier.sim.trace import Request


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, cluster: Cluster, free_at_s: list[float]) -> int:
        node = self._next
        self._next = (node + 1) % len(free_at_s)
        return node


class LeastLoaded:
    """The node whose prefill queue drains first (lowest index on ties)."""

    name = "least-loaded"

    def route(self, request: Request, cluster: Cluster, free_at_s: list[float]) -> int:
        return min(range(len(free_at_s)), key=free_at_s.__getitem__)


class BestPrefixMatch:
    """Cache-aware: the node on which the request's cached prefix (its own tiers, then the shared pool)
    is longest, least loaded on ties — the match half of Mooncake's conductor and Dynamo's KV router,
    without their load penalty."""

    name = "best-prefix"

    def route(self, request: Request, cluster: Cluster, free_at_s: list[float]) -> int:
        best, best_key = 0, None
        for node in range(len(free_at_s)):
            key = (-cluster.num_prefix_blocks(node, request.hash_ids), free_at_s[node])
            if best_key is None or key < best_key:
                best, best_key = node, key
        return best


ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastLoaded, BestPrefixMatch)}


def make_router(name: str) -> RoundRobin | LeastLoaded | BestPrefixMatch:
    aliases = {"rr": "round-robin", "best-prefix-match": "best-prefix", "prefix": "best-prefix", "ll": "least-loaded"}
    name = aliases.get(name, name)
    if name not in ROUTERS:
        raise UserError(f"unknown router {name!r} (use {', '.join(ROUTERS)})")
    return ROUTERS[name]()
