import errno
import os

import pytest
import torch

from kvtier.codecs import get_codec
from kvtier.tiers import DiskTier, HostTier, make_tier
from kvtier.errors import UserError

K = [bytes([i]) * 16 for i in range(8)]


def _block(seed: int) -> bytes:
    return get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(seed)), bytes(16))


SIZE = len(_block(0))


def test_host_lru_eviction_order_and_stats():
    tier = HostTier(capacity_bytes=3 * SIZE, slot_bytes=SIZE)
    assert tier.put_many([(K[0], _block(0)), (K[1], _block(1)), (K[2], _block(2))]) == []
    assert tier.get_many([K[0], K[5]]) == [_block(0), None]
    evicted = tier.put_many([(K[3], _block(3))])
    assert evicted == [(K[1], _block(1))]  # K[0] was touched by the get
    assert tier.contains_many(K[:4]) == [True, False, True, True]
    s = tier.stats
    assert (s.hits, s.misses, s.puts, s.evictions, s.bytes_read) == (1, 1, 4, 1, SIZE)


def test_host_slots_are_reused_without_leak():
    tier = HostTier(capacity_bytes=2 * SIZE, slot_bytes=SIZE)
    for i in range(200):
        tier.put_many([(i.to_bytes(16, "little"), _block(i % 7))])
    assert tier.num_free_slots() == 0 and tier.used_bytes() == 2 * SIZE
    assert tier.get_many([(199).to_bytes(16, "little")]) == [_block(199 % 7)]
    assert tier.delete((199).to_bytes(16, "little")) and tier.num_free_slots() == 1


def test_host_rejects_block_bigger_than_slot():
    tier = HostTier(capacity_bytes=4 * SIZE, slot_bytes=SIZE - 1)
    with pytest.raises(ValueError, match="exceeds"):
        tier.put_many([(K[0], _block(0))])


def test_disk_index_survives_restart_in_lru_order(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=3 * SIZE)
    for i in range(3):
        tier.put_many([(K[i], _block(i))])
        os.utime(tier._path(K[i]), ns=(10**18 + i, 10**18 + i))
    reopened = DiskTier(tmp_path, capacity_bytes=3 * SIZE)
    assert reopened.get_many([K[2]]) == [_block(2)]
    reopened.put_many([(K[3], _block(3))])  # evicts the least recent: K[0]
    assert reopened.contains_many(K[:4]) == [False, True, True, True]
    assert not reopened._path(K[0]).exists()


def test_disk_leftover_temp_file_is_ignored_and_cleaned(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[0], _block(0))])
    torn = tier._path(K[1]).with_name(tier._path(K[1]).name + ".tmp")
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(_block(1)[:10])  # a crash between write and rename
    reopened = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    assert reopened.contains_many([K[0], K[1]]) == [True, False] and not torn.exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_turns_writes_off(tmp_path, monkeypatch, caplog, code):
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[0], _block(0))])

    def fail(path, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(DiskTier, "_write", staticmethod(fail))
    tier.put_many([(K[1], _block(1)), (K[2], _block(2))])
    assert not tier.healthy and tier.stats.errors == 1
    assert tier.contains_many([K[0], K[1], K[2]]) == [True, False, False]
    assert tier.get_many([K[0]]) == [_block(0)]  # reads keep working
    assert sum("no more writes" in r.message for r in caplog.records) == 1
    assert not tier.reconnect()  # the probe write fails too
    monkeypatch.undo()
    assert tier.reconnect() and tier.healthy  # the disk has room again: puts resume
    tier.put_many([(K[1], _block(1))])
    assert tier.get_many([K[1]]) == [_block(1)]


def test_tier_specs():
    assert isinstance(make_tier("dram:1MiB", slot_bytes=SIZE), HostTier)
    with pytest.raises(UserError):
        make_tier("tape:1GiB", slot_bytes=SIZE)
    with pytest.raises(UserError):
        make_tier("ssd:1GiB", slot_bytes=SIZE)


def test_disk_batched_read_keeps_order_and_survives_a_vanished_file(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[i], _block(i)) for i in range(6)])
    tier._path(K[2]).unlink()  # removed behind the tier's back (an operator, another process)
    assert tier.get_many([K[0], K[1], K[2], K[3], K[7], K[5]]) == [_block(0), _block(1), None, _block(3), None, _block(5)]
    assert tier.stats.errors == 1 and tier.contains_many([K[2]]) == [False]
