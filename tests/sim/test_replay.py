"""The cluster replay: hit rates computed by hand on tiny traces (blocks of 4 tokens), exact LRU
order, the tier stack's write policies, routers, the TTFT model, and the invariants on the sample."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvtier.sim.cluster import TIERS, Cluster, ClusterConfig
from kvtier.sim.replay import max_hit_tokens, replay
from kvtier.sim.report import percentile, summarize
from kvtier.sim.sweep import GLOBAL, LOCAL, with_cache
from kvtier.sim.trace import Request, read_trace

BT = 4   # tokens per block in the hand-made traces


def req(ids: list[int], num_tokens: int | None = None, ts_ms: float = 0.0) -> Request:
    return Request(ts_ms, BT * len(ids) if num_tokens is None else num_tokens, 1, list(ids))


def cfg(**kw) -> ClusterConfig:
    return ClusterConfig(block_tokens=BT, **kw)


def hbm_keys(cluster: Cluster, node: int = 0, tier: int = 0) -> list[int]:
    return list(cluster.nodes[node][tier])   # least recently used first


@pytest.fixture(scope="module")
def sample(mooncake_trace_path) -> list[Request]:
    return read_trace(mooncake_trace_path)


# ---- hit counting -------------------------------------------------------------------------------

PREFIX_TRACE = [
    req([1, 2, 3]),          # cold: 0
    req([1, 2, 3]),          # all 12
    req([9, 2, 3]),          # 2 and 3 are cached, but block 0 missed: a block counts only after a full prefix: 0
    req([1, 2, 5], 10),      # 1, 2 hit, 5 new: 8
    req([1, 2, 5], 10),      # all, the partial last block counts its 2 real tokens: 10
    req([1, 7], 6),          # 4
]


def test_prefix_property_and_partial_last_blocks_by_hand():
    cluster = Cluster(cfg(hbm_tokens=1000))
    hits = [cluster.access(0, r).hit_tokens[0] for r in PREFIX_TRACE]
    assert hits == [0, 12, 0, 8, 10, 4]
    result = replay(PREFIX_TRACE, cfg(hbm_tokens=1000))
    assert (result.input_tokens, result.hit_tokens) == (62, 34)
    assert result.hit_rate == 34 / 62
    assert result.hit_tokens_by_tier == {"hbm": 34, "dram": 0, "pool": 0, "ssd": 0}


def test_theoretical_maximum_by_hand():
    assert max_hit_tokens(PREFIX_TRACE, BT) == 34
    # a block seen only inside the same request does not hit, nor does one after a missed block
    assert max_hit_tokens([req([1, 2]), req([3, 2]), req([3, 2, 4], 9)], BT) == 0 + 0 + 8


def test_access_reports_miss_tokens():
    cluster = Cluster(cfg(hbm_tokens=1000))
    cluster.access(0, req([1, 2]))
    access = cluster.access(0, req([1, 3], 7))
    assert (access.hit_tokens, access.miss_tokens) == ([4, 0, 0, 0], 3)


def test_infinite_capacity_reaches_the_theoretical_maximum(sample):
    infinite = 10**12
    one_node = replay(sample, ClusterConfig(hbm_tokens=infinite))
    assert one_node.hit_tokens == one_node.max_hit_tokens == max_hit_tokens(sample)
    assert 0.5 < one_node.max_hit_rate < 1   # the sample trace is ~65% reusable
    pooled = replay(sample, ClusterConfig(num_nodes=4, pool_tokens=infinite))
    assert pooled.hit_tokens == pooled.max_hit_tokens
    assert pooled.hit_tokens_by_tier["pool"] == pooled.hit_tokens


def test_capacity_zero_hits_nothing(sample):
    for config in (ClusterConfig(), ClusterConfig(num_nodes=4, gpus_per_node=2)):
        result = replay(sample, config, "best-prefix")
        assert result.hit_tokens == 0 and result.hit_rate == 0.0
        assert result.max_hit_rate > 0.5
    assert replay(PREFIX_TRACE, cfg()).hit_tokens == 0


# ---- LRU order ----------------------------------------------------------------------------------

def test_lru_order_exact():
    cluster = Cluster(cfg(hbm_tokens=2 * BT))
    steps = [([1], 0, [1]), ([2], 0, [1, 2]), ([1], 4, [2, 1]), ([3], 0, [1, 3]), ([2], 0, [3, 2]), ([3], 4, [2, 3])]
    for ids, hit, keys in steps:
        assert cluster.access(0, req(ids)).hit_tokens[0] == hit
        assert hbm_keys(cluster) == keys
    assert cluster.nodes[0][0].num_evictions == 2


def test_blocks_are_refreshed_tail_first_so_roots_outlive_leaves():
    # a request longer than the cache keeps its first blocks (a later request can use them),
    # not its last ones (useless without the blocks before them)
    cluster = Cluster(cfg(hbm_tokens=2 * BT))
    cluster.access(0, req([1, 2, 3]))
    assert hbm_keys(cluster) == [2, 1]
    assert cluster.access(0, req([1, 2, 4])).hit_tokens[0] == 8
    assert hbm_keys(cluster) == [2, 1]


def test_root_first_tiers_evict_a_prefix_s_root_before_its_leaves():
    # kvtier's connector behind vLLM admits a request's blocks in prompt order: its tiers' LRU loses the root
    # first, and with it the whole chain; tail first keeps the root (a later request hits it)
    for root_first, dram_after, hit in ((False, [1, 4, 3], 4), (True, [2, 3, 4], 0)):
        cluster = Cluster(cfg(dram_tokens=3 * BT, root_first_tiers=root_first))
        cluster.access(0, req([1, 2]))
        cluster.access(0, req([3, 4]))
        assert hbm_keys(cluster, tier=1) == dram_after  # least recently used first
        assert cluster.access(0, req([1, 2])).hit_tokens[1] == hit


def test_block_larger_than_the_tier_is_not_stored():
    cluster = Cluster(cfg(hbm_tokens=3))
    cluster.access(0, req([1, 2], 6))       # block 1 (4 tokens) cannot fit; block 2 (2 tokens) can
    assert hbm_keys(cluster) == [2]
    assert cluster.access(0, req([1, 2], 6)).hit_tokens[0] == 0


# ---- the tier stack -----------------------------------------------------------------------------

STACK_TRACE = [req([1]), req([2]), req([1]), req([3]), req([2]), req([3])]


def test_write_through_hbm_over_dram_by_hand():
    cluster = Cluster(cfg(hbm_tokens=BT, dram_tokens=2 * BT))
    dram_hits = [cluster.access(0, r).hit_tokens[1] for r in STACK_TRACE]
    # DRAM holds every block written (inclusive); [1] comes back from DRAM, [3] evicts 2 there
    assert dram_hits == [0, 0, 4, 0, 0, 4]
    assert hbm_keys(cluster) == [3] and hbm_keys(cluster, tier=1) == [2, 3]


def test_write_back_hbm_over_dram_by_hand():
    cluster = Cluster(cfg(hbm_tokens=BT, dram_tokens=2 * BT, write_policy="back"))
    dram_hits = [cluster.access(0, r).hit_tokens[1] for r in STACK_TRACE]
    # DRAM holds only what HBM evicted (exclusive-ish), so it keeps 2 when 3 arrives
    assert dram_hits == [0, 0, 4, 0, 4, 4]
    assert hbm_keys(cluster) == [3] and hbm_keys(cluster, tier=1) == [2, 3]


def test_lower_tiers_catch_what_hbm_dropped():
    trace = [req([1, 2]), req([3, 4]), req([1, 2]), req([1, 5])]
    result = replay(trace, cfg(hbm_tokens=2 * BT, ssd_tokens=100 * BT))
    assert result.hit_tokens_by_tier == {"hbm": 4, "dram": 0, "pool": 0, "ssd": 8}
    # HBM -> DRAM -> SSD order: a block in both counts for the higher tier
    result = replay(trace, cfg(hbm_tokens=2 * BT, dram_tokens=2 * BT, ssd_tokens=100 * BT))
    assert result.hit_tokens_by_tier == {"hbm": 4, "dram": 0, "pool": 0, "ssd": 8}
    assert replay(trace, cfg(hbm_tokens=2 * BT, dram_tokens=4 * BT)).hit_tokens_by_tier["dram"] == 8


def test_pool_is_shared_and_dram_is_not():
    trace = [req([1, 2]), req([1, 2]), req([1, 2]), req([1, 2])]   # round-robin over 2 nodes: 0, 1, 0, 1
    pooled = replay(trace, cfg(num_nodes=2, pool_tokens=2 * BT))
    assert pooled.hit_tokens_by_tier["pool"] == 24 and pooled.requests_by_node == [2, 2]
    local = replay(trace, cfg(num_nodes=2, dram_tokens=BT * 2))
    assert local.hit_tokens_by_tier["dram"] == 16   # the first request on each node misses


def test_global_beats_local_at_equal_total_capacity_by_hand():
    trace = [req([1]), req([1]), req([1]), req([1])]
    local = replay(trace, with_cache(cfg(num_nodes=2), 2 * BT, LOCAL))
    pooled = replay(trace, with_cache(cfg(num_nodes=2), 2 * BT, GLOBAL))
    assert (local.hit_tokens, pooled.hit_tokens) == (8, 12)


@pytest.mark.parametrize("capacity", ["2M", "8M"])
def test_global_at_least_local_at_equal_total_capacity_on_the_sample(sample, capacity):
    from kvtier.units import parse_count

    config = ClusterConfig(num_nodes=4, hbm_tokens=256 * 1024)
    total = parse_count(capacity)
    local = replay(sample, with_cache(config, total, LOCAL))
    pooled = replay(sample, with_cache(config, total, GLOBAL))
    assert local.config.dram_tokens * 4 == pooled.config.pool_tokens == total
    assert pooled.hit_rate >= local.hit_rate > 0


# ---- one node, one tier: the plain prefix cache ----------------------------------------------------

def lru_prefix_replay(requests: list[Request], capacity_tokens: int, block_tokens: int) -> int:
    """The plain LRU prefix cache, written out independently: hit tokens of the longest cached prefix;
    then the request's blocks are (re)inserted last block first, so its first block ends most recent."""
    cache: OrderedDict[int, int] = OrderedDict()   # block id -> tokens, least recently used first
    used = hits = 0
    for r in requests:
        sizes = [min(block_tokens, r.input_length - block_tokens * i) for i in range(len(r.hash_ids))]
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in cache:
            n += 1
        hits += sum(sizes[:n])
        for key, size in reversed(list(zip(r.hash_ids, sizes))):
            if size > capacity_tokens:
                continue
            if key in cache:
                used -= cache.pop(key)
            while used + size > capacity_tokens:
                used -= cache.popitem(last=False)[1]
            cache[key] = size
            used += size
    return hits


