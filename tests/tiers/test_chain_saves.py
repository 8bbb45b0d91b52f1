"""A save carries only a turn's new blocks; the tiers refresh the whole chain it extends with them
(`TierManager.put_many(chains=...)`, `writeback.put_chained`), tail first, so the new blocks never outrank
the root they extend and a full tier evicts chains from their tails (`kvtier.lru`).

Request A's turn 1 (4 blocks) is saved, then request B (4), then A's turn 2 (its 2 new blocks only), then C:
A's whole chain must still be a prefix of what the tier holds. Without the chain refresh the tier holds A's
turn 1 as older than B and loses A's root first: turn 2's blocks stranded (a prefix lookup stops at the
first miss)."""

from __future__ import annotations

import pytest

from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.manager import TierManager

BLOCK_BYTES = 256
A = [b"a%015d" % i for i in range(6)]  # A's turn 1 is A[:4], turn 2 adds A[4:]
B = [b"b%015d" % i for i in range(4)]
C = [b"c%015d" % i for i in range(4)]


def _items(keys: list[bytes]) -> list[tuple[bytes, bytes]]:
    return [(key, key * (BLOCK_BYTES // len(key))) for key in keys]


def _stack(kind: str, num_blocks: int, tmp_path) -> TierManager:
    """`num_blocks` of room in the tier that evicts: DRAM, an SSD, or an SSD under a DRAM that keeps all."""
    if kind == "dram":
        tiers = [HostTier(num_blocks * BLOCK_BYTES, BLOCK_BYTES)]
    elif kind == "ssd":
        tiers = [DiskTier(tmp_path / "ssd", num_blocks * BLOCK_BYTES)]
    else:  # the chain refreshed below by the write-through
        tiers = [HostTier(64 * BLOCK_BYTES, BLOCK_BYTES), DiskTier(tmp_path / "ssd", num_blocks * BLOCK_BYTES)]
    return TierManager(tiers, async_writes=False)


def _held(manager: TierManager, keys: list[bytes]) -> list[bool]:
    return manager.tiers[-1].contains_many(keys)  # the tier that evicts


KINDS = ["dram", "ssd", "dram+ssd"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_s_save_refreshes_the_chain_it_extends_so_later_requests_take_others_first(kind, tmp_path):
    manager = _stack(kind, 10, tmp_path)
    try:
        manager.put_many(_items(A[:4]), chains=[A[:4]])
        manager.put_many(_items(B), chains=[B])
        evicting = manager.tiers[-1]
        puts = evicting.stats.puts
        manager.put_many(_items(A[4:]), chains=[A])  # turn 2: only its new blocks, and the chain they extend
        assert evicting.stats.puts == puts + 2  # the chain's held blocks are refreshed, not written again
        manager.put_many(_items(C), chains=[C])  # 14 blocks into 10: B, the least recent, makes the room
        assert _held(manager, A) == [True] * 6
        assert _held(manager, B) == [False] * 4 and _held(manager, C) == [True] * 4
        assert manager.match(A).keys == A  # turn 2's whole chain, root first
    finally:
        manager.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_s_save_into_a_full_tier_evicts_other_requests_not_its_own_root(kind, tmp_path):
    manager = _stack(kind, 8, tmp_path)
    try:
        manager.put_many(_items(A[:4]), chains=[A[:4]])
        manager.put_many(_items(B), chains=[B])  # full
        manager.put_many(_items(A[4:]), chains=[A])  # room from B's tail, never from the chain it extends
        assert _held(manager, A) == [True] * 6 and _held(manager, B) == [True, True, False, False]
        assert manager.match(A).keys == A
    finally:
        manager.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_whose_new_blocks_are_held_already_still_refreshes_its_chain(kind, tmp_path):
    manager = _stack(kind, 10, tmp_path)
    try:
        manager.put_many(_items(A), chains=[A])
        manager.put_many(_items(B), chains=[B])
        manager.put_many([], chains=[A])  # `BlockMover.save(skip_held=True)` found every new block held
        manager.put_many(_items(C), chains=[C])
        assert _held(manager, A) == [True] * 6 and _held(manager, B) == [False] * 4
    finally:
        manager.close()
