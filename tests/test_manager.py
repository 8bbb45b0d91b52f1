import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.tiers.manager import TierManager, build_manager, release
from kvtier.tiers import Backoff, DiskTier, HostTier
from kvtier.tiers.pool import KEY_PREFIX, PoolTier

FAST = Backoff(start_s=0.02, max_s=0.16, stable_s=60.0)  # probes come quickly in tests

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
    m.flush()
    assert dram.contains_many([K[2]]) == [True]  # promoted
    m.close()


def test_write_through_and_demotion(tmp_path):
    m = _stack(tmp_path, dram_blocks=2)
    m.put_many([(K[0], _block(0)), (K[1], _block(1))])
    m.put_many([(K[2], _block(2))])  # evicts K[1]: the chain K0, K1 was refreshed tail first
    m.flush()
    dram, ssd = m.tiers
    assert dram.contains_many(K[:3]) == [True, False, True]
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


def test_a_leased_read_gives_dram_views_and_releases_the_bad_ones_at_once(tmp_path):
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    dram.put_many([(K[0], _block(0)), (K[1], _block(1)), (K[2], _block(2, K[0]))])  # K[2]: a foreign block
    prefix = m.read(m.match(K[:3]), lease=True)
    assert [bytes(p) for p in prefix.payloads] == [_block(0), _block(1)]
    assert all(isinstance(p, memoryview) for p in prefix.payloads)
    assert dram.num_leased() == 2 and dram.stats.corrupt == 1  # the foreign block's lease already ended
    prefix.release()
    prefix.release()  # idempotent
    assert dram.num_leased() == 0 and dram._consistent()
    assert m.get_prefix(K[:2]) == [_block(0), _block(1)]  # the plain read copies: nothing stays leased
    assert dram.num_leased() == 0
    m.close()


def test_a_stream_verifies_each_block_as_it_is_pulled_and_settles_at_the_end(tmp_path):
    """`stream` gives the same verified prefix as `read`, one leased block at a time: a block is
    checked only when pulled (so its copy reads it from cache); the bad blocks past the prefix are
    dropped, the lower tiers' blocks promoted and every lease ended when the iteration ends."""
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    dram.put_many([(K[0], _block(0)), (K[1], _block(1))])
    ssd.put_many([(K[2], _block(2)), (K[3], _block(3, K[1])), (K[4], _block(4, K[0]))])  # K[3], K[4]: foreign
    match = m.match(K[:5])
    assert match.tiers == ["dram", "dram", "ssd", "ssd", "ssd"]
    checked: list[bytes] = []
    import kvtier.tiers.manager as manager_module
    verify = manager_module.verify
    manager_module.verify = lambda data, key, **kw: (checked.append(key), verify(data, key, **kw))[1]
    try:
        stream = m.stream(match)
        first = next(stream)
        assert checked == [K[0]]  # nothing else verified yet
        assert first.key == K[0] and first.tier == "dram" and bytes(first.payload) == _block(0)
        assert isinstance(first.payload, memoryview) and dram.num_leased() == 2  # DRAM read in place
        rest = [(b.key, bytes(b.payload), b.tier) for b in stream]
    finally:
        manager_module.verify = verify
    assert rest == [(K[1], _block(1), "dram"), (K[2], _block(2), "ssd")]
    assert checked == K[:5]  # the foreign pair was checked once the prefix ended
    assert ssd.stats.corrupt == 2 and ssd.contains_many(K[3:5]) == [False, False]
    m.flush()  # the promotion runs on the writer thread
    assert dram.num_leased() == 0 and ssd.num_leased() == 0 and dram.contains_many([K[2]]) == [True]  # K[2] promoted
    # a consumer that stops early ends every lease, and what it did not take is not promoted
    dram.delete(K[2])
    stream = m.stream(m.match([K[0], K[1], K[2]]))
    assert next(stream).key == K[0]
    stream.close()
    m.flush()
    assert dram.num_leased() == 0 and dram.contains_many([K[2]]) == [False]
    assert dram._consistent()
    m.close()


