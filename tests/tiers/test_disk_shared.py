"""One block directory, several indexes: independent processes (two servers, a second `kvtier generate`)
and vLLM's owner / store split. No process deletes a block another has pinned for a load; no read
returns a block other than the one its key names."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from kvtier.tiers import DiskStore, DiskTier, disk
from kvtier.transfer.executor import transfer_executor

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


def test_a_file_an_eviction_left_pinned_goes_at_a_later_pass(tmp_path):
    """The evicting index keeps the pinned file as a leftover (counted in `leftover_bytes`) and deletes it at
    its next eviction pass once the pin is gone: no file stays that no index counts."""
    writer, loader = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(writer, KEYS[0], KEYS[1])
    assert loader.pin_many([KEYS[1]]) == [True]
    put(writer, KEYS[2], KEYS[3])
    assert writer.leftover_bytes() == BLOCK_BYTES and writer._path(KEYS[1]).exists()
    put(writer, KEYS[4])  # still pinned: stays
    assert writer.leftover_bytes() == BLOCK_BYTES and writer._path(KEYS[1]).exists()
    loader.unpin([KEYS[1]])
    evictions = writer.stats.evictions
    put(writer, KEYS[5])  # evicts one, and the leftover goes with it
    assert writer.leftover_bytes() == 0 and not writer._path(KEYS[1]).exists()
    assert writer.stats.evictions == evictions + 2
    assert sorted(tmp_path.glob("*/*.kvb")) == sorted(writer._path(k) for k in (KEYS[4], KEYS[5]))


def test_an_eviction_pass_tries_a_bounded_number_of_leftovers_oldest_first_and_close_tries_all(tmp_path, monkeypatch):
    """A pass's cost does not grow with the leftovers: at most `LEFTOVERS_PER_PASS` are tried again, the
    oldest first, one still pinned going back to the end; `close` tries every one."""
    monkeypatch.setattr(disk, "LEFTOVERS_PER_PASS", 3)
    keys = [i.to_bytes(16, "big") for i in range(300, 308)]
    writer, loader = DiskTier(tmp_path, 1 * BLOCK_BYTES), DiskTier(tmp_path, 16 * BLOCK_BYTES)
    for key in keys:  # each put evicts the one before, which the loader pinned: 7 leftovers
        put(writer, key)
        assert loader.pin_many([key]) == [True]
    assert writer.leftover_bytes() == 7 * BLOCK_BYTES
    order = list(writer._recheck)  # oldest first
    pinned = order[1]
    loader.unpin([key for key in keys[:7] if key != pinned])
    tried = []
    remove_unpinned = writer._remove_unpinned
    monkeypatch.setattr(writer, "_remove_unpinned", lambda key: tried.append(key) or remove_unpinned(key))
    writer._evict([])
    assert tried == order[:3]  # three, the oldest; one of them still pinned
    assert writer.leftover_bytes() == 5 * BLOCK_BYTES and writer._path(pinned).exists()
    tried.clear()
    writer._evict([])
    assert tried == order[3:6]  # the next three: the pinned one went to the end
    loader.unpin([pinned])
    tried.clear()
    writer.close()
    assert tried == [order[6], pinned] and writer.leftover_bytes() == 0
    assert sorted(tmp_path.glob("*/*.kvb")) == [writer._path(keys[7])]


def test_a_leftover_indexed_again_is_not_deleted(tmp_path):
    writer, loader = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(writer, KEYS[0])
    assert loader.pin_many([KEYS[0]]) == [True]
    put(writer, KEYS[1], KEYS[2])
    assert writer.leftover_bytes() == BLOCK_BYTES
    loader.unpin([KEYS[0]])
    assert writer.contains_many([KEYS[0]]) == [True]  # adopted: counted again, evicting K2 (the chain's tail)
    assert writer.leftover_bytes() == 0 and writer._path(KEYS[0]).exists() and not writer._path(KEYS[2]).exists()


def test_a_start_up_s_leftovers_and_close_s_last_try(tmp_path):
    """A start-up over a directory larger than its capacity leaves pinned files as leftovers; `close` tries
    them once more."""
    put(DiskTier(tmp_path, 8 * BLOCK_BYTES), *KEYS[:3])
    loader = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    assert loader.pin_many(KEYS[:2]) == [True, True]
    small = DiskTier(tmp_path, BLOCK_BYTES)  # keeps the most recent (K0: the chain's root), evicts K1, K2
    assert small.leftover_bytes() == BLOCK_BYTES and not small._path(KEYS[2]).exists()
    loader.unpin(KEYS[:2])
    small.close()
    assert [small._path(key).exists() for key in KEYS[:3]] == [True, False, False]


def test_an_owner_s_start_up_leftovers_are_handed_off_with_its_first_deletes(tmp_path):
    put(DiskTier(tmp_path, 8 * BLOCK_BYTES), *KEYS[:2])
    loader = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    assert loader.pin_many([KEYS[1]]) == [True]
    owner = DiskTier(tmp_path, BLOCK_BYTES)  # keeps K0 (the root, most recent); K1 pinned: a leftover
    owner.hand_deletes_off()
    assert owner.take_deletes() == [KEYS[1]] and owner.leftover_bytes() == 0


def test_an_owner_hands_a_refused_delete_off_again_until_the_file_goes(tmp_path, monkeypatch):
    """vLLM's split: the store cannot delete a file another process pinned; the owner sees it still there
    (and in no index of its own) at a later `take_deletes` and hands it off again, until it goes."""
    monkeypatch.setattr(disk, "SHIPPED_RECHECK_SECONDS", 0.0)
    owner, store = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskStore(tmp_path)
    owner.hand_deletes_off()
    other = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    owner.admit(KEYS[:2], BLOCK_BYTES)
    put(store, *KEYS[:2])
    assert other.pin_many([KEYS[1]]) == [True]
    owner.admit([KEYS[2]], BLOCK_BYTES)
    assert owner.take_deletes() == [KEYS[1]] and store.delete_many([KEYS[1]]) == 0
    assert owner.take_deletes() == [KEYS[1]] and store.delete_many([KEYS[1]]) == 0  # still pinned
    other.unpin([KEYS[1]])
    assert owner.take_deletes() == [KEYS[1]] and store.delete_many([KEYS[1]]) == 1
    assert owner.take_deletes() == [] and not store._path(KEYS[1]).exists()
    assert owner.stats.evictions == 1  # one eviction, handed off three times


def test_an_owner_looks_again_at_a_bounded_number_of_handed_off_keys_per_call_in_turn(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "SHIPPED_RECHECK_SECONDS", 0.0)
    monkeypatch.setattr(disk, "SHIPPED_CHECKS_PER_CALL", 2)
    owner = DiskTier(tmp_path, BLOCK_BYTES)
    owner.hand_deletes_off()
    put(DiskStore(tmp_path), *KEYS[:4])  # written, never deleted: each is handed off again when looked at
    for key in KEYS[:4]:
        owner.admit([key], BLOCK_BYTES)
    assert owner.take_deletes() == KEYS[:3]
    assert owner.take_deletes() == KEYS[:2] and owner.take_deletes() == [KEYS[2], KEYS[0]]


def test_a_key_indexed_again_in_the_step_it_was_evicted_is_not_handed_off_nor_any_key_twice(tmp_path):
    owner, store = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskStore(tmp_path)
    owner.hand_deletes_off()
    owner.admit([KEYS[0]], BLOCK_BYTES)
    owner.admit([KEYS[1]], BLOCK_BYTES)  # K0 least recent
    put(store, *KEYS[:2], KEYS[5])
    owner.hand_off_next([KEYS[5]])  # written unadmitted: handed off at the call after the next
    assert owner.take_deletes() == []
    owner.admit([KEYS[2]], BLOCK_BYTES)  # evicts K0 ...
    assert owner.admit([KEYS[0]], BLOCK_BYTES) == [True]  # ... admitted again in the same step (evicts K1)
    assert owner.admit([KEYS[5]], BLOCK_BYTES) == [True]  # K5 indexed (evicts K2, not written yet) ...
    owner.touch_many([KEYS[0]])
    owner.admit([KEYS[6]], BLOCK_BYTES)  # ... and evicted again: handed off for both reasons, once
    assert owner.take_deletes() == [KEYS[1], KEYS[5]]  # not K0: its file is the owner's again
    assert owner.take_deletes() == [KEYS[2]]  # a step later: its write may be to come (as K6's)


def test_the_handed_off_keys_looked_at_again_stay_bounded_at_many_evictions_a_step(tmp_path, monkeypatch):
    """More evictions a step than `SHIPPED_CHECKS_PER_CALL`: at least as many leave the retry list as join."""
    monkeypatch.setattr(disk, "SHIPPED_RECHECK_SECONDS", 0.0)
    n = 3 * disk.SHIPPED_CHECKS_PER_CALL
    owner = DiskTier(tmp_path, n * BLOCK_BYTES)
    owner.hand_deletes_off()
    sizes = []
    for step in range(12):  # each step's blocks evict the last step's (their files gone: the deleter's done)
        owner.admit([(step * n + i).to_bytes(16, "big") for i in range(n)], BLOCK_BYTES)
        assert len(owner.take_deletes()) == (n if step else 0)
        sizes.append(len(owner._recheck))
    assert max(sizes) <= 2 * n and sizes[-1] == sizes[-2]


def test_the_retry_list_forgets_its_oldest_past_its_limit_counted_and_logged(tmp_path, monkeypatch, caplog):
    """Files that never go (a deleter that never deletes them) are looked at again forever: the list keeps
    `RECHECK_LIMIT`, the oldest forgotten (counted, one warning)."""
    monkeypatch.setattr(disk, "SHIPPED_RECHECK_SECONDS", 0.0)
    monkeypatch.setattr(disk, "RECHECK_LIMIT", 8)
    owner = DiskTier(tmp_path, BLOCK_BYTES)
    owner.hand_deletes_off()
    keys = [i.to_bytes(16, "big") for i in range(1, 21)]
    put(DiskStore(tmp_path), *keys)  # every file stays
    with caplog.at_level("WARNING", logger=disk.__name__):
        for key in keys:  # each admission evicts the last one
            owner.admit([key], BLOCK_BYTES)
            owner.take_deletes()
    assert len(owner._recheck) == 8 and owner.rechecks_dropped == 19 - 8
    assert set(owner._recheck) < set(keys[:19])  # evicted ones (K19 is indexed)
    assert sum("forgetting the oldest" in r.message for r in caplog.records) == 1


def test_a_delete_behind_the_writes_removes_a_late_write_and_keeps_a_write_queued_after_it(tmp_path, monkeypatch):
    """vLLM's worker queues a save on the writes lane; the owner evicts the key meanwhile. The store's delete
    runs on the lane (`delete_behind_writes`): behind the write queued before it, so the file goes once it
    lands, however late (no watch in the owner: a key whose file is gone is forgotten), and ahead of a write
    queued after it (the key admitted again), which stays."""
    monkeypatch.setattr(disk, "SHIPPED_RECHECK_SECONDS", 0.0)
    owner, store = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskStore(tmp_path)
    owner.hand_deletes_off()
    owner.admit(KEYS[:2], BLOCK_BYTES)
    assert owner.take_deletes() == []  # the step ends: its writes are queued
    put(store, KEYS[0], KEYS[3])  # K3: an old file of a key evicted before
    lane, gate = transfer_executor(), threading.Event()
    try:
        assert lane.write(lambda: gate.wait(10))  # a slow lane
        assert lane.write(lambda: put(store, KEYS[1]))  # K1's write, queued before its eviction
        owner.admit([KEYS[2]], BLOCK_BYTES)
        assert owner.take_deletes() == [KEYS[1]]
        deleted = store.delete_behind_writes([KEYS[1], KEYS[3]])
        assert lane.write(lambda: put(store, KEYS[3]))  # K3 admitted again, written after its delete
        assert not deleted.done() and store._path(KEYS[3]).exists()  # nothing deleted ahead of the lane
    finally:
        gate.set()
    assert deleted.result(timeout=10) == 2  # K1 once it landed, K3's old file
    assert store.delete_many([KEYS[4]]) == 0  # files that went are counted, not keys told
    lane.after_writes(lambda: None).result(timeout=10)  # every write queued so far has run
    assert not store._path(KEYS[1]).exists() and store.get_many([KEYS[3]]) == [payload(KEYS[3])]
    assert owner.take_deletes() == [] and owner._recheck == {}  # K1 gone: forgotten


def test_a_write_running_when_its_delete_comes_is_removed_once_placed(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    placing, go = threading.Event(), threading.Event()
    place = disk._place

    def slow_place(tmp, path):
        placing.set()
        go.wait(10)
        place(tmp, path)

    monkeypatch.setattr(disk, "_place", slow_place)
    try:
        assert transfer_executor().write(lambda: put(store, KEYS[0]))
        assert placing.wait(10)
        deleted = store.delete_behind_writes([KEYS[0]])
        assert store.delete_many([KEYS[0]]) == 0  # a delete now finds nothing yet
    finally:
        go.set()
    assert deleted.result(timeout=10) == 1 and not store._path(KEYS[0]).exists()  # behind the write


def test_a_block_written_unadmitted_or_evicted_as_it_was_admitted_is_handed_off_a_step_later(tmp_path):
    """The other process queues the writes of a step with that step: what a step sent down, a block the owner
    did not admit (vLLM writes a block through to every directory once one took it) and a load's promotion.
    A delete of such a block goes out with the next step, behind its write; a key indexed meanwhile is kept."""
    owner = DiskTier(tmp_path, 2 * BLOCK_BYTES)
    owner.hand_deletes_off()
    assert owner.admit(KEYS[:3], BLOCK_BYTES) == [True, True, False]  # a chain keeps its first blocks
    owner.hand_off_next([KEYS[2]])  # written all the same
    assert owner.take_deletes() == [] and owner.take_deletes() == [KEYS[2]]
    owner.admit([KEYS[3]], BLOCK_BYTES)  # a promotion, admitted at its allocation (evicts K1) ...
    assert owner.admit(KEYS[4:6], BLOCK_BYTES) == [True, True]  # ... and evicted by the step's saves
    assert owner.take_deletes() == [KEYS[1], KEYS[0]] and owner.take_deletes() == [KEYS[3]]
    owner.hand_off_next([KEYS[6]])
    assert owner.take_deletes() == []
    assert owner.admit([KEYS[6]], BLOCK_BYTES) == [True]  # indexed since: counted, not deleted
    assert owner.take_deletes() == [KEYS[5]]


def test_a_lookup_asks_the_file_not_a_stale_index(tmp_path):
    a, b = DiskTier(tmp_path, 2 * BLOCK_BYTES), DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(a, KEYS[0])
    assert b.contains_many([KEYS[0]]) == [True]  # indexed by b too
    put(a, KEYS[1], KEYS[2])  # a evicts K0
    assert b.contains_many([KEYS[0]]) == [False] and b.pin_many([KEYS[0]]) == [False]


def test_a_pin_that_loses_the_race_with_an_eviction_is_a_miss(tmp_path):
    """The eviction holds the block's exclusive lock across the unlink: a pin tried meanwhile is refused,
    one tried after finds the file gone."""
    tier = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(tier, KEYS[0])
    path = tier._path(KEYS[0])
    other = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    assert other.pin_many([KEYS[0]]) == [True]
    assert tier._remove_unpinned(KEYS[0]) is False and path.exists()  # pinned: stays
    other.unpin([KEYS[0]])
    during = []

    def remove() -> None:
        during.append(other.pin_many([KEYS[0]]))
        path.unlink()

    assert tier._locks.evict(KEYS[0], remove) and during == [[False]]
    assert other.pin_many([KEYS[0]]) == [False] and other._locks.num_pinned() == 0 and not path.exists()


def test_two_pins_of_one_index_hold_until_the_last_unpin(tmp_path):
    tier, other = DiskTier(tmp_path, 8 * BLOCK_BYTES), DiskTier(tmp_path, 8 * BLOCK_BYTES)
    put(tier, KEYS[0])
    assert other.pin_many([KEYS[0]]) == [True] and other.pin_many([KEYS[0]]) == [True]
    other.unpin([KEYS[0]])
    assert tier._locks.pinned_elsewhere(KEYS[0]) and tier._remove_unpinned(KEYS[0]) is False
    assert other._remove_unpinned(KEYS[0]) is False  # nor by the index that pins it (its own lock would yield)
    assert tier._locks.pinned_elsewhere(KEYS[0])
    other.unpin([KEYS[0]])
    assert not tier._locks.pinned_elsewhere(KEYS[0]) and tier._remove_unpinned(KEYS[0]) is True


def _pin_under_a_low_descriptor_limit(directory: str, keys: list[bytes], pinned, go, results) -> None:
    """A process allowed 64 open files (the old one-descriptor-per-pin budget: 16) pins 100 keys and reads
    each after the other process's evictions."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    tier = DiskTier(directory, len(keys) * BLOCK_BYTES)
    fds_before = len(os.listdir("/proc/self/fd"))
    held = tier.pin_many(keys)
    fds_pinned = len(os.listdir("/proc/self/fd"))
    pinned.set()
    go.wait(60)
    data = tier.get_many(keys)
    tier.unpin(keys)
    results.put((held, fds_pinned - fds_before, [d == payload(k) for k, d in zip(keys, data)]))
    tier.close()


