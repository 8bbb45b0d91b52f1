"""Capacity sweeps and the local-versus-global comparison.

Both vary the DRAM-class cache (the tier a prefix is restored from at memory speed): either per-node
DRAM of C / nodes tokens each, or one pool of C tokens shared by every node. HBM and SSD stay as
configured (the configured DRAM and pool are replaced), so the curves show what buying C tokens of
host or pooled memory gets. The knee is the smallest swept capacity reaching 90% of the theoretical
maximum (no interpolation: it is a capacity that was replayed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.replay import SimResult, replay
from kvtier.sim.report import fmt_tokens
from kvtier.sim.router import make_router
from kvtier.sim.trace import BLOCK_TOKENS, Request

LOCAL, GLOBAL = "local", "global"


def sweep_configs(router: str) -> list[tuple[str, str, str]]:
    """(curve name, placement, router): per-node DRAM and one pool under `router`, and per-node DRAM
    under best-prefix routing (the cache-aware alternative to pooling) when `router` is not that."""
    router = make_router(router).name
    configs = [(f"per-node DRAM, {router}", LOCAL, router), (f"global pool, {router}", GLOBAL, router)]
    if router != "best-prefix":
        configs.append(("per-node DRAM, best-prefix", LOCAL, "best-prefix"))
    return configs


def with_cache(config: ClusterConfig, capacity_tokens: int, placement: str) -> ClusterConfig:
    """`config` with `capacity_tokens` of DRAM-class cache, split per node (`local`) or pooled (`global`)."""
    assert placement in (LOCAL, GLOBAL), placement
    if placement == LOCAL:
        return replace(config, dram_tokens=capacity_tokens // config.num_nodes, pool_tokens=0)
    return replace(config, dram_tokens=0, pool_tokens=capacity_tokens)


def local_vs_global(requests: list[Request], config: ClusterConfig, router: str) -> dict | None:
    """Per-node DRAM versus one pool holding the same total; None if the config has no such cache."""
    total = config.dram_tokens * config.num_nodes + config.pool_tokens
    if total == 0:
        return None
    local = replay(requests, with_cache(config, total, LOCAL), router)
    pooled = replay(requests, with_cache(config, total, GLOBAL), router)
    return {"capacity_tokens": total, "router": local.router, "local_hit_rate": local.hit_rate,
            "global_hit_rate": pooled.hit_rate, "ratio": _ratio(pooled.hit_rate, local.hit_rate)}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None   # None, not inf: the JSON output stays strict JSON


def footprint_tokens(requests: list[Request], block_tokens: int = BLOCK_TOKENS) -> int:
    """Tokens an infinite cache ends up holding (each distinct block once)."""
    key_to_tokens: dict[int, int] = {}
    for request in requests:
        for i, key in enumerate(request.hash_ids):
            key_to_tokens.setdefault(key, request.block_tokens(i, block_tokens))
    return sum(key_to_tokens.values())


def default_capacities(requests: list[Request], block_tokens: int = BLOCK_TOKENS, num_points: int = 9) -> list[int]:
    """Up to `num_points` powers of two, from one block up to the first at or above the trace's
    footprint (where a pool holds everything and reaches the maximum)."""
    top_log2 = (max(footprint_tokens(requests, block_tokens), 1) - 1).bit_length()
    low_log2 = min(top_log2, max(top_log2 - num_points + 1, (block_tokens - 1).bit_length()))  # >= one block
    return [1 << e for e in range(low_log2, top_log2 + 1)]


def knee(capacities: list[int], curve: list[float], max_hit_rate: float, fraction: float = 0.9) -> int | None:
    """Smallest capacity whose hit rate reaches `fraction` of the maximum; None if none does."""
    target = fraction * max_hit_rate
    return next((cap for cap, rate in zip(capacities, curve) if rate >= target - 1e-12), None)


def sweep(requests: list[Request], config: ClusterConfig, capacities: list[int] | None = None,
          router: str = "round-robin", *, on_result: Callable[[SimResult], None] | None = None) -> dict:
    """Hit rate of each of `sweep_configs(router)` at each capacity (tokens of DRAM-class cache in the
    whole cluster); `on_result` sees every replay (progress)."""
    capacities = sorted(capacities or default_capacities(requests, config.block_tokens))
    curves: dict[str, list[float]] = {}
    max_rate = 0.0
    for name, placement, curve_router in sweep_configs(router):
        curve = []
        for cap in capacities:
            result = replay(requests, with_cache(config, cap, placement), curve_router)
            curve.append(result.hit_rate)
            max_rate = result.max_hit_rate   # a property of the trace: the same for every replay
            if on_result is not None:
                on_result(result)
        curves[name] = curve
    local, pooled = list(curves.values())[:2]
    return {"axis": "DRAM-class cache per cluster", "capacities_tokens": capacities, "curves": curves,
            "max_hit_rate": max_rate,
            "knee_tokens": {name: knee(capacities, curve, max_rate) for name, curve in curves.items()},
            "global_over_local": [_ratio(g, lo) for g, lo in zip(pooled, local)],
            "title": _title(config, router)}


def _title(config: ClusterConfig, router: str) -> str:
    ssd = f", SSD {fmt_tokens(config.ssd_tokens)} tokens/node" if config.ssd_tokens else ""
    return (f"{config.num_nodes} nodes x {config.gpus_per_node} {config.gpu}, {config.model}, "
            f"HBM {fmt_tokens(config.hbm_tokens)} KV tokens/node{ssd}, write-{config.write_policy}")


def num_sweep_replays(router: str, capacities: list[int]) -> int:
    return len(sweep_configs(router)) * len(capacities)