def test_two_tiers_of_one_kind_get_names_apart(tmp_path):
    """Two SSDs: per-tier stats and hit counts would merge under one name."""
    m = build_manager(["dram:1MiB", f"ssd:{tmp_path / 'a'}:1MiB", f"ssd:{tmp_path / 'b'}:1MiB"], slot_bytes=SIZE)
    assert [t.name for t in m.tiers] == ["dram", "ssd", "ssd2"] and list(m.stats()) == ["dram", "ssd", "ssd2"]
    assert m.tiers[2].health.name == "ssd2"
    m.tiers[2].put_many([(K[0], _block(0))])
    assert m.lookup([K[0]]) == ["ssd2"]
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
    ssd_lock = m._write_locks[id(m.tiers[1])]
    ssd_lock.acquire()  # the writer cannot make progress while we hold the SSD tier's lock
    try:
        for i in range(4):
            m._writeback.submit([(K[i], _block(i))], through=True)
        m.tiers[0].put_many([(K[7], _block(7))])
        assert m.get_prefix([K[7]]) == [_block(7)]  # a DRAM hit does not wait for the stuck SSD writer
    finally:
        ssd_lock.release()
    m.flush()
    assert m.num_dropped_writes >= 2
    m.close()


def test_two_managers_write_on_the_process_s_one_writes_thread_and_each_flushes_its_own(tmp_path):
    """Write-through of two managers runs on one thread (the executor's writes lane), in order; each counts the
    blocks it dropped (the executor all of them); one's flush does not wait for the other's stuck write."""
    from kvtier.transfer.executor import TransferExecutor, use_executor

    executor = TransferExecutor(workers=1)
    previous = use_executor(executor)
    try:
        a = TierManager([HostTier(8 * SIZE, SIZE), DiskTier(tmp_path / "a", 100 * SIZE)], max_pending_writes=1)
        b = TierManager([HostTier(8 * SIZE, SIZE), DiskTier(tmp_path / "b", 100 * SIZE)], max_pending_writes=4)
        assert executor.num_threads == 1  # the writes thread, started by the first manager's constructor
        writers: list[tuple[str, int]] = []
        for name, m in (("a", a), ("b", b)):
            put = m.tiers[1].put_many
            m.tiers[1].put_many = lambda its, n=name, put=put: writers.append((n, threading.get_ident())) or put(its)
        b.put_many([(K[0], _block(0))])
        ssd_lock = a._write_locks[id(a.tiers[1])]
        ssd_lock.acquire()  # a's write-through cannot finish while we hold its SSD tier's lock
        try:
            a.put_many([(K[1], _block(1))])
            assert _wait(lambda: a._writeback.num_queued == 0)  # running, held
            a.put_many([(K[2], _block(2))])  # waits for the lane: a's one place
            a.put_many([(K[3], _block(3))])  # dropped
            flushed = threading.Thread(target=b.flush)
            flushed.start()
            flushed.join(10)
            assert not flushed.is_alive() and a.num_pending_writes == 2  # b's write ran; a's are still out
            assert (a.num_dropped_writes, b.num_dropped_writes, executor.num_dropped) == (1, 0, 1)
        finally:
            ssd_lock.release()
        a.flush()
        assert a.tiers[1].contains_many(K[1:4]) == [True, True, False] and b.tiers[1].contains_many(K[:1]) == [True]
        assert [n for n, _ in writers] == ["b", "a", "a"] and len({ident for _, ident in writers}) == 1
        a.close()
        b.close()
    finally:
        use_executor(previous)
        executor.close()


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    """A bounded poll for the background retry thread (not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _num_retry_threads() -> int:
    return sum(t.name == "kvtier-retry" for t in threading.enumerate())


def test_tier_raises_then_recovers_with_one_retry_thread(tmp_path, monkeypatch):
    num_threads = _num_retry_threads()
    m = TierManager([HostTier(4 * SIZE, SIZE), DiskTier(tmp_path, 100 * SIZE)], backoff=FAST)
    dram, ssd = m.tiers
    m.put_many([(K[0], _block(0))])
    m.flush()

    def bug(keys):
        raise RuntimeError("a tier bug")

    monkeypatch.setattr(dram, "contains_many", bug)
    monkeypatch.setattr(dram, "reconnect", lambda: False)  # the bug is still there: probes fail
    assert m.lookup([K[0]]) == ["ssd"]  # dram raised: turned off both ways, the ssd serves
    assert dram.health.state == "down" and dram.stats.errors == 1
    for _ in range(200):
        assert m.lookup([K[0]]) == ["ssd"]
    assert _num_retry_threads() == num_threads + 1
    assert _wait(lambda: dram.health.backoff_s == FAST.max_s)  # probes failed in the background
    monkeypatch.undo()  # fixed: the next probe brings dram back, contents intact
    assert _wait(lambda: dram.health.healthy)
    assert m.lookup([K[0]]) == ["dram"] and dram.health.num_transitions == 2
    m.close()
    assert _num_retry_threads() == num_threads  # close() stops it


def test_oversize_block_does_not_disable_dram(tmp_path):
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    m.put_many([(K[0], _block(0) + b"x"), (K[1], _block(1))])
    m.flush()
    assert dram.health.healthy and dram.stats.errors == 1
    assert dram.contains_many(K[:2]) == [False, True]
    assert ssd.contains_many(K[:2]) == [True, True]  # the SSD has no slots: it takes the block
    m.close()


def test_full_disk_keeps_serving_reads_and_comes_back_only_with_room(tmp_path, monkeypatch):
    m = TierManager([HostTier(SIZE, SIZE), DiskTier(tmp_path, 100 * SIZE)], backoff=FAST)
    dram, ssd = m.tiers
    m.put_many([(K[i], _block(i)) for i in range(3)])
    m.flush()
    real_write = DiskTier._write

    def full(path, data):
        if len(data) > 2:  # the 2-byte probe write still fits, a block does not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    monkeypatch.setattr(DiskTier, "_write", staticmethod(full))
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=0, f_bavail=SIZE // 2, f_frsize=1))
    m.put_many([(K[3], _block(3))])
    m.flush()
    assert ssd.health.state == "read-only" and ssd.contains_many([K[3]]) == [False]
    assert m.lookup(K[:4]) == ["ssd", "ssd", "ssd", "dram"]
    assert m.get_prefix(K[:3]) == [_block(i) for i in range(3)]  # reads go on
    assert _wait(lambda: ssd.health.backoff_s == FAST.max_s)  # the probe refused: not enough room
    assert ssd.health.num_transitions == 1 and not ssd.health.writable  # never flapped back up
    monkeypatch.undo()  # room again
    assert _wait(lambda: ssd.health.healthy)
    m.put_many([(K[4], _block(4))])
    m.flush()
    assert ssd.contains_many([K[4]]) == [True]
    m.close()


class _SlowBackend:
    """An in-memory pool whose put blocks until released: the writer thread sits in it, holding the
    tier's write lock."""

    def __init__(self) -> None:
        self.name_to_data: dict[str, bytes] = {}
        self.in_put = threading.Event()
        self.unblock = threading.Event()

    def connect(self) -> None:
        """Always reachable."""

    def exists(self, names):
        return [n in self.name_to_data for n in names]

    def get(self, names):
        return [self.name_to_data.get(n) for n in names]

    def lease(self, names):
        """Copies, as Redis: nothing to give back."""
        return [None if data is None else (data, None) for data in self.get(names)]

    def release(self, buffers) -> None:
        raise AssertionError("a pool of copies is never asked to give anything back")

    def put(self, items) -> None:
        self.in_put.set()
        assert self.unblock.wait(30)
        self.name_to_data.update(items)

    def remove(self, name) -> bool:
        return self.name_to_data.pop(name, None) is not None

    def used_bytes(self):
        return None

    def close(self) -> None:
        """Nothing to close."""


