"""Block bookkeeping without tensors: exact ids, sharing, eviction order."""

import pytest

from kvtier.engine.block_manager import BlockManager

K = [bytes([i]) * 16 for i in range(10)]


def test_allocate_in_order_then_none():
    bm = BlockManager(3)
    assert [bm.allocate() for _ in range(3)] == [(0, None), (1, None), (2, None)]
    assert bm.allocate() is None
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 3


def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(4)
    ids = [bm.allocate()[0] for _ in range(2)]
    bm.register(ids[0], K[0])
    bm.register(ids[1], K[1])
    assert bm.match_prefix([K[0], K[1], K[2]]) == [0, 1]
    for b in (0, 1):
        bm.acquire(b)
    assert bm.ref_counts == [2, 2, 0, 0]
    bm.release(ids)
    assert bm.ref_counts == [1, 1, 0, 0] and bm.num_free_blocks == 2


def test_cached_free_blocks_are_evicted_last_and_tail_first():
    bm = BlockManager(4)
    ids = [bm.allocate()[0] for _ in range(3)]
    for b, key in zip(ids, K):
        bm.register(b, key)
    bm.release(ids)  # reversed: block 2 (the tail) becomes least recently used
    assert bm.num_free_blocks == 4 and len(bm.cached_free) == 3
    assert bm.allocate() == (3, None)           # plain free blocks go first
    assert bm.allocate() == (2, (K[2], 2))      # then the cached tail, handed back for the tiers
    assert bm.allocate() == (1, (K[1], 1))
    assert bm.match_prefix([K[0], K[1]]) == [0]  # evicted keys are gone; the head is still cached
    bm.acquire(0)                                # a hit revives a cached-free block
    assert bm.allocate() is None


def test_duplicate_key_keeps_the_first_block():
    bm = BlockManager(2)
    a, b = bm.allocate()[0], bm.allocate()[0]
    assert bm.register(a, K[0]) and not bm.register(b, K[0])
    bm.release([b])
    assert list(bm.free_block_ids) == [1] and bm.match_prefix([K[0]]) == [0]


def test_double_free_is_caught():
    bm = BlockManager(1)
    b = bm.allocate()[0]
    bm.release([b])
    with pytest.raises(AssertionError):
        bm.release([b])


def test_a_watcher_sees_registrations_with_their_origin_and_evictions_in_order():
    from kvtier.engine.block_manager import BlockEvent, BlockOrigin

    bm = BlockManager(2)
    log = bm.watch(max_events=3)
    ids = [bm.allocate()[0] for _ in range(2)]
    origins = [BlockOrigin(None, (1, 2), "tenant"), BlockOrigin(K[0], (3, 4), "tenant")]
    for b, key, origin in zip(ids, K, origins):
        assert bm.register(b, key, origin)
    assert bm.register(ids[0], K[0], origins[0])  # the same name again: nothing new
    bm.release(ids)
    assert log.take() == [BlockEvent(True, K[0], origins[0]), BlockEvent(True, K[1], origins[1])]
    bm.allocate(), bm.allocate()  # both evicted, the tail first
    assert log.take() == [BlockEvent(False, K[1]), BlockEvent(False, K[0])]
    assert log.take() == [] and log.num_dropped == 0
    assert bm.register(0, K[2]) and log.take() == [BlockEvent(True, K[2])]  # no origin given: still a registration
    for i in range(5):  # a watcher that falls behind loses the oldest, counted
        log.append(BlockEvent(False, K[i]))
    assert [e.key for e in log.take()] == K[2:5] and log.num_dropped == 2
