import errno
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.codecs import get_codec
from kvtier.errors import UserError
from kvtier.tiers import Backoff, DiskTier, HostTier, TierSpec, make_tier
from kvtier.tiers.disk import PROBE_BLOCKS, TMP_GRACE_SECONDS

K = [bytes([i]) * 16 for i in range(8)]


def _block(seed: int) -> bytes:
    return get_codec("raw").encode(torch.full((1, 2, 1, 4, 4), float(seed)), bytes(16))


SIZE = len(_block(0))


def test_host_lru_eviction_order_and_stats():
    tier = HostTier(capacity_bytes=3 * SIZE, slot_bytes=SIZE)
    assert tier.put_many([(K[0], _block(0)), (K[1], _block(1)), (K[2], _block(2))]) == []
    assert tier.get_many([K[2], K[5]]) == [_block(2), None]  # the chain's tail, least recent until now
    evicted = tier.put_many([(K[3], _block(3))])
    assert evicted == [(K[1], _block(1))]  # K[2] was touched by the get
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


def test_host_oversize_block_is_a_counted_error_not_an_outage(caplog):
    tier = HostTier(capacity_bytes=4 * SIZE, slot_bytes=SIZE)
    big = _block(0) + b"x"
    assert tier.put_many([(K[0], big), (K[1], _block(1)), (K[2], big)]) == []
    assert tier.contains_many(K[:3]) == [False, True, False]
    assert tier.stats.errors == 2 and tier.stats.puts == 1 and tier.health.healthy
    assert sum("exceeds the slot" in r.message for r in caplog.records) == 1  # said once, counted each time


def test_host_reconnect_drops_contents_only_when_the_bookkeeping_broke():
    tier = HostTier(capacity_bytes=4 * SIZE, slot_bytes=SIZE)
    tier.put_many([(K[0], _block(0)), (K[1], _block(1))])
    tier.health.fail("put raised RuntimeError")  # what the manager does when a tier raises
    assert tier.reconnect() and tier.health.healthy and tier.contains_many(K[:2]) == [True, True]
    tier._free_slots.pop()  # a bug left a slot neither free nor used
    tier.health.fail("put raised RuntimeError")
    assert tier.reconnect() and tier.health.healthy
    assert tier.num_blocks() == 0 and tier.num_free_slots() == 4
    tier.put_many([(K[2], _block(2))])
    assert tier.get_many([K[2]]) == [_block(2)]


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


def _temp_file(tier: DiskTier, key: bytes, data: bytes, age_s: float) -> Path:
    """A write that never reached its rename, `age_s` old."""
    path = tier._path(key).with_name(f"{tier._path(key).name}.1234-abcd.tmp")
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    stamp_ns = time.time_ns() - int(age_s * 1e9)
    os.utime(path, ns=(stamp_ns, stamp_ns))
    return path


def test_disk_leftover_temp_file_is_ignored_and_cleaned_once_old(tmp_path):
    """A crash's temporary file goes at the next start; a young one may be another process's live
    write (its rename must not fail): it stays."""
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[0], _block(0))])
    torn = _temp_file(tier, K[1], _block(1)[:10], age_s=TMP_GRACE_SECONDS + 60)
    live = _temp_file(tier, K[2], _block(2)[:10], age_s=1)
    reopened = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    assert reopened.contains_many([K[0], K[1], K[2]]) == [True, False, False]
    assert not torn.exists() and live.exists()