def _random_tree_trace(seed: int, num_requests: int = 300) -> list[Request]:
    """Requests walking a random prefix tree (branching 3, depth <= 6) with random partial last blocks.
    As with chained hashes, an id names its tokens: a partial last block gets its own id per length."""
    rng = random.Random(seed)
    path_to_id: dict[tuple, int] = {}
    out = []
    for _ in range(num_requests):
        path, ids = (), []
        depth, last_tokens = rng.randint(1, 6), rng.randint(1, BT)
        for d in range(depth):
            path += (rng.randrange(3),)
            key = path if d < depth - 1 or last_tokens == BT else (path, last_tokens)
            ids.append(path_to_id.setdefault(key, len(path_to_id)))
        out.append(req(ids, BT * (depth - 1) + last_tokens))
    return out


@pytest.mark.parametrize("tier", ["hbm", "dram", "pool", "ssd"])
@pytest.mark.parametrize("capacity", [0, 3, 4, 7, 12, 29, 64])
def test_one_node_one_tier_matches_a_hand_written_lru(tier, capacity):
    trace = _random_tree_trace(seed=capacity)
    expected = lru_prefix_replay(trace, capacity, BT)
    for policy in ("through", "back"):
        result = replay(trace, cfg(**{f"{tier}_tokens": capacity}, write_policy=policy))
        assert result.hit_tokens == result.hit_tokens_by_tier[tier] == expected
    if capacity >= 29:
        assert expected > 0