def test_a_process_holds_more_pins_than_it_has_descriptors_and_every_one_survives_another_s_evictions(tmp_path):
    keys = [i.to_bytes(16, "big") for i in range(100, 200)]
    writer = DiskTier(tmp_path, 200 * BLOCK_BYTES)
    put(writer, *keys)
    writer.close()
    ctx = multiprocessing.get_context("spawn")
    pinned, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_pin_under_a_low_descriptor_limit, args=(str(tmp_path), keys, pinned, go, results))
    proc.start()
    assert pinned.wait(60)
    evicter = DiskTier(tmp_path, 4 * BLOCK_BYTES)  # its start-up evicts all but 4 of the 100: none goes
    put(evicter, *HAMMER_KEYS[:8])  # and its writes evict: every pinned file stays
    assert all(evicter._path(key).exists() for key in keys)
    assert evicter.leftover_bytes() == 100 * BLOCK_BYTES and evicter.num_blocks() == 4
    go.set()
    held, num_fds, read_ok = results.get(timeout=60)
    proc.join(timeout=10)
    assert proc.exitcode == 0 and held == [True] * 100 and read_ok == [True] * 100
    assert num_fds <= disk.LOCK_FILES  # 100 pins, a descriptor per lock file at most (old: one per pin)
    put(evicter, *HAMMER_KEYS[8:10])  # unpinned now: the next eviction pass deletes what stayed
    assert evicter.leftover_bytes() == 0 and not any(evicter._path(key).exists() for key in keys)
    assert len(list(tmp_path.glob("*/*.kvb"))) == evicter.num_blocks() == 4


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