def test_disk_writes_use_temporary_names_of_their_own(tmp_path, monkeypatch):
    """Two writers of one key never share a temporary file (both would truncate it)."""
    names = []
    real_link = os.link

    def link(src, dst):
        names.append(Path(src).name)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    for seed in range(2):
        DiskTier._write(tmp_path / "ab" / "x.kvb", _block(seed))
    assert len(set(names)) == 2 and all(name.startswith("x.kvb.") and name.endswith(".tmp") for name in names)
    assert f".{os.getpid()}-" in names[0]
    # the block in place is never overwritten (a pin holds that very file), and no temporary file is left
    assert sorted(p.name for p in (tmp_path / "ab").iterdir()) == ["x.kvb"]
    assert (tmp_path / "ab" / "x.kvb").read_bytes() == _block(0)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_turns_writes_off(tmp_path, monkeypatch, caplog, code):
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[0], _block(0))])

    def fail(path, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(DiskTier, "_write", staticmethod(fail))
    tier.put_many([(K[1], _block(1)), (K[2], _block(2))])
    assert (tier.health.readable, tier.health.writable) == (True, False) and tier.stats.errors == 1
    assert tier.contains_many([K[0], K[1], K[2]]) == [True, False, False]
    assert tier.get_many([K[0]]) == [_block(0)]  # reads keep working
    assert sum("writes off, reads go on" in r.message for r in caplog.records) == 1
    assert not tier.reconnect()  # the probe write fails too
    monkeypatch.undo()
    assert tier.reconnect() and tier.health.healthy  # the disk has room again: puts resume
    tier.put_many([(K[1], _block(1))])
    assert tier.get_many([K[1]]) == [_block(1)]


def _statvfs(free_bytes: int, flag: int = 0):
    return lambda path: SimpleNamespace(f_flag=flag, f_bavail=free_bytes, f_frsize=1)


def test_disk_probe_wants_room_for_blocks_not_two_bytes(tmp_path, monkeypatch):
    """A nearly full disk takes the 2-byte probe but not a block: the probe asks statvfs first."""
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[0], _block(0))])

    def no_room_for_blocks(path, data):
        if len(data) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    real_write = DiskTier._write
    monkeypatch.setattr(DiskTier, "_write", staticmethod(no_room_for_blocks))
    monkeypatch.setattr(os, "statvfs", _statvfs(SIZE - 1))
    tier.put_many([(K[1], _block(1))])
    assert not tier.health.writable
    assert not tier.reconnect()  # less than one block free
    monkeypatch.setattr(os, "statvfs", _statvfs(PROBE_BLOCKS * SIZE - 1))
    assert not tier.reconnect()  # still fewer than PROBE_BLOCKS blocks
    monkeypatch.setattr(os, "statvfs", _statvfs(10**12, flag=os.ST_RDONLY))
    assert not tier.reconnect()  # room, but a read-only file system
    monkeypatch.setattr(os, "statvfs", _statvfs(PROBE_BLOCKS * SIZE))
    assert tier.reconnect() and tier.health.healthy
    assert tier.get_many([K[0]]) == [_block(0)]


def test_disk_back_off_grows_across_quick_relapses(tmp_path, monkeypatch):
    """statvfs says there is room, yet every block write fails (the issue's 44 flaps in 64 s): each
    relapse soon after a recovery doubles the wait instead of starting again at 1 s."""
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.health.backoff = Backoff(start_s=1.0, max_s=8.0, stable_s=60.0)
    real_write = DiskTier._write

    def fail_blocks(path, data):
        if len(data) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(path, data)

    monkeypatch.setattr(DiskTier, "_write", staticmethod(fail_blocks))
    waits = []
    for i in range(5):
        tier.put_many([(K[i], _block(i))])
        waits.append(tier.health.backoff_s)
        assert tier.health.readable and not tier.health.writable
        assert tier.reconnect()  # the probe passes: statvfs shows room
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert tier.health.num_transitions == 10 and tier.stats.errors == 5
    tier.health.backoff = Backoff(start_s=1.0, max_s=8.0, stable_s=0.0)  # up "long enough"
    tier.put_many([(K[5], _block(5))])
    assert tier.health.backoff_s == 1.0


