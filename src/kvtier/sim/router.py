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


class CacheAware:
    """SGLang's cache-aware router (`sglang-router --policy cache_aware`), which sees no cache: it keeps a
    tree per node of the prompts it sent there (never shrunk by the node's evictions). A request goes to
    the node whose tree matches the largest share of it, if that share is above `threshold` (its
    `--cache-threshold`, 0.3); otherwise to the node whose tree is smallest. (Its load balancing, when
    the busiest node has 64 more requests queued than the idlest, is not modelled.) Blocks stand in for
    its characters."""

    name = "cache-aware"

    def __init__(self, threshold: float = 0.3) -> None:
        self.threshold = threshold
        self._trees: list[set[int]] = []
        self._sizes: list[int] = []

    def route(self, request: Request, cluster: Cluster, free_at_s: list[float]) -> int:
        if not self._trees:
            self._trees, self._sizes = [set() for _ in free_at_s], [0] * len(free_at_s)
        matched = []
        for tree in self._trees:
            n = 0
            while n < len(request.hash_ids) and request.hash_ids[n] in tree:
                n += 1
            matched.append(n)
        best = max(range(len(matched)), key=lambda i: (matched[i], -i))
        if not request.hash_ids or matched[best] / len(request.hash_ids) <= self.threshold:
            best = min(range(len(self._sizes)), key=lambda i: (self._sizes[i], i))
        new = [h for h in request.hash_ids if h not in self._trees[best]]
        self._trees[best].update(new)
        self._sizes[best] += len(new)
        return best


class Dynamo:
    """NVIDIA Dynamo's KV router (`DefaultWorkerScorer`, 1.6.1): the node with the lowest cost
    `prefill_load_scale * max(0, booked prefill blocks + request blocks - credit) + running blocks`
    (`prefill_load_scale`: 1.0 by default, the service's `DYN_ROUTER_PREFILL_LOAD_SCALE`, the former
    `--kv-overlap-score-weight`; `dynamo:4` names the model with 4.0). Credit per cached prefix block
    by the tier it is in: HBM 1.0, DRAM 0.75 (its host tier), pool and SSD 0.25 (its disk tier, where a shared
    pool's blocks land). Booked prefill: the node's queue at the request's arrival, in blocks at its prefill
    speed. Running blocks: the distinct blocks of the requests it sent to the node that are still running
    (until their last token: `decode_s_per_token` each; 0 leaves the term out), as Dynamo counts decode load;
    a conversation's next turn leaves a busy node when they outweigh its cached prefix. Ties to the node
    whose queue drains first."""

    name = "dynamo"
    WEIGHTS = (1.0, 0.75, 0.25, 0.25)  # hbm, dram, pool, ssd (cluster.TIERS)

    def __init__(self, prefill_load_scale: float = 1.0) -> None:
        self.prefill_load_scale = prefill_load_scale
        if prefill_load_scale != 1.0:
            self.name = f"{Dynamo.name}:{prefill_load_scale:g}"
        self._running: list[list[tuple[float, list[int]]]] = []  # per node: (end, hash ids) of what it sent

    def route(self, request: Request, cluster: Cluster, free_at_s: list[float]) -> int:
        config = cluster.config
        if not self._running:
            self._running = [[] for _ in free_at_s]
        now_s = request.timestamp_ms / 1000.0
        block_s = config.compute_s(config.block_tokens)
        credits, costs = [], []
        for node in range(len(free_at_s)):
            self._running[node] = [(end, ids) for end, ids in self._running[node] if end > now_s]
            running = len({h for _, ids in self._running[node] for h in ids})
            credit = sum(self.WEIGHTS[t] for t in cluster.prefix_tiers(node, request.hash_ids))
            booked = max(0.0, free_at_s[node] - now_s) / block_s
            credits.append(credit)
            prefill = max(0.0, booked + len(request.hash_ids) - credit)
            costs.append((self.prefill_load_scale * prefill + running, free_at_s[node], node))
        node = min(costs)[2]
        if config.decode_s_per_token > 0:
            prefill_s = max(0.0, len(request.hash_ids) - credits[node]) * block_s
            end = max(now_s, free_at_s[node]) + prefill_s + request.output_length * config.decode_s_per_token
            self._running[node].append((end, request.hash_ids))
        return node


ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastLoaded, BestPrefixMatch, CacheAware, Dynamo)}


def dynamo_scale(name: str) -> float | None:
    """`dynamo` -> 1.0 (the selection service's default), `dynamo:S` -> S, Dynamo's `prefill_load_scale` (its
    `DYN_ROUTER_PREFILL_LOAD_SCALE`, formerly `--kv-overlap-score-weight`: how much a replica's prefill to do,
    after its cached prefix's credit, weighs against the blocks of the requests it runs); None for the other
    routers."""
    base, _, scale = name.partition(":")
    if base != Dynamo.name:
        return None
    try:
        value = float(scale) if scale else 1.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{name!r}: dynamo:S takes Dynamo's prefill_load_scale S, a number > 0")
    return value


def make_router(name: str) -> RoundRobin | LeastLoaded | BestPrefixMatch | CacheAware | Dynamo:
    aliases = {"rr": "round-robin", "best-prefix-match": "best-prefix", "prefix": "best-prefix", "ll": "least-loaded",
               "sglang": "cache-aware"}
    name = aliases.get(name, name)
    scale = dynamo_scale(name)
    if scale is not None and name != Dynamo.name:  # dynamo:S, Dynamo with prefill_load_scale S
        return Dynamo(scale)
    if name not in ROUTERS:
        raise UserError(f"unknown router {name!r} (use {', '.join(ROUTERS)}, or dynamo:S for Dynamo's "
                        "prefill_load_scale S)")
    return ROUTERS[name]()
