"""One block directory, several indexes: independent processes (two servers, a second `kvtier generate`)
and vLLM's owner / store split. No process deletes a block another has pinned for a load; no read
returns a block other than the one its key names."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from kvtier.tiers import DiskStore, DiskTier

BLOCK_BYTES = 96  # tiny blocks: many files, much eviction


def payload(key: bytes) -> bytes:
    """The block every writer of `key` writes: a reader checks each byte it gets against it."""
    return (key + hashlib.sha256(key).digest()) * 2


KEYS = [i.to_bytes(16, "big") for i in range(1, 9)]
assert len(payload(KEYS[0])) == BLOCK_BYTES


def put(tier, *keys: bytes) -> None:
    tier.put_many([(key, payload(key)) for key in keys])


def test_a_block_another_index_pinned_is_not_evicted(tmp_path):
    """Two indexes over one directory (a second process): one pins a block for a load, the other's
    eviction leaves its file; it drops out of the evicting index only, and comes back at a lookup."""
    writer = DiskTier(tmp_path, 2 * BLOCK_BYTES)
    loader = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(writer, KEYS[0], KEYS[1])
    assert loader.pin_many([KEYS[0]]) == [True]
    put(writer, KEYS[2], KEYS[3])  # evicts K0 and K1 from the writer's index
    assert not writer._path(KEYS[1]).exists() and writer._path(KEYS[0]).exists()
    assert writer.stats.evictions == 1 and writer.num_blocks() == 2
    assert loader.get_many([KEYS[0]]) == [payload(KEYS[0])]
    loader.unpin([KEYS[0]])
    assert writer.contains_many([KEYS[0]]) == [True]  # adopted again, evicting the least recent: K3, the
    assert not writer._path(KEYS[3]).exists()         # tail of the chain K2, K3 (refreshed tail first)


def test_a_lookup_asks_the_file_not_a_stale_index(tmp_path):
    a, b = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(a, KEYS[0])
    assert b.contains_many([KEYS[0]]) == [True]  # indexed by b too
    put(a, KEYS[1], KEYS[2])  # a evicts K0
    assert b.contains_many([KEYS[0]]) == [False] and b.pin_many([KEYS[0]]) == [False]


def test_a_pin_that_loses_the_race_with_an_eviction_is_a_miss(tmp_path):
    """The eviction holds the file's exclusive lock across the unlink: a pin taken then sees it gone."""
    tier = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(tier, KEYS[0])
    path = tier._path(KEYS[0])
    fd = DiskTier._pin_file(path)
    other = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    assert other._remove_unpinned(path) is False and path.exists()  # pinned: stays
    os.close(fd)
    assert other._remove_unpinned(path) is True and not path.exists()
    assert DiskTier._pin_file(path) is None and tier.pin_many([KEYS[0]]) == [False]


def test_the_owner_admits_and_evicts_the_store_writes_and_deletes(tmp_path):
    """vLLM's split: the scheduler's index (the owner) admits what a worker will write, decides the
    evictions (never a block pinned for a load) and hands them over; the worker's store executes."""
    owner = DiskTier(tmp_path, 2 * BLOCK_BYTES)
    owner.hand_deletes_off()
    store = DiskStore(tmp_path)
    owner.admit(KEYS[:2], BLOCK_BYTES)
    assert owner.contains_many(KEYS[:2]) == [False, False]  # admitted, not written yet: misses
    put(store, *KEYS[:2])
    assert owner.contains_many(KEYS[:2]) == [True, True] and store.num_blocks() == 0  # the store keeps no index
    assert owner.pin_many([KEYS[0]]) == [True]
    owner.admit([KEYS[2]], BLOCK_BYTES)
    assert owner.take_deletes() == [KEYS[1]] and owner.take_deletes() == []  # K0 is pinned: K1 goes
    assert store._path(KEYS[1]).exists()  # decided, not done: the store deletes
    assert store.delete_many([KEYS[1]]) == 1 and not store._path(KEYS[1]).exists()
    assert owner.contains_many([KEYS[1]]) == [False] and owner.stats.evictions == 1


def test_a_load_s_pin_is_a_use_in_the_owner_s_lru(tmp_path):
    """The owner never reads (a worker does): the pin a load takes is what refreshes a block."""
    owner = DiskTier(tmp_path, 3 * BLOCK_BYTES)
    owner.hand_deletes_off()
    owner.admit(KEYS[:3], BLOCK_BYTES)
    put(DiskStore(tmp_path), *KEYS[:3])
    assert owner.pin_many([KEYS[2]]) == [True]  # the chain's tail (admitted tail first: least recent)
    owner.unpin([KEYS[2]])
    owner.admit([KEYS[3]], BLOCK_BYTES)
    assert owner.take_deletes() == [KEYS[1]]