HAMMER_MIN = {"pinned_read": 40, "evictions": 40, "startups": 1}  # per process: the race was run
HAMMER_MAX_SECONDS = 60.0  # a busy box takes longer to get there; never longer than this


def _hammer(directory: str, seed: int, seconds: float, capacity_blocks: int, results) -> None:
    """Writes, pinned loads, plain reads and start-ups (a fresh index: the scan, its cleanup and its
    over-capacity eviction) in random order, on a directory far smaller than the keys written to it: for
    `seconds`, and on until this process did `HAMMER_MIN` of each (a slow box's run is not a shorter race)."""
    rng = random.Random(seed)
    counts: Counter = Counter()
    tier = DiskTier(directory, capacity_blocks * BLOCK_BYTES)
    start = time.monotonic()

    def racing() -> bool:
        elapsed = time.monotonic() - start
        done = {**counts, "evictions": counts["evictions"] + tier.stats.evictions}
        short = any(done.get(name, 0) < least for name, least in HAMMER_MIN.items())
        return elapsed < seconds or (short and elapsed < HAMMER_MAX_SECONDS)

    try:
        while racing():
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
        counts["leaked_pins"] += len(tier._pins) + tier._locks.num_pinned()
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
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert counts["wrong"] == 0 and counts["pinned_lost"] == 0, counts
    assert counts["errors"] == 0 and counts["leaked_pins"] == 0, counts
    # the race was run: pinned loads read under eviction pressure and start-ups in between
    assert counts["pinned_read"] > 100 and counts["evictions"] > 100 and counts["startups"] > 0, counts
    assert not list(shared_dir.glob("*/*.tmp"))  # every write reached its name or removed its own file


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.EINVAL])
def test_a_file_system_that_refuses_byte_range_locks_degrades_to_in_process_pins(tmp_path, monkeypatch, error):
    """NFS without lockd, a file system without OFD locks: a lock call fails with another error than a held
    byte. Pins then hold in this index only (a hit stays a hit), evictions delete without a lock, and no
    victim stays in flux (a stuck key would be neither held nor adoptable, its file never counted)."""
    tier = DiskTier(tmp_path, 2 * BLOCK_BYTES)
    put(tier, KEYS[0], KEYS[1])

    def refuse(*args):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(disk._BlockLocks, "_lock", staticmethod(refuse))
    assert tier.pin_many([KEYS[0]]) == [True]  # in this index
    put(tier, KEYS[2], KEYS[3])  # evicts K1 (K0 pinned here) and then what the room needs
    assert tier.contains_many([KEYS[0]]) == [True] and tier.get_many([KEYS[0]]) == [payload(KEYS[0])]
    assert not tier._in_flux
    tier.unpin([KEYS[0]])
    put(tier, KEYS[4], KEYS[5], KEYS[6])
    assert not tier._in_flux and tier.leftover_bytes() == 0
    on_disk = {p.name.removesuffix(".kvb") for p in tmp_path.rglob("*.kvb")}
    held = [key for key in KEYS if tier.contains_many([key]) == [True]]
    assert len(held) == 2 and on_disk == {key.hex() for key in held}  # exactly what the index holds
    tier.close()