def test_disk_start_up_ignores_files_that_are_not_blocks(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[0], _block(0))])
    strays = [tmp_path / "zz" / "not-hex.kvb", tmp_path / "01" / "01 02.kvb", tmp_path / "ab" / "0101.kvb",
              tmp_path / "01" / ".kvb", tmp_path / "01" / "notes.txt"]
    for path in strays:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    reopened = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    assert reopened.num_blocks() == 1 and reopened.get_many([K[0]]) == [_block(0)]
    assert all(path.exists() for path in strays)  # not ours: left alone
    assert reopened.health.healthy


def test_disk_read_only_directory_serves_reads(tmp_path, monkeypatch):
    """A leftover temporary file and more blocks than the configured size, on a disk that refuses
    every delete (EROFS): the tier opens, keeps the most recent blocks, reads them, writes nothing."""
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    for i in range(3):
        tier.put_many([(K[i], _block(i))])
        os.utime(tier._path(K[i]), ns=(10**18 + i, 10**18 + i))
    _temp_file(tier, K[5], b"torn", age_s=TMP_GRACE_SECONDS + 60)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(os, "replace", read_only)
    monkeypatch.setattr(os, "link", read_only)
    reopened = DiskTier(tmp_path, capacity_bytes=2 * SIZE)
    assert (reopened.health.readable, reopened.health.writable) == (True, False)
    assert reopened.contains_many(K[:3]) == [False, True, True]
    assert reopened.get_many([K[1], K[2]]) == [_block(1), _block(2)]
    assert not reopened.reconnect()  # the probe's write fails too
    monkeypatch.undo()
    assert reopened.reconnect() and reopened.health.healthy


def test_disk_missing_directory_is_created_or_refused_in_one_line(tmp_path):
    deep = tmp_path / "a" / "b" / "ssd"
    tier = make_tier(f"ssd:{deep}:1MiB", slot_bytes=SIZE)
    assert deep.is_dir() and tier.health.healthy
    (tmp_path / "file").write_text("in the way")
    for path in (tmp_path / "file", tmp_path / "file" / "ssd"):
        with pytest.raises(UserError, match="cannot use") as info:
            make_tier(f"ssd:{path}:1MiB", slot_bytes=SIZE)
        assert "\n" not in str(info.value)


def test_disk_reads_refresh_lru_order_across_restart(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=3 * SIZE)
    for i in range(3):
        tier.put_many([(K[i], _block(i))])
        os.utime(tier._path(K[i]), ns=(10**18 + i, 10**18 + i))  # written in order 0, 1, 2
    assert tier.get_many([K[0]]) == [_block(0)]  # 0 is now the most recently used
    reopened = DiskTier(tmp_path, capacity_bytes=3 * SIZE)
    reopened.put_many([(K[3], _block(3))])  # evicts the least recent: 1, not 0
    assert reopened.contains_many(K[:4]) == [True, False, True, True]


def test_tier_specs():
    assert isinstance(make_tier("dram:1MiB", slot_bytes=SIZE), HostTier)
    with pytest.raises(UserError):
        make_tier("tape:1GiB", slot_bytes=SIZE)
    with pytest.raises(UserError):
        make_tier("ssd:1GiB", slot_bytes=SIZE)


@pytest.mark.parametrize("text, expected", [
    ("dram:1MiB", TierSpec("dram", "dram:1MiB", 1 << 20)),
    ("dram", TierSpec("dram", "dram", 1 << 30)),
    ("ssd:/data/kv:10GiB", TierSpec("ssd", "ssd:/data/kv:10GiB", 10 << 30, path=Path("/data/kv"))),
    ("shm:/dev/shm/kv:2GB", TierSpec("shm", "shm:/dev/shm/kv:2GB", 2 * 10**9, path=Path("/dev/shm/kv"))),
    ("mooncake://10.0.0.5:50051?segment=1GiB", TierSpec("mooncake", "mooncake://10.0.0.5:50051?segment=1GiB", None,
                                                        url="10.0.0.5:50051", options={"segment": "1GiB"})),
    ("mooncake:10.0.0.5:50051", TierSpec("mooncake", "mooncake:10.0.0.5:50051", None, url="10.0.0.5:50051")),
    ("redis://127.0.0.1:6379/0", TierSpec("redis", "redis://127.0.0.1:6379/0", None, url="redis://127.0.0.1:6379/0")),
    ("unix:///run/redis.sock", TierSpec("redis", "unix:///run/redis.sock", None, url="unix:///run/redis.sock")),
])
def test_tier_spec_is_parsed_once(text, expected):
    spec = TierSpec.parse(text)
    assert spec == expected and str(spec) == text and TierSpec.parse(spec) is spec
    assert spec.shared == (spec.kind != "dram")


