"""Capacity sweeps: the knee, the default capacities, the local/global split and the comparison."""

from __future__ import annotations

import pytest

from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.replay import replay
from kvtier.sim.report import fmt_tokens
from kvtier.sim.sweep import (GLOBAL, LOCAL, default_capacities, footprint_tokens, knee, local_vs_global, sweep,
                              sweep_configs, with_cache)
from kvtier.sim.trace import Request


def req(ids: list[int], num_tokens: int) -> Request:
    return Request(0.0, num_tokens, 1, ids)


def test_knee_is_the_first_swept_capacity_at_90_percent_of_max():
    caps = [1, 2, 4, 8]
    assert knee(caps, [0.1, 0.5, 0.54, 0.6], 0.6) == 4          # 0.9 x 0.6 = 0.54 reached exactly
    assert knee(caps, [0.1, 0.5, 0.53, 0.6], 0.6) == 8
    assert knee(caps, [0.1, 0.2, 0.3, 0.4], 0.6) is None
    assert knee(caps, [0.0, 0.0, 0.0, 0.0], 0.0) == 1           # nothing to gain: the smallest capacity


def test_footprint_and_default_capacities():
    trace = [req([0, 1, 2], 1100), req([0, 1, 3], 1300), req([0, 1, 2], 1100)]
    assert footprint_tokens(trace) == 512 + 512 + 76 + 276
    assert default_capacities(trace) == [512, 1024, 2048]        # from one block to the first >= 1376
    big = [req(list(range(40_000)), 40_000 * 512)]
    assert default_capacities(big) == [1 << e for e in range(17, 26)]   # 9 points, 128k .. 32M >= 20.48M


def test_with_cache_splits_per_node_or_pools():
    config = ClusterConfig(num_nodes=4, hbm_tokens=7, dram_tokens=100, pool_tokens=100)
    local, pooled = with_cache(config, 1000, LOCAL), with_cache(config, 1000, GLOBAL)
    assert (local.dram_tokens, local.pool_tokens, local.hbm_tokens) == (250, 0, 7)
    assert (pooled.dram_tokens, pooled.pool_tokens, pooled.hbm_tokens) == (0, 1000, 7)


def test_sweep_configs_follow_the_router():
    assert [p for _, p, _ in sweep_configs("rr")] == [LOCAL, GLOBAL, LOCAL]
    assert [r for _, _, r in sweep_configs("least-loaded")] == ["least-loaded", "least-loaded", "best-prefix"]
    assert len(sweep_configs("best-prefix")) == 2


def test_local_vs_global_by_hand():
    trace = [req([0], 512)] * 4                # round-robin on 2 nodes: nodes 0, 1, 0, 1
    config = ClusterConfig(num_nodes=2, dram_tokens=512)
    lg = local_vs_global(trace, config, "round-robin")
    assert lg == {"capacity_tokens": 1024, "router": "round-robin", "local_hit_rate": 0.5,
                  "global_hit_rate": 0.75, "ratio": 1.5}
    assert local_vs_global(trace, ClusterConfig(num_nodes=2), "round-robin") is None
    no_local_hits = local_vs_global([req([0], 512), req([0], 512)], config, "round-robin")
    assert no_local_hits["ratio"] is None and no_local_hits["global_hit_rate"] == 0.5


def test_sweep_on_the_sample_pools_beat_per_node_caches(mooncake_trace_path):
    from kvtier.sim.trace import read_trace

    trace = read_trace(mooncake_trace_path)
    seen = []
    result = sweep(trace, ClusterConfig(num_nodes=4, hbm_tokens=0), [1 << 22, 1 << 25], on_result=seen.append)
    assert len(seen) == 6 and all(r.num_requests == 3993 for r in seen)
    local, pooled, best_prefix = result["curves"].values()
    assert all(g >= lo for g, lo in zip(pooled, local))
    assert pooled[-1] == pytest.approx(result["max_hit_rate"])    # 32M > the 20.4M footprint: holds it all
    assert result["knee_tokens"]["global pool, round-robin"] == 1 << 25
    assert result["global_over_local"][0] > 1


def test_progress_is_told_of_every_request():
    done = []
    replay([req([i], 512) for i in range(600)], ClusterConfig(hbm_tokens=512), progress=done.append)
    assert done == [256, 256, 88]


def test_fmt_tokens_reads_like_parse_count():
    assert [fmt_tokens(n) for n in (0, 512, 1536, 3 << 20, 4489735, 2 << 30)] == [
        "0", "512", "1.5k", "3M", "4.28M", "2G"]