def test_reads_do_not_wait_behind_a_slow_write():
    backend = _SlowBackend()
    backend.name_to_data[KEY_PREFIX + K[0].hex()] = _block(0)
    m = TierManager([HostTier(4 * SIZE, SIZE), PoolTier("pool", backend)], backoff=FAST)
    try:
        m.put_many([(K[1], _block(1))])  # the writer thread enters the slow put
        assert backend.in_put.wait(10)
        with ThreadPoolExecutor(1) as pool:  # bounded: a read queued behind the put would time out here
            assert pool.submit(m.lookup, K[:2]).result(timeout=10) == ["pool", "dram"]
            assert pool.submit(m.get_prefix, K[:2]).result(timeout=10) == [_block(0), _block(1)]
        assert not backend.unblock.is_set()  # the put was still in flight all along
    finally:
        backend.unblock.set()
    m.flush()
    assert backend.exists([KEY_PREFIX + K[1].hex()]) == [True]
    m.close()


def test_a_stream_reads_the_next_chunk_while_the_caller_copies_this_one(tmp_path):
    """Blocks come STREAM_CHUNK_BLOCKS per batched get; the next chunk is read on the prefetch thread
    while the caller still holds a block of this one (an SSD read overlaps the copies)."""
    from kvtier.tiers.base import STREAM_CHUNK_BLOCKS

    m = _stack(tmp_path, dram_blocks=8)
    ssd = m.tiers[1]
    keys = [bytes([0x40 + i]) * 16 for i in range(STREAM_CHUNK_BLOCKS + 2)]
    blocks = [get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(i)), key) for i, key in enumerate(keys)]
    ssd.put_many(list(zip(keys, blocks)))
    reads: list[tuple[list[bytes], str]] = []
    second_read = threading.Event()
    lease = ssd.lease_many

    def recorded(ks):
        reads.append((list(ks), threading.current_thread().name))
        if len(reads) == 2:
            second_read.set()
        return lease(ks)

    ssd.lease_many = recorded
    stream = m.stream(m.match(keys))
    assert bytes(next(stream).payload) == blocks[0]
    assert second_read.wait(10)  # the caller has not pulled block 1 yet
    assert reads[0] == (keys[:STREAM_CHUNK_BLOCKS], "MainThread")
    assert reads[1][0] == keys[STREAM_CHUNK_BLOCKS:] and reads[1][1].startswith("kvtier-ahead")
    assert [bytes(b.payload) for b in stream] == blocks[1:]
    m.flush()
    assert len(reads) == 2 and m.tiers[0].contains_many(keys) == [True] * len(keys)  # all promoted
    m.close()