@pytest.mark.parametrize("text, message", [
    ("tape:1GiB", "unknown tier 'tape:1GiB': use dram:SIZE, ssd:DIR:SIZE, shm:DIR:SIZE, mooncake://HOST:PORT, "
                  "redis://HOST:PORT/DB"),
    ("", "a tier spec must be a non-empty string (dram:SIZE, ssd:DIR:SIZE, shm:DIR:SIZE, mooncake://HOST:PORT, "
         "redis://HOST:PORT/DB), got ''"),
    ("ssd:1GiB", "ssd tier spec needs a directory and a size: ssd:/path:10GiB, got 'ssd:1GiB'"),
    ("shm:/dev/shm/kv:", "shm tier spec needs a directory and a size: shm:/path:10GiB, got 'shm:/dev/shm/kv:'"),
    ("dram:lots", "tier spec 'dram:lots': cannot parse byte size 'lots' (expected e.g. 128k, 256MiB, 80GB)"),
    ("dram:0", "tier spec 'dram:0': the size must be positive"),
    ("ssd:/x:12parsecs", "tier spec 'ssd:/x:12parsecs': unknown byte unit 'parsecs' in '12parsecs' "
                         "(use B, KB, MB, GB, KiB, MiB, GiB, ...)"),
    ("mooncake://nohost", "mooncake tier spec needs the master's host:port, e.g. mooncake://127.0.0.1:50051; "
                          "got 'mooncake://nohost'"),
    ("mooncake://h:port", "mooncake tier spec needs the master's host:port, e.g. mooncake://127.0.0.1:50051; "
                          "got 'mooncake://h:port'"),
    ("mooncake://h:1?colour=blue", "unknown mooncake tier option(s) colour in 'mooncake://h:1?colour=blue': "
                                   "use metadata, segment, buffer, protocol, device, local"),
    ("mooncake://h:1?segment=lots", "tier spec 'mooncake://h:1?segment=lots': cannot parse byte size 'lots' "
                                    "(expected e.g. 128k, 256MiB, 80GB)"),
    ("redis:6379", "redis tier spec needs a host: redis://HOST:PORT/DB, got 'redis:6379'"),
    ("redis://h:port/0", "redis tier spec needs a host: redis://HOST:PORT/DB, got 'redis://h:port/0'"),
    ("redis://h:6379/zero", "redis tier spec: the database must be a number (redis://HOST:PORT/0), "
                            "got 'redis://h:6379/zero'"),
])
def test_a_bad_tier_spec_is_one_line_naming_it(text, message):
    with pytest.raises(UserError) as info:
        TierSpec.parse(text)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_generate_tier_names_become_specs_pools_between_dram_and_ssd(tmp_path):
    from kvtier.generate_cli import tier_specs

    specs = tier_specs("ssd,redis,dram", ssd_dir=str(tmp_path), pool_url="127.0.0.1:6379/0", dram_bytes="64MiB")
    assert [str(spec) for spec in specs] == ["dram:64MiB", "redis://127.0.0.1:6379/0", f"ssd:{tmp_path}:20GiB"]
    with pytest.raises(UserError, match="the mooncake tier needs --pool-url"):
        tier_specs("mooncake", ssd_dir=None, pool_url=None)
    with pytest.raises(UserError, match="unknown tier 'tape'"):
        tier_specs("tape", ssd_dir=None, pool_url=None)


