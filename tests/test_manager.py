import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.manager import TierManager, build_manager
from kvtier.tiers import DiskTier, HostTier

K = [bytes([i]) * 16 for i in range(8)]


def _block(seed: int) -> bytes:
    return get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(seed)))


SIZE = len(_block(0))


def _stack(tmp_path, dram_blocks=4):
    return TierManager([HostTier(dram_blocks * SIZE, SIZE), DiskTier(tmp_path, 100 * SIZE)])


def test_longest_prefix_across_tiers(tmp_path):
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    dram.put_many([(K[0], _block(0)), (K[1], _block(1))])
    ssd.put_many([(K[2], _block(2)), (K[4], _block(4))])
    assert m.lookup(K[:5]) == ["dram", "dram", "ssd"]
    assert m.get_prefix(K[:5]) == [_block(0), _block(1), _block(2)]
    assert dram.contains_many([K[2]]) == [True]  # promoted
    m.close()


def test_write_through_and_demotion(tmp_path):
    m = _stack(tmp_path, dram_blocks=2)
    m.put_many([(K[0], _block(0)), (K[1], _block(1)), (K[2], _block(2))])
    m.flush()
    dram, ssd = m.tiers
    assert dram.contains_many(K[:3]) == [False, True, True]
    assert ssd.contains_many(K[:3]) == [True, True, True]
    assert m.get_prefix(K[:3]) == [_block(0), _block(1), _block(2)]
    m.close()


def test_corrupt_block_is_counted_deleted_and_ends_the_prefix(tmp_path):
    m = _stack(tmp_path)
    ssd = m.tiers[1]
    ssd.put_many([(K[0], _block(0)), (K[1], _block(1)), (K[2], _block(2))])
    path = ssd._path(K[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    assert m.get_prefix(K[:3]) == [_block(0)]
    assert ssd.stats.corrupt == 1 and ssd.contains_many([K[1]]) == [False]
    m.close()


def test_namespaces_never_share_blocks(tmp_path):
    layout = KVLayout(1, 1, 4, "float32", 4)
    a, b = KeySpace("m", layout, namespace="a"), KeySpace("m", layout, namespace="b")
    m = build_manager(["dram:1MiB"], slot_bytes=SIZE)
    tokens = list(range(12))
    m.put_many([(k, _block(i)) for i, k in enumerate(block_keys(a, tokens))])
    assert m.lookup(block_keys(b, tokens)) == []
    assert m.lookup(block_keys(a, tokens)) == ["dram"] * 3
    m.close()


def test_full_write_queue_drops_instead_of_blocking(tmp_path):
    m = TierManager([HostTier(8 * SIZE, SIZE), DiskTier(tmp_path, 100 * SIZE)], max_pending_writes=1)
    ssd_lock = m._locks[id(m.tiers[1])]
    ssd_lock.acquire()  # the writer cannot make progress while we hold the SSD tier's lock
    try:
        for i in range(4):
            m._enqueue([(K[i], _block(i))])
        m.tiers[0].put_many([(K[7], _block(7))])
        assert m.get_prefix([K[7]]) == [_block(7)]  # a DRAM hit does not wait for the stuck SSD writer
    finally:
        ssd_lock.release()
    m.flush()
    assert m.num_dropped_writes >= 2
    m.close()