def test_a_stream_from_a_pool_reads_larger_chunks():
    """A pool's batched gets each pay the service's round trips: a stream over a match that reaches a pool
    reads the pool's `stream_chunk_blocks` per get, DRAM and SSD keep STREAM_CHUNK_BLOCKS."""
    from kvtier.tiers.base import STREAM_CHUNK_BLOCKS

    POOL_STREAM_CHUNK_BLOCKS = PoolTier.stream_chunk_blocks
    assert POOL_STREAM_CHUNK_BLOCKS > STREAM_CHUNK_BLOCKS
    backend = _SlowBackend()
    keys = [bytes([0x60 + i]) * 16 for i in range(POOL_STREAM_CHUNK_BLOCKS + 3)]
    blocks = [get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(i)), key) for i, key in enumerate(keys)]
    backend.name_to_data.update((KEY_PREFIX + k.hex(), b) for k, b in zip(keys, blocks))
    gets: list[int] = []
    lease = backend.lease
    backend.lease = lambda names: gets.append(len(names)) or lease(names)
    m = TierManager([HostTier(2 * SIZE, SIZE), PoolTier("pool", backend)], backoff=FAST)
    match = m.match(keys)
    assert set(match.tier_indices) == {1}
    assert [bytes(b.payload) for b in m.stream(match)] == blocks
    assert gets == [POOL_STREAM_CHUNK_BLOCKS, 3]
    m.close()