def test_a_platform_without_ofd_locks_pins_in_process(tmp_path, monkeypatch, caplog):
    """macOS has `fcntl` but no `F_OFD_SETLK`: the directory works as one that refuses locks (pins hold in
    this index, evictions take no lock), said once, never an AttributeError at the first pin."""
    monkeypatch.delattr(disk.fcntl, "F_OFD_SETLK")
    tier = DiskTier(tmp_path, 2 * BLOCK_BYTES)
    put(tier, KEYS[0], KEYS[1])
    assert tier.pin_many([KEYS[0]]) == [True]
    put(tier, KEYS[2])  # evicts K1, not the pinned K0
    assert tier.contains_many(KEYS[:3]) == [True, False, True]
    tier.unpin([KEYS[0]])
    assert "refuses byte-range locks" in caplog.text
    tier.close()


def test_a_platform_without_fcntl_imports_the_tier_and_pins_in_process(tmp_path):
    """Windows has no `fcntl` module: the tier imports, and the directory works as one without OFD locks (pins
    hold in this index, evictions take no lock), said once."""
    code = textwrap.dedent("""
        import sys
        sys.modules["fcntl"] = None  # `import fcntl` raises ImportError, as where there is none
        from kvtier.tiers import disk
        assert disk.fcntl is None
        keys = [bytes([i]) * 16 for i in range(1, 4)]
        block = {key: key * 6 for key in keys}
        tier = disk.DiskTier(sys.argv[1], 2 * 96)
        tier.put_many([(key, block[key]) for key in keys[:2]])
        assert tier.get_many(keys[:2]) == [block[key] for key in keys[:2]]
        assert tier.pin_many([keys[0]]) == [True]
        tier.put_many([(keys[2], block[keys[2]])])  # evicts K1, not the pinned K0
        assert tier.contains_many(keys) == [True, False, True]
        tier.unpin([keys[0]])
        tier.close()
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr
    assert run.stderr.count("refuses byte-range locks") == 1