def test_disk_batched_read_keeps_order_and_survives_a_vanished_file(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=10 * SIZE)
    tier.put_many([(K[i], _block(i)) for i in range(6)])
    tier._path(K[2]).unlink()  # removed behind the tier's back (an operator, another process)
    assert tier.get_many([K[0], K[1], K[2], K[3], K[7], K[5]]) == [_block(0), _block(1), None, _block(3), None, _block(5)]
    # a miss, dropped from the index; not an error (in a shared directory other processes evict)
    assert tier.stats.errors == 0 and tier.num_blocks() == 5 and tier.contains_many([K[2]]) == [False]


@pytest.mark.parametrize("kind", ["dram", "ssd"])
def test_one_reader_and_one_writer_at_once_never_see_a_wrong_block(kind, tmp_path):
    """The manager's two sides call a tier concurrently: the writer evicting as it goes, the reader
    gets each block whole or a miss, never another key's block, and no error is counted."""
    tier = HostTier(8 * SIZE, SIZE) if kind == "dram" else DiskTier(tmp_path, 8 * SIZE)
    keys = [i.to_bytes(16, "little") for i in range(48)]
    key_to_block = {key: _block(i) for i, key in enumerate(keys)}
    failures = []

    def write():
        try:
            for _ in range(3):
                for key in keys:
                    tier.put_many([(key, key_to_block[key])])
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    num_hits = 0
    while writer.is_alive() or not num_hits:
        datas = tier.get_many(keys)
        assert all(d is None or d == key_to_block[k] for k, d in zip(keys, datas))
        num_hits += sum(d is not None for d in datas)
        tier.contains_many(keys)
    writer.join()
    assert failures == [] and tier.stats.errors == 0
    assert tier.num_blocks() == 8 and tier.used_bytes() == 8 * SIZE
    held = [key for key, h in zip(keys, tier.contains_many(keys)) if h]
    assert len(held) == 8 and tier.get_many(held) == [key_to_block[k] for k in held]
    if kind == "ssd":  # every evicted file is gone: the index and the directory agree
        assert sorted(p.name for p in tmp_path.glob("*/*.kvb")) == sorted(tier._path(k).name for k in held)


def test_dram_leases_are_views_pinned_until_released():
    """lease_many hands out read-only views of the slots: a leased block is never evicted, a put that
    would need its slot is dropped, and a key deleted while leased frees its slot at the release."""
    tier = HostTier(2 * SIZE, SIZE)
    tier.put_many([(K[0], _block(0)), (K[1], _block(1))])
    view0, view1, missing = tier.lease_many([K[0], K[1], K[5]])
    assert missing is None and view0.readonly and bytes(view0) == _block(0)
    assert tier.num_leased() == 2
    assert tier.put_many([(K[2], _block(2))]) == []  # both slots leased: nothing may move
    assert tier.num_dropped_puts == 1 and tier.contains_many([K[2]]) == [False]
    tier.release([K[1]])
    assert tier.put_many([(K[2], _block(2))]) == [(K[1], _block(1))]  # now K[1]'s slot is free to go
    assert bytes(view0) == _block(0)  # untouched under the lease
    assert tier.delete(K[0])  # deleted while leased: the slot stays pinned and out of use
    assert tier.put_many([(K[3], _block(3))]) == [(K[2], _block(2))]  # evicts K[2], not the orphan
    assert bytes(view0) == _block(0)
    tier.release([K[0]])
    assert tier.num_leased() == 0 and tier.num_free_slots() == 1
    assert tier.put_many([(K[4], _block(4))]) == []  # the orphan's slot is back in use
    assert tier.get_many([K[3], K[4]]) == [_block(3), _block(4)]
    assert tier._consistent()