def test_a_leased_read_over_a_pool_copies_and_leases_only_what_can_be_leased(caplog):
    """A pool tier has no leases: a leased read or stream gets its bytes and never asks it to
    release anything (no error logged), while the DRAM blocks beside it are leased and released."""
    backend = _SlowBackend()
    backend.unblock.set()
    backend.name_to_data[KEY_PREFIX + K[1].hex()] = _block(1)
    m = TierManager([HostTier(4 * SIZE, SIZE), PoolTier("pool", backend)], backoff=FAST)
    dram, pool = m.tiers
    dram.put_many([(K[0], _block(0))])
    with caplog.at_level("ERROR"):
        prefix = m.read(m.match(K[:2]), lease=True)
        assert [bytes(p) for p in prefix.payloads] == [_block(0), _block(1)] and prefix.tiers == ["dram", "pool"]
        assert dram.num_leased() == 1
        prefix.release()
        m.flush()
        assert dram.delete(K[1])  # it was promoted: from the pool again
        assert [(b.tier, bytes(b.payload)) for b in m.stream(m.match(K[:2]))] == [("dram", _block(0)), ("pool", _block(1))]
    assert dram.num_leased() == 0 and pool.health.healthy
    assert not [r for r in caplog.records if "release" in r.getMessage()]
    m.close()


# -- integrity by where a block has been (issue 21) ------------------------------------------------
def _flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0xFF
    return bytes(out)


def test_a_dram_block_is_checked_by_its_key_bound_header(tmp_path):
    """A block in this process's own DRAM slots never left the process: its header (key tag, header
    checksum) is checked, not its payload hash — a wrong key or a torn header is still caught."""
    import kvtier.codecs.header as header

    m = _stack(tmp_path)
    dram = m.tiers[0]
    dram.put_many([(K[0], _block(0)), (K[1], _block(1, K[0])), (K[2], _flip(_block(2), 40))])  # K[1] foreign, K[2] torn header
    checked = []
    verify = header.verify
    import kvtier.tiers.manager as manager_module
    manager_module.verify = lambda data, key, **kw: (checked.append(kw.get("payload", True)), verify(data, key, **kw))[1]
    try:
        assert [bytes(p) for p in m.read(m.match(K[:3])).payloads] == [_block(0)]
    finally:
        manager_module.verify = verify
    assert checked == [False, False, False]  # header only, for every DRAM block
    assert dram.stats.corrupt == 2 and dram.contains_many(K[:3]) == [True, False, False]
    m.close()


def test_a_corrupt_payload_is_caught_on_the_ssd_and_in_a_pool(tmp_path):
    """Every block that crossed a medium keeps the full payload proof."""
    backend = _SlowBackend()
    backend.unblock.set()
    backend.name_to_data[KEY_PREFIX + K[1].hex()] = _flip(_block(1), -1)
    m = TierManager([HostTier(4 * SIZE, SIZE), PoolTier("pool", backend), DiskTier(tmp_path, 100 * SIZE)],
                    backoff=FAST)
    dram, pool, ssd = m.tiers
    m.put_many([(K[0], _block(0))])
    m.flush()
    backend.name_to_data[KEY_PREFIX + K[1].hex()] = _flip(_block(1), -1)
    ssd.put_many([(K[2], _flip(_block(2), -1))])
    dram.delete(K[0])
    ssd.delete(K[0])  # K[0] from the pool (intact), K[1] from the pool (payload flipped)
    assert m.read(m.match(K[:2])).tiers == ["pool"] and pool.stats.corrupt == 1
    backend.name_to_data.pop(KEY_PREFIX + K[2].hex(), None)
    assert m.get_prefix([K[2]]) == [] and ssd.stats.corrupt == 1
    m.close()


# -- look up once, pin, read there (issue 21) --------------------------------------------------------
def test_a_pinned_match_keeps_its_blocks_until_the_read_ends(tmp_path):
    m = TierManager([HostTier(2 * SIZE, SIZE), DiskTier(tmp_path, 2 * SIZE)], async_writes=False)
    dram, ssd = m.tiers
    dram.put_many([(K[0], _block(0))])
    ssd.put_many([(K[1], _block(1))])
    match = m.match(K[:2], pin=True)
    assert match.tiers == ["dram", "ssd"] and match.pinned == [True, True]
    for i in (4, 5):  # one block a put
        ssd.put_many([(K[i], _block(i))])  # the SSD holds 2: K[1] is pinned, K[4] goes
        dram.put_many([(K[i + 2], _block(i + 2))])  # DRAM: K[0] is pinned, K[6] goes
    assert ssd.contains_many([K[1], K[4]]) == [True, False]
    assert dram.contains_many([K[0], K[6]]) == [True, False]
    assert [b.tier for b in m.stream(match)] == ["dram", "ssd"]
    assert match.pinned == [] and dram._pins.keys() == set() and ssd._pins == {}
    m.unpin(match)  # idempotent
    m.close()