def test_an_admitted_block_is_counted_at_its_file_size_once_found(tmp_path):
    """The owner admits at an estimate (the codec's largest block); the lookup that finds the file
    counts its real size, so a compressing codec's smaller files fill the directory."""
    owner = DiskTier(tmp_path, 4 * BLOCK_BYTES)
    owner.admit(KEYS[:2], 2 * BLOCK_BYTES)
    assert owner.used_bytes() == 4 * BLOCK_BYTES
    put(DiskStore(tmp_path), *KEYS[:2])
    assert owner.contains_many(KEYS[:2]) == [True, True] and owner.used_bytes() == 2 * BLOCK_BYTES
    assert owner.admit(KEYS[2:4], BLOCK_BYTES) == [True, True] and owner.stats.evictions == 0


def test_a_store_keeps_a_file_another_process_pinned(tmp_path):
    store = DiskStore(tmp_path, name="shm")
    other = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(store, KEYS[0])
    assert other.pin_many([KEYS[0]]) == [True]
    assert store.delete_many([KEYS[0]]) == 0 and store.get_many([KEYS[0]]) == [payload(KEYS[0])]
    other.unpin([KEYS[0]])
    assert store.delete_many([KEYS[0]]) == 1 and store.contains_many([KEYS[0]]) == [False]


def test_a_bad_block_goes_even_if_pinned(tmp_path):
    """A corrupt file fails every reader's check: `delete` (the manager's, after verify) ignores pins."""
    tier = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(tier, KEYS[0])
    assert tier.pin_many([KEYS[0]]) == [True] and tier.delete(KEYS[0])
    assert not tier._path(KEYS[0]).exists()
    tier.unpin([KEYS[0]])


# -- several processes on one directory -----------------------------------------------------------------

HAMMER_KEYS = [i.to_bytes(16, "big") for i in range(1, 41)]


def _hammer(directory: str, seed: int, seconds: float, capacity_blocks: int, results) -> None:
    """Writes, pinned loads, plain reads and start-ups (a fresh index: the scan, its cleanup and its
    over-capacity eviction) in random order, on a directory far smaller than the keys written to it."""
    rng = random.Random(seed)
    counts: Counter = Counter()
    tier = DiskTier(directory, capacity_blocks * BLOCK_BYTES)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            keys = rng.sample(HAMMER_KEYS, 4)
            op = rng.random()
            if op < 0.45:
                put(tier, *keys)
            elif op < 0.75:
                pinned = [key for key, held in zip(keys, tier.pin_many(keys)) if held]
                time.sleep(0.001)  # the other processes write and evict meanwhile
                read = tier.lease_many if rng.random() < 0.5 else tier.get_many
                for key, data in zip(pinned, read(pinned)):
                    counts["pinned_lost" if data is None else "wrong" if bytes(data) != payload(key)
                           else "pinned_read"] += 1
                tier.release(pinned)
                tier.unpin(pinned)
            elif op < 0.97:
                for key, data in zip(keys, tier.get_many(keys)):
                    if data is not None:
                        counts["wrong" if data != payload(key) else "read"] += 1
            else:
                counts["errors"] += tier.stats.errors
                counts["evictions"] += tier.stats.evictions
                tier.close()
                tier = DiskTier(directory, capacity_blocks * BLOCK_BYTES)
                counts["startups"] += 1
        counts["errors"] += tier.stats.errors
        counts["evictions"] += tier.stats.evictions
        counts["leaked_pins"] += len(tier._pin_fds)
    finally:
        tier.close()
        results.put(dict(counts))


@pytest.fixture(params=["ssd", "shm"])
def shared_dir(request, tmp_path):
    """A directory on disk, or under /dev/shm (the `shm:` tier's RAM file system)."""
    if request.param == "ssd":
        yield tmp_path
        return
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    directory = Path("/dev/shm") / f"kvtier-test-{os.getpid()}-{time.time_ns()}"
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_processes_hammering_one_directory_lose_no_pinned_block_and_serve_no_wrong_one(shared_dir):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(str(shared_dir), seed, 2.0, 6, results)) for seed in range(3)]
    for proc in procs:
        proc.start()
    counts: Counter = Counter()
    for _ in procs:
        counts.update(results.get(timeout=60))
    for proc in procs:
        proc.join(timeout=10)
        assert proc.exitcode == 0
    assert counts["wrong"] == 0 and counts["pinned_lost"] == 0, counts
    assert counts["errors"] == 0 and counts["leaked_pins"] == 0, counts
    # the race was run: pinned loads read under eviction pressure and start-ups in between
    assert counts["pinned_read"] > 100 and counts["evictions"] > 100 and counts["startups"] > 0, counts
    assert not list(shared_dir.glob("*/*.tmp"))  # every write reached its name or removed its own file
