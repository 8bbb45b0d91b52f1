"""The pooled tiers (Mooncake Store, Redis) against real services on 127.0.0.1: the same tests for
both backends — round trips, sharing between managers and processes, corruption, and a pool that
dies mid-run and comes back."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import xxhash

from kvtier.codecs import get_codec
from kvtier.errors import UserError
from kvtier.tiers.manager import TierManager, build_manager
from kvtier.server.metrics import EngineView, ServerMetrics
from kvtier.tiers import Backoff, DiskTier, HostTier, make_tier
from kvtier.tiers.buffers import ReadBuffers
from kvtier.tiers.mooncake import parse_spec
from kvtier.tiers.pool import PoolError

from kvtier.bench.pools import MooncakePool, RedisServer, Service
from kvtier.ports import free_port, free_ports

pytestmark = pytest.mark.services

CODEC = get_codec("raw")


def _block(seed: int, key: bytes = bytes(16), tokens: int = 16) -> bytes:
    """A block bound to `key` (the manager refuses a block read under another key)."""
    g = torch.Generator().manual_seed(seed)
    return CODEC.encode(torch.randn((2, 2, 2, tokens, 8), generator=g), key)


SIZE = len(_block(0))


def _keys(tag: str, n: int) -> list[bytes]:
    """Unique per test, so tests sharing one session service never see each other's blocks."""
    return [xxhash.xxh3_128(f"{tag}-{time.monotonic_ns()}-{i}".encode()).digest() for i in range(n)]


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_round_trip_batched(pool_service):
    tier = make_tier(pool_service.spec, slot_bytes=SIZE)
    keys = _keys("rt", 6)
    assert tier.health.healthy
    assert tier.contains_many(keys) == [False] * 6
    assert tier.put_many([(k, _block(i, k)) for i, k in enumerate(keys[:4])]) == []
    assert tier.contains_many(keys) == [True] * 4 + [False] * 2
    assert tier.get_many(keys) == [_block(i, keys[i]) for i in range(4)] + [None, None]
    assert tier.stats.hits == 4 and tier.stats.misses == 2 and tier.stats.bytes_read == 4 * SIZE
    assert tier.delete(keys[0]) and tier.contains_many(keys[:1]) == [False]
    tier.close()


def test_leased_reads_give_the_same_blocks_and_reuse_their_buffers(pool_service):
    """`lease_many` returns what `get_many` does; Mooncake reads into registered buffers of its own
    (read-only views, the same buffers again after `release`), Redis hands out copies."""
    tier = make_tier(pool_service.spec, slot_bytes=SIZE)
    keys = _keys("lease", 4)
    tier.put_many([(k, _block(i, k)) for i, k in enumerate(keys[:3])])
    leased = tier.lease_many(keys)
    assert [None if v is None else bytes(v) for v in leased] == tier.get_many(keys)
    assert leased[3] is None and tier.stats.hits == 6 and tier.stats.bytes_read == 6 * SIZE
    if pool_service.spec.startswith("mooncake"):
        assert all(isinstance(v, memoryview) and v.readonly for v in leased[:3])
        first = {id(v.obj) for v in leased[:3]}
        tier.release(keys[:3])
        again = tier.lease_many(keys[:3])
        assert {id(v.obj) for v in again} == first  # the same mappings: nothing allocated, nothing faulted in
        assert [bytes(v) for v in again] == [_block(i, keys[i]) for i in range(3)]
    tier.release(keys)
    assert tier.num_leased() == 0
    tier.close()


def test_mooncake_block_larger_than_its_read_buffers_is_read_anyway(mooncake_master):
    """Lease buffers are sized to the largest block seen; a bigger one is read with get_batch, and so
    is every block when no buffer can be registered."""
    tier = make_tier(mooncake_master.spec, slot_bytes=1)
    keys = _keys("grow", 2)
    small, big = bytes([1]) * 1000, bytes([2]) * 100_000
    tier.put_many([(keys[0], small), (keys[1], big)])
    tier.backend._block_hint = 1000  # as if only small blocks were seen so far
    assert [bytes(v) for v in tier.lease_many(keys)] == [small, big]
    tier.release(keys)
    assert tier.stats.errors == 0 and tier.num_leased() == 0
    # a store that refuses to register read buffers (RDMA memory limits): still read, by copy
    def refuse(buf):
        raise PoolError("register_buffer failed with code -1")

    tier.backend._buffers = ReadBuffers(on_map=refuse)
    assert [bytes(v) for v in tier.lease_many(keys)] == [small, big]
    tier.release(keys)
    assert tier.stats.errors == 0 and tier.health.healthy and tier.num_leased() == 0
    tier.close()