def test_the_promotion_into_dram_runs_after_the_read_and_keeps_what_it_reads_leased(tmp_path):
    """A restore from below does not wait for DRAM (a layerwise load writes its first layer at once): the
    promotion runs on the writer thread, and the SSD buffer it copies from stays leased until it has —
    even when the reader let go first."""
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    ssd.put_many([(K[0], _block(0)), (K[1], _block(1))])
    gate, entered = threading.Event(), threading.Event()
    put = dram.put_many

    def slow_put(items):
        entered.set()
        assert gate.wait(10)
        return put(items)

    dram.put_many = slow_put
    hold: list = []
    blocks = [(b.key, bytes(b.payload)) for b in m.stream(m.match(K[:2]), hold=hold)]
    assert blocks == [(K[0], _block(0)), (K[1], _block(1))]  # the whole read is back: DRAM not written yet
    assert entered.wait(10) and dram.contains_many(K[:2]) == [False, False]
    release(hold)  # the reader is done, the promotion is not: its buffers stay out
    assert ssd.num_leased() == 2
    gate.set()
    m.flush()
    assert ssd.num_leased() == 0 and dram.contains_many(K[:2]) == [True, True]
    assert [bytes(p) for p in m.read(m.match(K[:2])).payloads] == [_block(0), _block(1)]
    m.close()


def test_a_block_gone_from_where_the_match_found_it_is_read_from_the_next_tier(tmp_path):
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    m.put_many([(K[0], _block(0)), (K[1], _block(1))])
    m.flush()
    match = m.match(K[:2])
    assert match.tiers == ["dram", "dram"]
    dram.delete(K[1])  # evicted between the lookup and the read
    blocks = list(m.stream(match))
    assert [(b.tier, bytes(b.payload)) for b in blocks] == [("dram", _block(0)), ("ssd", _block(1))]
    m.flush()
    assert dram.contains_many([K[1]]) == [True]  # promoted again
    m.close()


def test_locate_reads_where_another_process_found_the_blocks_without_looking_them_up(tmp_path):
    """vLLM's worker: the scheduler's lookup says where (tier names); only this process's DRAM, which
    that lookup could not see, is asked (in memory); the SSD is read, never asked."""
    m = _stack(tmp_path)
    dram, ssd = m.tiers
    ssd.put_many([(K[0], _block(0)), (K[1], _block(1)), (K[2], _block(2))])
    dram.put_many([(K[1], _block(1))])
    asked = []
    holds = ssd._holds
    ssd._holds = lambda key: asked.append(key) or holds(key)
    match = m.locate(K[:4], ["ssd", "ssd", "ssd", "nowhere"])
    assert match.tiers == ["ssd", "dram", "ssd"] and match.pinned == [False, True, False]
    assert [bytes(b.payload) for b in m.stream(match)] == [_block(0), _block(1), _block(2)]
    assert asked == [] and dram._pins.keys() == set()
    m.close()


def test_an_eviction_write_through_placed_below_returns_its_key_not_its_bytes(tmp_path):
    m = _stack(tmp_path, dram_blocks=2)
    dram, ssd = m.tiers
    m.put_many([(K[0], _block(0)), (K[1], _block(1))])
    m.flush()  # written through: placed below
    asked = []
    contains = ssd.contains_many
    ssd.contains_many = lambda ks: asked.extend(ks) or contains(ks)
    assert dram.put_many([(K[2], _block(2))]) == [(K[1], None)]  # the chain's tail; no bytes copied out
    m.put_many([(K[3], _block(3))])  # evicts K[0] (placed below): nothing to demote
    m.flush()
    assert asked == [K[3]]  # the write-through's check only; no lookup for the evicted blocks
    assert m.get_prefix(K[:4]) == [_block(i) for i in range(4)]
    m.close()


