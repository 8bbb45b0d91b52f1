"""Replay a trace through a cluster: route, look up, promote/store, and time each prefill.

Timing (an estimate, stated in every report): a request's prefill takes the transfer time of its
hits from each lower tier (latency + bytes / bandwidth, one batched read per tier) plus the compute of
its uncached tokens at `MFU x peak` FLOP/s, not overlapped. Each node prefills one request at a time,
first come first served, so TTFT = queueing wait + prefill. Decode is not modelled (a prefill node,
as in Mooncake's disaggregated prefill pool). Cache state changes at arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.sim.cluster import TIERS, Cluster, ClusterConfig
from kvtier.sim.router import make_router
from kvtier.sim.trace import BLOCK_TOKENS, Request


@dataclass(slots=True)
class SimResult:
    config: ClusterConfig
    router: str
    num_requests: int = 0
    input_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    max_hit_tokens: int = 0
    written_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    ttft_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    requests_by_node: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_tokens_by_tier.values())

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def max_hit_rate(self) -> float:
        return self.max_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def hit_rate_by_tier(self) -> dict[str, float]:
        n = self.input_tokens or 1
        return {t: self.hit_tokens_by_tier[t] / n for t in TIERS}

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s else 0.0


def max_hit_tokens(requests: list[Request], block_tokens: int = BLOCK_TOKENS) -> int:
    """Hit tokens of an infinite cache: a block seen before hits if every block before it does."""
    seen: set[int] = set()
    total = 0
    for request in requests:
        for i, key in enumerate(request.hash_ids):
            if key not in seen:
                break
            total += request.block_tokens(i, block_tokens)
        seen.update(request.hash_ids)
    return total


def replay(requests: list[Request], config: ClusterConfig, router: str = "round-robin", *,
           progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay `requests` in file order; `progress(k)` is told of every k requests done (256 at a time)."""
    start = time.perf_counter()
    cluster = Cluster(config)
    route = make_router(router)
    result = SimResult(config, route.name, requests_by_node=[0] * config.num_nodes)
    free_at_s = [0.0] * config.num_nodes
    hit_by_tier = [0] * len(TIERS)
    for n, request in enumerate(requests):
        node = route.route(request, cluster, free_at_s)
        access = cluster.access(node, request)
        prefill = config.compute_s(access.miss_tokens)
        for t, tokens in enumerate(access.hit_tokens):
            hit_by_tier[t] += tokens
            if tokens:
                prefill += config.transfer_s(TIERS[t], tokens)
        arrival_s = request.timestamp_ms / 1000.0
        wait_s = max(0.0, free_at_s[node] - arrival_s)
        free_at_s[node] = arrival_s + wait_s + prefill
        result.ttft_s.append(wait_s + prefill)
        result.prefill_s.append(prefill)
        result.requests_by_node[node] += 1
        result.input_tokens += request.input_length
        if progress is not None and n % 256 == 255:
            progress(256)
    if progress is not None and len(requests) % 256:
        progress(len(requests) % 256)
    result.num_requests = len(requests)
    result.hit_tokens_by_tier = dict(zip(TIERS, hit_by_tier))
    result.written_tokens_by_tier = dict(zip(TIERS, cluster.written_tokens))
    result.max_hit_tokens = max_hit_tokens(requests, config.block_tokens)
    result.elapsed_s = time.perf_counter() - start
    return result