def test_another_server_sees_the_blocks(pool_service, tmp_path):
    """Two managers (two servers), each DRAM over the shared pool: B's miss in DRAM is A's pool block."""
    a = build_manager(["dram:1MiB", pool_service.spec], slot_bytes=SIZE)
    b = build_manager(["dram:1MiB", pool_service.spec], slot_bytes=SIZE)
    keys = _keys("share", 3)
    a.put_many([(k, _block(i, k)) for i, k in enumerate(keys)])
    a.flush()
    pool_name = b.tiers[1].name
    assert b.lookup(keys) == [pool_name] * 3
    assert b.get_prefix(keys) == [_block(i, keys[i]) for i in range(3)]
    b.flush()  # the promotion runs on the writer thread, after the read
    assert b.lookup(keys) == ["dram"] * 3  # promoted into B's DRAM
    a.close(), b.close()


def test_another_process_sees_the_blocks(pool_service):
    keys = _keys("proc", 2)
    code = (
        "import sys, torch\n"
        "from kvtier.codecs import get_codec\n"
        "from kvtier.tiers import make_tier\n"
        "t = make_tier(sys.argv[1], slot_bytes=1)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "keys = [bytes.fromhex(h) for h in sys.argv[2:]]\n"
        "blocks = [get_codec('raw').encode(torch.randn((2, 2, 2, 16, 8), generator=g.manual_seed(i)), keys[i]) for i in range(2)]\n"
        "t.put_many(list(zip(keys, blocks)))\n"
        "t.close()\n")
    subprocess.run([sys.executable, "-c", code, pool_service.spec, *[k.hex() for k in keys]], check=True, timeout=60)
    tier = make_tier(pool_service.spec, slot_bytes=SIZE)
    assert tier.get_many(keys) == [_block(0, keys[0]), _block(1, keys[1])]
    tier.close()


@pytest.mark.parametrize("how", ["read", "stream"])
def test_corrupt_pool_block_is_a_miss_and_deleted(pool_service, how):
    """A plain read or a leased stream: the prefix ends before the bad block, which is deleted and
    counted, and every read buffer goes back."""
    m = build_manager([pool_service.spec], slot_bytes=SIZE)
    keys = _keys("bad", 3)
    bad = bytearray(_block(1, keys[1]))
    bad[-3] ^= 0x10
    m.tiers[0].put_many([(keys[0], _block(0, keys[0])), (keys[1], bytes(bad)), (keys[2], _block(2, keys[2]))])
    got = m.get_prefix(keys) if how == "read" else [bytes(b.payload) for b in m.stream(m.match(keys))]
    assert got == [_block(0, keys[0])]
    assert m.tiers[0].stats.corrupt == 1 and m.tiers[0].contains_many(keys) == [True, False, True]
    assert m.tiers[0].num_leased() == 0
    m.close()


def test_pool_value_written_under_another_key_is_never_served(pool_service):
    """An intact block stored under the wrong key (a buggy or hostile writer sharing the pool) is
    foreign: a miss, deleted, counted as corrupt and not as a hit; the prefix ends before it."""
    m = build_manager([pool_service.spec], slot_bytes=SIZE)
    keys = _keys("foreign", 3)
    m.tiers[0].put_many([(keys[0], _block(0, keys[0])), (keys[1], _block(2, keys[2])),
                         (keys[2], _block(2, keys[2]))])
    hits_before = m.tiers[0].stats.hits
    assert m.get_prefix(keys) == [_block(0, keys[0])]
    assert m.tiers[0].stats.hits - hits_before == 2  # the foreign read is not a hit
    assert m.tiers[0].stats.corrupt == 1 and m.tiers[0].contains_many(keys) == [True, False, True]
    m.close()


@pytest.mark.parametrize("kind", ["mooncake", "redis"])
def test_pool_dies_mid_run_and_comes_back(kind, tmp_path):
    """DRAM + pool + SSD: the pool is killed; reads fall back to DRAM/SSD, writes keep landing on SSD,
    nothing raises; the pool restarts and the manager reconnects on its own (back-off) and uses it."""
    service = MooncakePool(tmp_path, segment="64MB") if kind == "mooncake" else RedisServer(tmp_path)
    service.start()
    try:
        dram, ssd = HostTier(2 * SIZE, SIZE), DiskTier(tmp_path / "ssd", 100 * SIZE)
        pool = make_tier(service.spec, slot_bytes=SIZE)
        m = TierManager([dram, pool, ssd], backoff=Backoff(start_s=0.2, max_s=1.0))
        keys = _keys("fault", 6)
        m.put_many([(k, _block(i, k)) for i, k in enumerate(keys[:3])])
        m.flush()
        assert pool.contains_many(keys[:3]) == [True] * 3
        service.kill()
        m.put_many([(k, _block(i, k)) for i, k in enumerate(keys[3:], start=3)])  # must not raise
        m.flush()
        # every block is still served, from DRAM (the last two) or the SSD; the dead pool is skipped
        assert m.get_prefix(keys) == [_block(i, keys[i]) for i in range(6)]
        assert pool.health.state == "down" and pool.stats.errors >= 1
        assert ssd.contains_many(keys) == [True] * 6
        service.start()
        assert _wait(lambda: pool.health.healthy)  # the retry thread, no request needed
        new = _keys("after", 1)
        m.put_many([(new[0], _block(9, new[0]))])
        m.flush()
        assert pool.contains_many(new) == [True]
        m.close()
    finally:
        service.kill()