@pytest.mark.parametrize("capacity", [512 * 3 + 100, 1 << 20, 4 << 20])
def test_one_node_one_tier_matches_a_hand_written_lru_on_the_sample(sample, capacity):
    result = replay(sample, ClusterConfig(hbm_tokens=capacity))
    assert result.hit_tokens == lru_prefix_replay(sample, capacity, 512)


# ---- routers ------------------------------------------------------------------------------------

def test_round_robin_cycles():
    trace = [req([1]), req([2]), req([3]), req([1]), req([2])]
    assert replay(trace, cfg(num_nodes=2, hbm_tokens=100)).requests_by_node == [3, 2]


def test_best_prefix_sends_a_request_where_its_prefix_is():
    trace = [req([1]), req([1]), req([2]), req([2])]
    # round-robin: nodes 0, 1, 0, 1 -- every repeat lands on the other node
    assert replay(trace, cfg(num_nodes=2, hbm_tokens=100), "round-robin").hit_tokens == 0
    # best-prefix: the repeat of [1] goes to node 0; [2] matches nowhere -> least loaded (node 1)
    result = replay(trace, cfg(num_nodes=2, hbm_tokens=100), "best-prefix-match")
    assert result.router == "best-prefix"
    assert (result.hit_tokens, result.requests_by_node) == (8, [2, 2])


