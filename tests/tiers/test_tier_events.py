"""`TierManager.watch()`: each tier announces what lands in it and what leaves it (evicted, deleted as bad,
lost by a pool) — the feed of the vLLM connector's KV events."""

import torch

from kvtier.codecs import get_codec
from kvtier.tiers import DiskTier, HostTier
from kvtier.tiers.events import TierEvent
from kvtier.tiers.manager import TierManager
from kvtier.tiers.pool import PoolTier

K = [bytes([i]) * 16 for i in range(8)]


def _block(i: int) -> bytes:
    return get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(i)), K[i])


SIZE = len(_block(0))


def _stack(tmp_path, *, dram_blocks: int, ssd_blocks: int) -> TierManager:
    return TierManager([HostTier(dram_blocks * SIZE, SIZE), DiskTier(tmp_path, ssd_blocks * SIZE)], async_writes=False)


def test_writes_evictions_and_write_through_are_announced_in_order(tmp_path):
    manager = _stack(tmp_path, dram_blocks=2, ssd_blocks=3)
    log = manager.watch()
    manager.put_many([(K[0], _block(0)), (K[1], _block(1))])
    assert log.take() == [TierEvent("dram", True, (K[0],)), TierEvent("dram", True, (K[1],)),
                          TierEvent("ssd", True, (K[0],)), TierEvent("ssd", True, (K[1],))]
    manager.put_many([(K[2], _block(2)), (K[3], _block(3))])
    # stored in prompt order (a parent before its children); the chain K0, K1 evicted from its tail
    assert log.take() == [TierEvent("dram", False, (K[1],)), TierEvent("dram", True, (K[2],)),
                          TierEvent("dram", False, (K[0],)), TierEvent("dram", True, (K[3],)),
                          TierEvent("ssd", True, (K[2],)),
                          TierEvent("ssd", False, (K[1],)), TierEvent("ssd", True, (K[3],))]
    assert log.take() == []
    assert manager.watch() is log  # one log per stack


def test_a_block_already_held_is_not_announced_again(tmp_path):
    manager = _stack(tmp_path, dram_blocks=2, ssd_blocks=2)
    log = manager.watch()
    manager.put_many([(K[0], _block(0))])
    log.take()
    manager.put_many([(K[0], _block(0))])
    assert log.take() == []


def test_a_corrupt_block_is_announced_removed_from_its_tier(tmp_path):
    manager = TierManager([DiskTier(tmp_path, 4 * SIZE)], async_writes=False)
    log = manager.watch()
    manager.put_many([(K[0], _block(0)), (K[1], _block(1))])
    path = tmp_path / K[1].hex()[:2] / f"{K[1].hex()}.kvb"
    path.write_bytes(_block(2))  # another block's bytes under K[1]'s name
    log.take()
    assert len(manager.get_prefix(K[:2])) == 1
    assert log.take() == [TierEvent("ssd", False, (K[1],))]


def test_a_file_gone_behind_the_tiers_back_is_announced_at_its_read(tmp_path):
    manager = TierManager([DiskTier(tmp_path, 4 * SIZE)], async_writes=False)
    log = manager.watch()
    manager.put_many([(K[0], _block(0))])
    log.take()
    (tmp_path / K[0].hex()[:2] / f"{K[0].hex()}.kvb").unlink()
    assert manager.tiers[0].get_many([K[0]]) == [None]
    assert log.take() == [TierEvent("ssd", False, (K[0],))]


class _DictBackend:
    """A pool service in a dict: evicts when told to."""

    def __init__(self) -> None:
        self.blocks: dict[str, bytes] = {}

    def connect(self) -> None: ...
    def exists(self, names): return [n in self.blocks for n in names]
    def get(self, names): return [self.blocks.get(n) for n in names]
    def lease(self, names): return [None if n not in self.blocks else (self.blocks[n], None) for n in names]
    def release(self, buffers) -> None: ...
    def put(self, items): self.blocks.update(items)
    def remove(self, name): return self.blocks.pop(name, None) is not None
    def used_bytes(self): return None
    def close(self) -> None: ...


def test_a_pool_announces_its_writes_and_a_block_it_lost_at_the_next_miss():
    backend = _DictBackend()
    pool = PoolTier("redis", backend)
    manager = TierManager([pool], async_writes=False)
    log = manager.watch()
    manager.put_many([(K[0], _block(0)), (K[1], _block(1))])
    assert log.take() == [TierEvent("redis", True, (K[0], K[1]))]
    backend.blocks.clear()  # the service evicted them, telling nobody
    assert manager.lookup(K[:2]) == []
    assert log.take() == [TierEvent("redis", False, (K[0], K[1]))]


def test_an_unwatched_stack_announces_nothing(tmp_path):
    manager = _stack(tmp_path, dram_blocks=1, ssd_blocks=1)
    manager.put_many([(K[0], _block(0)), (K[1], _block(1))])
    assert all(tier.events is None for tier in manager.tiers)
