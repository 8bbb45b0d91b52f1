"""`HostBlockPool`: the engine's one owner of host slots, room and pins for offloaded requests."""

import pytest
import torch

from kvtier.blocks import KeySpace, block_keys
from kvtier.offload.pool import HostBlockPool, HostRoomError
from kvtier.tiers import DiskTier, HostTier
from kvtier.tiers.manager import TierManager
from support.blocks import BLOCKS, CODEC, KEYS, LAYOUT, SLOT


@pytest.fixture
def pool():
    dram = HostTier(4 * SLOT, SLOT)
    manager = TierManager([dram], async_writes=False)
    yield HostBlockPool(manager, LAYOUT.block_bytes)
    manager.close()


def test_room_is_set_aside_per_request_and_given_back(pool):
    with pytest.raises(HostRoomError) as never:
        pool.check_room(5)  # more than the DRAM tier holds at all: never (a 400)
    assert never.value.ever is False and "holds 4 blocks in all" in str(never.value)
    pool.reserve("a", 3)
    with pytest.raises(HostRoomError) as not_now:
        pool.reserve("b", 2)  # 1 of 4 free now: later (a 429)
    assert not_now.value.ever is True and "1 of its 4 blocks are free now" in str(not_now.value)
    pool.reserve("b", 1)
    assert pool.num_reserved == 4
    pool.release("a")
    pool.release("never-admitted")  # nothing to give back
    assert pool.num_reserved == 1
    pool.release("b")
    assert pool.num_reserved == 0


def test_an_ended_requests_room_waits_for_its_load(pool):
    pool.reserve("a", 2)
    pool.release("a", load_in_flight=True)  # its load may still pin slots
    assert pool.num_reserved == 2
    pool.load_returned("b")  # another request's load: nothing of a's
    assert pool.num_reserved == 2
    pool.load_returned("a")
    assert pool.num_reserved == 0


def test_pins_hold_slots_in_place_or_stored_and_unpin_leaks_none(pool):
    dram = pool.manager.tiers[0]
    encoded = []

    def encode(i):
        return lambda: encoded.append(i) or CODEC.encode(BLOCKS[i], KEYS[i])

    slots = [pool.pin(KEYS[i], encode(i)) for i in range(2)]
    assert encoded == [0, 1] and dram.num_leased() == 2
    payloads = pool.payloads(torch.float32, LAYOUT.block_shape)
    assert all(torch.equal(payloads[slot], BLOCKS[i]) for i, slot in enumerate(slots))
    pool.unpin(KEYS[:2])
    assert dram.num_leased() == 0
    assert pool.pin(KEYS[0], encode(0)) == slots[0] and encoded == [0, 1]  # DRAM holds it: pinned where it is
    for i in (1, 2, 3):
        pool.pin(KEYS[i], encode(i))
    other = block_keys(KeySpace("other", LAYOUT, "raw"), list(range(4)))[0]
    with pytest.raises(RuntimeError, match="could not hold"):  # every slot pinned
        pool.pin(other, lambda: CODEC.encode(BLOCKS[0], other))
    assert pool.num_pinned == 4
    pool.unpin(KEYS)
    pool.unpin([])
    assert dram.num_leased() == 0 and pool.num_pinned == 0


def test_a_pool_needs_a_dram_tier(tmp_path):
    manager = TierManager([DiskTier(tmp_path, 4 * SLOT)], async_writes=False)
    with pytest.raises(ValueError, match="DRAM tier"):
        HostBlockPool(manager, LAYOUT.block_bytes)
    manager.close()


