"""`HostBlockPool`: the engine's one owner of host slots, room and pins for offloaded requests."""

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.offload.pool import HostBlockPool, HostRoomError
from kvtier.tiers import HostTier
from kvtier.tiers.manager import TierManager

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4)
KEYS = block_keys(KeySpace("fp", LAYOUT, "raw"), list(range(16)))  # 4 blocks
CODEC = get_codec("raw")
BLOCKS = [torch.full(LAYOUT.block_shape, float(i)) for i in range(4)]
SLOT = CODEC.max_encoded_bytes(LAYOUT)


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
    dram = pool.manager.host_tier()
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
    pool.unpin(KEYS)
    pool.unpin([])
    assert dram.num_leased() == 0


def test_a_pool_needs_a_dram_tier(tmp_path):
    from kvtier.tiers import DiskTier

    manager = TierManager([DiskTier(tmp_path, 4 * SLOT)], async_writes=False)
    with pytest.raises(ValueError, match="DRAM tier"):
        HostBlockPool(manager, LAYOUT.block_bytes)
    manager.close()
