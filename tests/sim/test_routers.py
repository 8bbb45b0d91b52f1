"""The router models `kvtier bench route` compares the simulator with: SGLang's cache-aware router (a tree
of what it routed, a share threshold, else the smallest tree) and Dynamo's tier-weighted KV cost."""

from __future__ import annotations

from kvtier.sim.cluster import Cluster, ClusterConfig
from kvtier.sim.router import CacheAware, Dynamo, make_router
from kvtier.sim.trace import Request

BT = 4


def req(ids: list[int]) -> Request:
    return Request(0.0, BT * len(ids), 1, list(ids))


def test_cache_aware_keeps_a_session_where_it_sent_it_and_opens_new_ones_on_the_smallest_tree():
    cluster, router, free = Cluster(ClusterConfig(num_nodes=2, hbm_tokens=64, block_tokens=BT)), CacheAware(), [0, 0]
    assert router.route(req([1, 2, 3]), cluster, free) == 0      # nothing routed yet: the first smallest tree
    assert router.route(req([7, 8]), cluster, free) == 1         # node 0's tree is larger now
    assert router.route(req([1, 2, 3, 4, 5]), cluster, free) == 0  # 3 of 5 blocks (60% > 30%) routed to node 0
    assert router.route(req([1, 9, 9, 9]), cluster, free) == 1   # 1 of 4 (25%): the smallest tree (node 1: 2 blocks)
    assert make_router("sglang").name == "cache-aware"


def test_dynamo_credits_each_cached_block_by_its_tier_against_the_prefill_booked_on_each_node():
    # one block of prefill takes 1 s: a node's queue at a request's arrival counts 1 block per second
    config = ClusterConfig(num_nodes=2, gpus_per_node=1, hbm_tokens=64, dram_tokens=64, pool_tokens=64, block_tokens=BT,
                           flops_per_token=1.0, gpu_flops=BT, mfu=1.0)
    cluster, router = Cluster(config), Dynamo()
    cluster.access(0, req([1, 2, 3, 4]))                         # node 0: HBM, DRAM (write-through) and the pool
    later = Request(10_000.0, 5 * BT, 1, [1, 2, 3, 4, 5])         # arrives at 10 s, both queues drained
    assert router.route(later, cluster, [9.0, 0.0]) == 0          # 4 HBM blocks beat the idler node's 4 pool ones
    assert router.route(later, cluster, [12.5, 0.0]) == 0         # 2.5 blocks booked + 1 left: under 5 - 1 (pool)
    assert router.route(later, cluster, [13.5, 0.0]) == 1         # 3.5 booked + 1: the other node costs 4
    for key in (1, 2, 3, 4):
        cluster.nodes[0][0].pop(key)                              # HBM evicted them: DRAM (0.75) beats the pool
    assert router.route(later, cluster, [9.0, 0.0]) == 0
    for key in (1, 2, 3, 4):
        cluster.nodes[0][1].pop(key)                              # only the pool now: a tie, the idler node takes it
    assert router.route(later, cluster, [9.0, 0.0]) == 1


def test_dynamo_s_prefill_load_scale_weighs_a_cached_prefix_against_the_blocks_a_node_runs():
    """Dynamo's `prefill_load_scale` (`dynamo:S`): a node running a 6-block request, with 4 of the next
    request's 5 blocks in its DRAM (credit 3), costs (5 - 3) + 6 = 8 against an idle node's 5 at scale 1,
    and 4 * 2 + 6 = 14 against 4 * 5 = 20 at scale 4."""
    config = ClusterConfig(num_nodes=2, gpus_per_node=1, hbm_tokens=64, dram_tokens=64, block_tokens=BT,
                           flops_per_token=1.0, gpu_flops=1e9, mfu=1.0, decode_s_per_token=1.0)
    picks = {}
    for name in ("dynamo", "dynamo:4"):
        cluster, router = Cluster(config), make_router(name)
        cluster.access(0, req([1, 2, 3, 4]))
        for key in (1, 2, 3, 4):
            cluster.nodes[0][0].pop(key)                      # evicted from HBM: in node 0's DRAM only
        running = Request(0.0, 6 * BT, 100, [11, 12, 13, 14, 15, 16])  # decodes for 100 s
        assert router.route(running, cluster, [0.0, 0.0]) == 0  # a tie on cost: the first node
        picks[name] = router.route(Request(1_000.0, 5 * BT, 1, [1, 2, 3, 4, 5]), cluster, [0.0, 0.0])
    assert picks == {"dynamo": 1, "dynamo:4": 0}
    assert make_router("dynamo:4").prefill_load_scale == 4.0 and make_router("dynamo:4").name == "dynamo:4"