def test_a_pinned_block_outlives_the_dram_tiers_lru(pool):
    """While an offloaded request reads a block in place, prefix caching's puts (the save queue, promotions)
    never evict it nor reuse its slot: they evict the unpinned blocks, or are dropped when none is left."""
    dram = pool.manager.tiers[0]
    slot = pool.pin(KEYS[0], lambda: CODEC.encode(BLOCKS[0], KEYS[0]))
    others = block_keys(KeySpace("other", LAYOUT, "raw"), list(range(24)))  # 6 blocks of another prompt
    pool.manager.put_many([(key, CODEC.encode(BLOCKS[3], key)) for key in others[:3]])  # the 3 free slots
    pool.manager.put_many([(key, CODEC.encode(BLOCKS[3], key)) for key in others[3:]])  # 3 more: evict unpinned ones
    assert dram.contains_many(KEYS[:1]) == [True] and dram.stats.evictions == 3
    assert dram.contains_many(others) == [False] * 3 + [True] * 3
    assert torch.equal(pool.payloads(torch.float32, LAYOUT.block_shape)[slot], BLOCKS[0])
    pool.unpin(KEYS[:1])
    pool.manager.put_many([(key, CODEC.encode(BLOCKS[3], key)) for key in others[:4]])
    assert dram.contains_many(KEYS[:1]) == [False]  # let go: an LRU block like any other


def test_pin_match_holds_dram_blocks_in_place_and_stores_verified_ones_from_below(tmp_path):
    """A cached prefix's host blocks: DRAM blocks pinned where they are; SSD blocks (payload proven)
    stored into slots, marked placed below (their eviction copies nothing out), pinned; a bad one ends it."""
    stack = TierManager([HostTier(8 * SLOT, SLOT), DiskTier(tmp_path, 64 * SLOT)], async_writes=False)
    stack.put_many([(key, CODEC.encode(block, key)) for key, block in zip(KEYS, BLOCKS)])  # written through
    pool = HostBlockPool(stack, LAYOUT.block_bytes)
    dram, ssd = stack.tiers
    in_place = {key: dram._key_to_slot[key] for key in KEYS[:2]}
    for key in KEYS[2:]:
        dram.delete(key)
    with open(ssd._path(KEYS[3]), "r+b") as f:  # block 3's payload, flipped on the SSD
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    pinned = pool.pin_match(stack.match(KEYS, pin=True))
    assert pinned.tiers == ["dram", "dram", "ssd"] and pinned.keys == KEYS[:3]
    assert pinned.slots[:2] == [in_place[KEYS[0]], in_place[KEYS[1]]]
    assert dram.num_leased() == 3 == pool.num_pinned and len(dram._pins) == 0 and len(ssd._pins) == 0
    payloads = pool.payloads(torch.float32, LAYOUT.block_shape)
    assert all(torch.equal(payloads[slot], BLOCKS[i]) for i, slot in enumerate(pinned.slots))
    assert dram._below[pinned.slots[2]]
    assert ssd.stats.corrupt == 1 and not ssd.contains_many([KEYS[3]])[0]  # deleted, never served
    pool.unpin(pinned.keys)
    assert dram.num_leased() == 0 == pool.num_pinned
    stack.close()


def test_pin_match_stops_where_dram_has_no_slot_left(tmp_path):
    """Every DRAM slot but one held by other sequences: one block is held, the stream ends there, and the
    lookup's pins and the SSD's read buffers are all given back."""
    dram, ssd = HostTier(4 * SLOT, SLOT), DiskTier(tmp_path, 64 * SLOT)
    manager = TierManager([dram, ssd], async_writes=False)
    pool = HostBlockPool(manager, LAYOUT.block_bytes)
    ssd.put_many([(key, CODEC.encode(block, key)) for key, block in zip(KEYS, BLOCKS)])
    others = block_keys(KeySpace("other", LAYOUT, "raw"), list(range(12)))  # 3 blocks of another prompt
    for key in others:
        pool.pin(key, lambda key=key: CODEC.encode(BLOCKS[0], key))
    pinned = pool.pin_match(manager.match(KEYS, pin=True))
    assert pinned.keys == KEYS[:1] and pinned.tiers == ["ssd"]
    assert len(ssd._pins) == 0 and ssd.num_leased() == 0 and len(dram._pins) == 0
    assert dram.num_leased() == 4 == pool.num_pinned  # the three others and the one held
    pool.unpin(pinned.keys + others)
    assert dram.num_leased() == 0 == pool.num_pinned
    manager.close()


def test_unpinning_what_the_pool_never_pinned_is_a_bug(pool):
    with pytest.raises(AssertionError, match="unpinned more often than pinned"):
        pool.unpin(KEYS[:1])
