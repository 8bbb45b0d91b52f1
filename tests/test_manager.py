import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.manager import TierManager, build_manager
from kvtier.tiers import DiskTier, HostTier

K = [bytes([i]) * 16 for i in range(8)]


def _block(seed: int, key: bytes | None = None) -> bytes:
    """Block `seed`, bound to K[seed] unless another key is given."""
    return get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(seed)), K[seed] if key is None else key)


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


def test_a_block_under_another_key_is_foreign_and_every_bad_block_of_the_run_goes_at_once(tmp_path):
    """Two SSD files swapped, one block's file copied over another's, a torn one: all intact files,
    none the block its key names. One lookup finds them all: every bad block is deleted and counted
    as corrupt (not as a hit), the prefix ends before the first, and the next store rewrites them."""
    m = _stack(tmp_path)
    ssd = m.tiers[1]
    ssd.put_many([(K[i], _block(i)) for i in range(6)])
    p = [ssd._path(k) for k in K[:6]]
    b1, b2 = p[1].read_bytes(), p[2].read_bytes()
    p[1].write_bytes(b2), p[2].write_bytes(b1)         # swapped
    p[4].write_bytes(p[0].read_bytes())                 # block 0's file copied over block 4's
    torn = bytearray(p[5].read_bytes())
    torn[100] ^= 1
    p[5].write_bytes(bytes(torn))
    assert m.get_prefix(K[:6]) == [_block(0)]
    assert ssd.stats.corrupt == 4 and ssd.stats.hits == 2  # blocks 0 and 3 verified; 1, 2, 4, 5 bad
    assert ssd.contains_many(K[:6]) == [True, False, False, True, False, False]
    m.put_many([(K[i], _block(i)) for i in range(6)])   # recomputed blocks go down again
    m.flush()
    assert ssd.contains_many(K[:6]) == [True] * 6
    for i in range(6):
        m.tiers[0].delete(K[i])
    assert m.get_prefix(K[:6]) == [_block(i) for i in range(6)]
    m.close()


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_a_substituted_block_is_refused_in_every_tier(tmp_path, tier):
    m = _stack(tmp_path)
    target = m.tiers[0 if tier == "dram" else 1]
    target.put_many([(K[0], _block(0)), (K[1], _block(1, K[0]))])  # K[1] holds a copy of block 0
    assert m.get_prefix(K[:2]) == [_block(0)]
    assert target.stats.corrupt == 1 and target.contains_many(K[:2]) == [True, False]
    m.close()


def test_match_then_read_asks_each_tier_once(tmp_path):
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    dram.put_many([(K[0], _block(0))])
    ssd.put_many([(K[1], _block(1)), (K[2], _block(2))])
    calls = {"dram": 0, "ssd": 0}
    for t in (dram, ssd):
        orig = t.contains_many
        t.contains_many = lambda keys, t=t, orig=orig: (calls.__setitem__(t.name, calls[t.name] + 1), orig(keys))[1]
    match = m.match(K[:4])
    assert match.tiers == ["dram", "ssd", "ssd"] and len(match) == 3
    prefix = m.read(match)
    assert prefix.payloads == [_block(0), _block(1), _block(2)] and prefix.tiers == ["dram", "ssd", "ssd"]
    assert [h.num_tokens for h in prefix.headers] == [4, 4, 4]
    assert calls == {"dram": 1, "ssd": 1}
    m.close()


def test_namespaces_never_share_blocks(tmp_path):
    layout = KVLayout(1, 1, 4, "float32", 4)
    a, b = KeySpace("m", layout, namespace="a"), KeySpace("m", layout, namespace="b")
    m = build_manager(["dram:1MiB"], slot_bytes=SIZE)
    tokens = list(range(12))
    m.put_many([(k, _block(i, k)) for i, k in enumerate(block_keys(a, tokens))])
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