def test_least_loaded_picks_the_node_that_drains_first():
    # 1 FLOP/token at 1 FLOP/s: a request's prefill takes as many seconds as it computes tokens
    timing = dict(gpus_per_node=1, flops_per_token=1.0, gpu_flops=1.0, mfu=1.0)
    trace = [req([1, 2, 3]), req([4]), req([5]), req([6])]   # 12 s, 4 s, then 4 s on node 1 again
    result = replay(trace, cfg(num_nodes=2, **timing), "least-loaded")
    assert result.requests_by_node == [1, 3]
    assert result.ttft_s == [12.0, 4.0, 8.0, 12.0]


def test_unknown_router_is_a_user_error():
    from kvtier.errors import UserError

    with pytest.raises(UserError, match="unknown router 'nearest'"):
        replay(PREFIX_TRACE, cfg(), "nearest")


# ---- timing -------------------------------------------------------------------------------------

def test_ttft_is_queueing_plus_transfer_plus_compute():
    config = cfg(gpus_per_node=2, hbm_tokens=BT, dram_tokens=100 * BT, flops_per_token=1.0, gpu_flops=1.0,
                 mfu=0.5, kv_bytes_per_token=10.0, bw_bytes_s={"dram": 20.0, "pool": 1.0, "ssd": 1.0},
                 latency_s={"dram": 0.5, "pool": 0.0, "ssd": 0.0})
    # node FLOP/s = 2 GPUs x 1 x 0.5 = 1: compute takes one second per token
    trace = [req([1, 2], ts_ms=0), req([3], 2, ts_ms=1000), req([1, 2], ts_ms=60_000)]
    result = replay(trace, config)
    # third: HBM holds one block ([3] took it), DRAM has both of [1, 2]: 8 tokens from DRAM
    # = 0.5 s latency + 8 x 10 B / (20 B/s per GPU x 2 GPUs) = 2.5 s, nothing to compute
    assert result.prefill_s == [8.0, 2.0, 2.5]
    assert result.ttft_s == [8.0, 9.0, 2.5]   # the second waits 7 s for the first
    s = summarize(result)
    assert s["bytes_read_by_tier"] == {"hbm": 0.0, "dram": 80.0, "pool": 0.0, "ssd": 0.0}
    assert s["prefill_flops_saved"] == 8.0


def test_percentile_nearest_rank():
    values = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0]
    assert [percentile(values, q) for q in (0, 50, 99, 100)] == [1.0, 3.0, 6.0, 6.0]
    assert percentile([], 50) == 0.0


def test_bad_config_is_a_user_error():
    from kvtier.errors import UserError

    with pytest.raises(UserError, match="--dram-tokens must be >= 0"):
        ClusterConfig(dram_tokens=-1)
    with pytest.raises(UserError, match="write policy"):
        ClusterConfig(write_policy="around")
    with pytest.raises(UserError, match="--nodes"):
        ClusterConfig(num_nodes=0)


# ---- the sample trace ---------------------------------------------------------------------------

def test_sample_trace_invariants(sample):
    config = ClusterConfig(num_nodes=4, hbm_tokens=1 << 20, dram_tokens=2 << 20, pool_tokens=8 << 20,
                           ssd_tokens=16 << 20)
    result = replay(sample, config, "best-prefix")
    assert result.num_requests == 3993 == sum(result.requests_by_node)
    assert result.input_tokens == sum(r.input_length for r in sample)
    assert 0 < result.hit_rate <= result.max_hit_rate < 1
    assert result.hit_tokens == sum(result.hit_tokens_by_tier.values())
    assert all(result.hit_tokens_by_tier[t] > 0 for t in TIERS)
    assert all(ttft >= prefill >= 0 for ttft, prefill in zip(result.ttft_s, result.prefill_s))
    # each request stores each of its blocks into HBM at most once
    assert 0 < result.written_tokens_by_tier["hbm"] <= result.input_tokens
    assert all(result.written_tokens_by_tier[t] > 0 for t in TIERS)
    # more of the same cache never hurts on this trace (one node, one tier)
    rates = [replay(sample, ClusterConfig(hbm_tokens=c)).hit_rate for c in (1 << 20, 4 << 20, 16 << 20)]
    assert rates == sorted(rates) and rates[0] < rates[-1]
