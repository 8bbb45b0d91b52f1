"""Tensor parallel KV events (no vLLM): `ShardedBlocks` turns the ranks' shard events into whole blocks."""

from kvtier.events.tracker import BlockInfo, KvEventTracker, Removed, Stored
from kvtier.integrations.vllm.tp_events import ShardedBlocks
from kvtier.integrations.vllm.trackers import shard_keys
from kvtier.tiers.events import TierEvent

K = [bytes([i]) * 16 for i in range(6)]
INFO = [BlockInfo(block_hash=100 + i, parent_hash=100 + i - 1 if i else None, token_ids=tuple(range(4 * i, 4 * i + 4)))
        for i in range(6)]


def _tracker(n: int = 3) -> KvEventTracker:
    tracker = KvEventTracker()
    tracker.describe(K[:n], INFO[:n])
    return tracker


def test_tensor_parallel_shards_make_a_block_stored_when_every_rank_has_it_and_removed_at_the_first_gone():
    shards = ShardedBlocks(world_size=2)
    shards.learn(K[:3])
    rank0, rank1 = shard_keys(K[:3], 0, 2), shard_keys(K[:3], 1, 2)
    tracker = _tracker()
    tracker.apply(shards.combine([TierEvent("ssd", True, tuple(rank0)), TierEvent("ssd", True, (rank1[0],))]))
    assert tracker.take() == [Stored(INFO[0], "STORAGE")]  # K[1], K[2]: rank 1's shard not in yet
    tracker.apply(shards.combine([TierEvent("ssd", True, (rank1[1], rank1[0]))]))  # a shard again: no news
    assert tracker.take() == [Stored(INFO[1], "STORAGE")]
    tracker.apply(shards.combine([TierEvent("ssd", False, (rank0[2], rank1[1]))]))  # K[2] never whole
    assert tracker.take() == [Removed((101,), "STORAGE")]
    tracker.apply(shards.combine([TierEvent("ssd", False, (rank0[1],)), TierEvent("dram", True, (K[4],))]))
    assert tracker.take() == [] and shards.num_unknown == 1  # K[1] already withdrawn; K[4] is not a shard key


def test_tensor_parallel_blocks_found_whole_at_lookup_are_withdrawn_at_their_first_missing_shard():
    shards = ShardedBlocks(world_size=4, max_blocks=2)
    shards.learn(K[:2])
    shards.found(K[:2], ["shm", "ssd"])
    tracker = _tracker(2)
    tracker.found(K[:2], ["shm", "ssd"])
    tracker.take()
    assert shards.combine([TierEvent("ssd", False, (shard_keys(K[1:2], 3, 4)[0],))]) == \
        [TierEvent("ssd", False, (K[1],))]
    shards.learn([K[2]])  # past max_blocks: K[0] forgotten, its shards unknown from now on
    assert shards.combine([TierEvent("shm", False, (shard_keys(K[:1], 0, 4)[0],))]) == []