def _metric(text: str, line_start: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])


def test_pool_recovers_in_the_background_and_metrics_show_it(tmp_path):
    """No request arrives while redis is down and back: the retry thread alone brings the tier back,
    and /metrics shows each state (readable, writable, back-off, transitions)."""
    service = RedisServer(tmp_path)
    service.start()
    try:
        m = TierManager([HostTier(4 * SIZE, SIZE), make_tier(service.spec, slot_bytes=SIZE)],
                        backoff=Backoff(start_s=0.1, max_s=0.4))
        pool = m.tiers[1]
        metrics = ServerMetrics(EngineView, manager=m)
        assert _metric(metrics.render().decode(), 'kvtier_tier_readable{tier="redis"}') == 1.0
        service.kill()
        m.put_many([(k, _block(0)) for k in _keys("bg", 1)])  # the writer finds it dead
        m.flush()
        text = metrics.render().decode()
        assert _metric(text, 'kvtier_tier_readable{tier="redis"}') == 0.0
        assert _metric(text, 'kvtier_tier_writable{tier="redis"}') == 0.0
        assert _metric(text, 'kvtier_tier_backoff_seconds{tier="redis"}') > 0
        assert _wait(lambda: pool.health.backoff_s == 0.4)  # probes keep failing: the wait grew
        service.start()
        assert _wait(lambda: pool.health.healthy)
        text = metrics.render().decode()
        assert _metric(text, 'kvtier_tier_readable{tier="redis"}') == 1.0
        assert _metric(text, 'kvtier_tier_backoff_seconds{tier="redis"}') == 0.0
        assert _metric(text, 'kvtier_tier_health_transitions_total{tier="redis"}') == 2.0
        m.close()
    finally:
        service.kill()


def test_mooncake_put_and_get_beyond_the_transfer_buffer(mooncake_master):
    """The client's transfer buffer (64 MiB here) is shared by a get and a put in flight together:
    each moves at most half of it per call, so a 80 MiB put lands (it was refused whole with -600)."""
    tier = make_tier(mooncake_master.spec, slot_bytes=1)
    keys = _keys("big", 80)
    blocks = [bytes([i]) * (1 << 20) for i in range(80)]
    tier.put_many(list(zip(keys, blocks)))
    assert tier.stats.errors == 0 and tier.stats.puts == 80
    assert tier.get_many(keys) == blocks
    for key in keys:
        tier.delete(key)
    tier.close()


@pytest.mark.parametrize("spec", ["mooncake://127.0.0.1:{port}", "redis://127.0.0.1:{port}/0"])
def test_pool_down_at_start_is_an_unhealthy_tier_not_an_error(spec, tmp_path):
    m = build_manager(["dram:1MiB", spec.format(port=free_port())], slot_bytes=SIZE)
    assert m.tiers[1].health.state == "down"
    keys = _keys("down", 2)
    m.put_many([(k, _block(i, k)) for i, k in enumerate(keys)])
    m.flush()
    assert m.get_prefix(keys) == [_block(0, keys[0]), _block(1, keys[1])]
    m.close()


@pytest.mark.parametrize("spec,message", [
    ("mooncake://nohost", "host:port"),
    ("mooncake://127.0.0.1:1?colour=blue", "unknown mooncake tier option"),
    ("mooncake://127.0.0.1:1?segment=lots", "cannot parse"),
])
def test_bad_mooncake_spec(spec, message):
    with pytest.raises((UserError, ValueError), match=message):
        parse_spec(spec)


def test_mooncake_spec_defaults():
    b = parse_spec("mooncake:10.0.0.5:50051?segment=1GiB")
    assert b.master == "10.0.0.5:50051" and b.metadata == "http://10.0.0.5:8080/metadata"
    assert b.segment_bytes == 1 << 30 and b.buffer_bytes == 256 << 20 and b.protocol == "tcp"


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_service_stops_at_the_end_of_its_block_and_after_a_failed_start(tmp_path):
    """`with` stops every process; a start that fails part-way (the second process dies) stops the first."""
    with RedisServer(tmp_path) as redis:
        assert _listening(redis.port)
    assert not _listening(redis.port) and redis.procs == []
    first, second = free_ports(2)
    server = [sys.executable, "-m", "http.server", str(first), "--bind", "127.0.0.1"]
    dies = [sys.executable, "-c", "print('bound nothing: address already in use'); raise SystemExit(3)"]
    broken = Service([(server, first), (dies, second)], tmp_path)
    with pytest.raises(RuntimeError, match="exited with 3") as failed:
        broken.start()
    assert "bound nothing: address already in use" in str(failed.value)  # why it died, from its log
    assert broken.procs == [] and not _listening(first)


def test_free_ports_do_not_repeat():
    """Ports taken together, or one after another, never repeat: a Mooncake master handed one port for two
    listeners exits at start. (With a plain bind to port 0 each, 4 ports repeated in 12 of 20,000 draws
    here: over these 56,000 pairs a few would.)"""
    for _ in range(2500):
        ports = free_ports(6) + [free_port(), free_port()]
        assert len(set(ports)) == 8