def test_lease_in_place_pins_where_held_or_stores_and_never_evicts_a_leased_block(tmp_path):
    """Leases of the top tier's memory by slot: a held block is leased where it is, a missing one stored
    (written through below) or, read from below, stored without a write back down and demoted as nothing;
    a leased slot is never evicted nor reused by later puts; release ends each lease once."""
    m = _stack(tmp_path, dram_blocks=3)
    dram, ssd = m.tiers
    assert m.num_in_place_slots == 3
    m.put_many([(K[0], _block(0))])
    m.flush()
    held = dram._key_to_slot[K[0]]
    assert m.lease_in_place([(K[0], None), (K[1], None)]) == [held, None]  # K[1]: not held, no data
    slot1, slot2 = m.lease_in_place([(K[1], _block(1)), (K[2], _block(2))], from_below=True)
    m.flush()
    assert ssd.contains_many(K[1:3]) == [False, False]  # from below: not written back down
    assert dram.num_leased() == 3
    m.put_many([(K[i], _block(i)) for i in (3, 4, 5)])  # every slot leased: dropped, nothing evicted
    view = m.in_place_view(torch.float32, (1, 2, 1, 4, 4))
    assert [float(view[s].flatten()[0]) for s in (held, slot1, slot2)] == [0.0, 1.0, 2.0]
    assert dram.contains_many(K[:3]) == [True, True, True] and dram.num_dropped_puts == 3
    m.release_in_place([K[1], K[2]])
    m.put_many([(K[3], _block(3))])  # evicts K[2], the tail of K1, K2 (placed below: its key alone, not demoted)
    m.flush()
    assert dram.contains_many(K[:4]) == [True, True, False, True] and not ssd.contains_many([K[2]])[0]
    m.release_in_place([K[0]])
    assert dram.num_leased() == 0
    m.close()


def test_lease_in_place_only_on_a_top_tier_in_this_process(tmp_path):
    m = TierManager([DiskTier(tmp_path, 10 * SIZE)], async_writes=False)
    assert m.num_in_place_slots == 0
    assert m.lease_in_place([(K[0], _block(0))]) == [None] and not m.contains_many([K[0]])[0]
    m.close()


def test_a_read_in_chunks_keeps_the_chain_s_root_the_most_recent(tmp_path):
    """A stream reads 4 blocks at a time: each chunk is refreshed after the one before, then the manager
    refreshes the whole chain tail first (root most recent), so pressure evicts the chain from its tail."""
    keys = [bytes([100 + i]) * 16 for i in range(10)]
    for tier in (HostTier(8 * SIZE, SIZE), DiskTier(tmp_path, 8 * SIZE)):
        m = TierManager([tier], async_writes=False)
        m.put_many([(key, _block(0, key)) for key in keys[:8]])
        assert len(list(m.stream(m.match(keys[:8])))) == 8  # two chunks
        m.put_many([(key, _block(0, key)) for key in keys[8:]])  # evicts 2 blocks of the chain: its last 2
        assert len(m.match(keys[:8])) == 6, tier.name
        m.close()


def test_a_chain_the_top_tier_evicts_is_demoted_so_that_the_lower_tier_keeps_its_root(tmp_path):
    """DRAM evicts a chain tail first (K1, then K0); the demotion hands them to the SSD most recent first, so
    the SSD refreshes them in DRAM's order and its own eviction takes the chain's tail too."""
    m = TierManager([HostTier(2 * SIZE, SIZE), DiskTier(tmp_path, 3 * SIZE)], async_writes=False)
    dram, ssd = m.tiers
    dram.put_many([(K[0], _block(0)), (K[1], _block(1))])  # in DRAM only: evicting them demotes them
    m.put_many([(K[2], _block(2)), (K[3], _block(3))])  # demotes K1, K0; then K2, K3 written through
    assert ssd.contains_many(K[:4]) == [True, False, True, True]  # K3 evicted the demoted chain's tail
    m.close()