def test_ssd_leases_read_into_pooled_buffers(tmp_path):
    """lease_many reads each file into a page-aligned pooled buffer (O_DIRECT on ext4/xfs): the same
    bytes as get_many, buffers reused after release, a file deleted while leased stays readable."""
    tier = DiskTier(tmp_path, 100 * SIZE)
    tier.put_many([(K[i], _block(i)) for i in range(3)])
    views = tier.lease_many([K[0], K[1], K[2], K[6]])
    assert [bytes(v) for v in views[:3]] == [_block(i) for i in range(3)] and views[3] is None
    assert all(v.readonly for v in views[:3])
    assert tier.delete(K[1]) and bytes(views[1]) == _block(1)  # the file is gone, the leased copy is not
    assert tier.stats.hits == 3 and tier.stats.misses == 1
    tier.release([K[0], K[1], K[2]])
    assert tier.num_leased() == 0
    again = tier.lease_many([K[0]])
    assert bytes(again[0]) == _block(0)
    tier.release([K[0]])
    assert tier.get_many([K[0], K[2]]) == [_block(0), _block(2)]


def test_disk_capacity_beyond_the_file_system_is_said_at_start(tmp_path, caplog):
    """A tier sized past the disk's room would only find out at ENOSPC: it warns when it opens."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with caplog.at_level("WARNING"):
        DiskTier(tmp_path / "small", 1 << 20)
    assert not [r for r in caplog.records if "room for" in r.getMessage()]
    with caplog.at_level("WARNING"):
        DiskTier(tmp_path / "huge", free * 4)
    assert [r for r in caplog.records if "room for" in r.getMessage()]


# ---- a request's blocks (a chain, root first) are refreshed tail first: a full tier evicts chains from their tails
def _bounded(kind: str, num_blocks: int, tmp_path):
    if kind == "dram":
        return HostTier(capacity_bytes=num_blocks * SIZE, slot_bytes=SIZE)
    return make_tier(f"{kind}:{tmp_path}:{num_blocks * SIZE}", slot_bytes=SIZE)


def _put(tier, keys: list[bytes]) -> None:
    tier.put_many([(key, _block(i)) for i, key in enumerate(keys)])


def _prefix_len(tier, keys: list[bytes]) -> int:
    held = tier.contains_many(keys)
    return held.index(False) if False in held else len(held)


@pytest.mark.parametrize("kind", ["dram", "ssd", "shm"])
def test_a_full_tier_evicts_a_chain_from_its_tail_and_keeps_its_root(kind, tmp_path):
    """5 blocks: chain A (4 blocks), then chain B (3): A loses its last 2 and keeps a 2-block prefix (root
    first it would keep its last 2, stored and never matched again)."""
    tier = _bounded(kind, 5, tmp_path)
    _put(tier, K[:4])
    _put(tier, K[4:7])
    assert tier.contains_many(K[:7]) == [True, True, False, False, True, True, True]
    assert _prefix_len(tier, K[:4]) == 2


@pytest.mark.parametrize("kind", ["dram", "ssd", "shm"])
def test_a_chain_longer_than_the_tier_keeps_its_first_blocks(kind, tmp_path):
    tier = _bounded(kind, 3, tmp_path)
    _put(tier, K[:5])
    assert tier.contains_many(K[:5]) == [True, True, True, False, False]


@pytest.mark.parametrize("kind, read", [("dram", "get_many"), ("dram", "lease_many"), ("ssd", "get_many"),
                                        ("ssd", "lease_many"), ("shm", "pin_many")])
def test_a_read_refreshes_a_chain_tail_first(kind, read, tmp_path):
    """Chains A (K0, K1) then B (K2, K3) fill 4 blocks; a read of A (or a pin: the lookup a load follows)
    makes A's root the most recent: chain C (3 blocks) evicts B, then A's tail, and A keeps its root."""
    tier = _bounded(kind, 4, tmp_path)
    _put(tier, K[:2])
    _put(tier, K[2:4])
    assert all(getattr(tier, read)(K[:2]))
    if read == "lease_many":
        tier.release(K[:2])
    if read == "pin_many":
        tier.unpin(K[:2])
    _put(tier, K[4:7])
    assert tier.contains_many(K[:7]) == [True, False, False, False, True, True, True]
