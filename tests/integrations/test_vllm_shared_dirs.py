"""The connector's shared directories have one owner: the scheduler side admits what the workers write,
decides evictions (never a block pinned for a load) and ships them in the step's records; the worker's
directory is a plain file store that deletes what it is told."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.scheduler import SchedulerSide, deletes_for_rank
from kvtier.integrations.vllm.trackers import SaveSpec, shard_keys
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers import DiskStore, DiskTier, disk, make_tier
from kvtier.tiers.manager import TierManager, build_manager
from kvtier.transfer.executor import transfer_executor

L, H, T, D, NUM_BLOCKS = 2, 1, 4, 8, 12
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=T)
SPACE = KeySpace("fp", LAYOUT, "raw")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
BLOCK_BYTES = get_codec("raw").max_encoded_bytes(LAYOUT)


def request(req_id: str, token_ids: list[int]):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(token_ids), cache_salt=None, lora_request=None,
                           num_computed_tokens=0)


@pytest.fixture
def sides(tmp_path):
    """A scheduler owning a 3-block directory, and a worker whose copy of it is a store."""
    spec = f"ssd:{tmp_path}:{3 * BLOCK_BYTES}"
    scheduler = SchedulerSide(SPACE, build_manager([spec], slot_bytes=BLOCK_BYTES, async_writes=False),
                              block_bytes=BLOCK_BYTES)
    worker_manager = TierManager([make_tier(spec, slot_bytes=BLOCK_BYTES, owner=False)], async_writes=False)
    stores = {tier.name: tier for tier in worker_manager.tiers if isinstance(tier, DiskStore)}
    worker = WorkerSide(LAYOUT, get_codec("raw"), worker_manager, stores=stores)
    caches = {name: torch.randn(NUM_BLOCKS, H, T, 2 * D) for name in NAMES}
    worker.register(caches, lambda name: int(name.split(".")[2]))
    yield scheduler, worker, stores["ssd"]
    worker.shutdown()
    scheduler.manager.close()
    worker_manager.close()


def step(scheduler: SchedulerSide, worker: WorkerSide, req, block_ids: list[int]):
    """One step that computes `req`'s whole prompt: the records cross to the worker, which executes them."""
    records = scheduler.build_records({req.request_id: len(req.all_token_ids)}, lambda _: block_ids)
    worker.delete(records.deletes)
    worker.begin_step(records.saves)
    worker.finish_save()
    worker.wait_saves()
    worker._loader.submit(lambda: None).result()  # its loads ran (the deletes: at `delete`, no writes thread here)
    return records


def test_the_schedulers_evictions_reach_the_worker_through_the_step_records(sides, tmp_path):
    scheduler, worker, store = sides
    first = request("r1", list(range(3 * T + 1)))  # 3 full blocks
    scheduler.num_matched_tokens(first, 0)
    scheduler.after_alloc(first, [0, 1, 2, 3], 0)
    records = step(scheduler, worker, first, [0, 1, 2, 3])
    keys = records.saves[0].keys
    assert len(keys) == 3 and records.deletes == {}
    assert all(store._path(key).exists() for key in keys)
    again = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(again, 0) == 3 * T
    scheduler.after_alloc(again, [4, 5, 6, 7], 3 * T)  # the load's blocks are pinned until it is done
    other = request("r3", [100 + t for t in range(2 * T + 1)])
    scheduler.after_alloc(other, [8, 9, 10], 0)
    records = step(scheduler, worker, other, [8, 9, 10])
    # every block of the index is pinned: the new ones are not admitted, so not written; nothing deleted
    assert records.saves == [] and records.deletes == {} and len(records.loads) == 1
    assert len(list(tmp_path.glob("*/*.kvb"))) == 3
    scheduler.loaded_from({"r2": ["ssd"] * 3})  # the worker reported the load: unpinned
    fourth = request("r4", [200 + t for t in range(2 * T + 1)])
    scheduler.after_alloc(fourth, [8, 9, 10], 0)
    records = step(scheduler, worker, fourth, [8, 9, 10])
    # decided by the scheduler's LRU, which took r1's chain tail first: its tail goes first ...
    assert records.deletes == {"ssd": [keys[2], keys[1]]}
    assert [store._path(key).exists() for key in keys] == [True, False, False]  # ... done by the worker
    assert sorted(p.name for p in tmp_path.glob("*/*.kvb")) == sorted(
        store._path(key).name for key in [keys[0], *records.saves[0].keys])
    assert worker.take_stats()["deleted_blocks"] == 2
    assert scheduler.num_matched_tokens(request("r5", list(range(3 * T + 1))), 0) == T  # the root still matches


def test_a_request_s_later_blocks_keep_its_root_the_most_recent(sides, tmp_path):
    """A turn that loads its prefix and sends new blocks down refreshes its whole chain tail first, so a full
    directory evicts the chain's last block, not its root (which would strand the rest)."""
    scheduler, worker, store = sides
    first = request("r1", list(range(T + 1)))
    scheduler.after_alloc(first, [0, 1], 0)
    step(scheduler, worker, first, [0, 1])
    turn = request("r2", list(range(3 * T + 1)))  # r1's block, then two more
    assert scheduler.num_matched_tokens(turn, 0) == T
    scheduler.after_alloc(turn, [2, 3, 4, 5], T)
    assert len(step(scheduler, worker, turn, [2, 3, 4, 5]).saves[0].keys) == 2
    scheduler.loaded_from({"r2": ["ssd"]})
    other = request("r3", [100 + t for t in range(T + 1)])
    scheduler.after_alloc(other, [6, 7], 0)
    step(scheduler, worker, other, [6, 7])  # the directory holds 3: one block of r2's chain goes
    assert scheduler.num_matched_tokens(request("r4", list(range(3 * T + 1))), 0) == 2 * T


def test_a_load_pins_its_files_against_every_process_until_done(sides, tmp_path):
    """Another process's index (a second server on the directory) cannot evict what the scheduler
    pinned for a load, until the load is reported done (or the request ends)."""
    scheduler, worker, store = sides
    first = request("r1", list(range(T + 1)))
    scheduler.after_alloc(first, [0, 1], 0)
    key = step(scheduler, worker, first, [0, 1]).saves[0].keys[0]
    again = request("r2", list(range(T + 1)))
    assert scheduler.num_matched_tokens(again, 0) == T
    scheduler.after_alloc(again, [2, 3], T)
    assert store.delete_many([key]) == 0 and store._path(key).exists()  # pinned (a file lock)
    scheduler.finished("r2")
    assert store.delete_many([key]) == 1


def test_a_step_larger_than_a_directory_still_reaches_the_larger_one(tmp_path):
    """shm holds 2 blocks, the SSD 8: a step sending 3 keeps all 3 (the SSD took them); shm's index
    keeps the chain's first 2 (the third never evicts them) and deletes nothing."""
    tiers = [f"shm:{tmp_path / 'shm'}:{2 * BLOCK_BYTES}", f"ssd:{tmp_path / 'ssd'}:{8 * BLOCK_BYTES}"]
    scheduler = SchedulerSide(SPACE, build_manager(tiers, slot_bytes=BLOCK_BYTES, async_writes=False),
                              block_bytes=BLOCK_BYTES)
    req = request("r1", list(range(3 * T + 1)))
    scheduler.after_alloc(req, [0, 1, 2, 3], 0)
    records = scheduler.build_records({"r1": 3 * T + 1}, lambda _: [0, 1, 2, 3])
    keys = records.saves[0].keys
    assert len(keys) == 3 and records.saves[0].block_ids == [0, 1, 2]
    assert records.deletes == {}
    assert [key in scheduler.manager.tiers[0]._lru for key in keys] == [True, True, False]
    scheduler.manager.close()


def test_a_block_written_to_a_directory_that_did_not_admit_it_is_deleted_there(tmp_path):
    """The worker writes a step's blocks through to every directory once any took them: shm (2 blocks)
    did not take the third, so its file there is in no index; the scheduler ships its delete with the next
    step (after the worker queued the write: `DiskStore.delete_many` removes one that lands later)."""
    tiers = [f"shm:{tmp_path / 'shm'}:{2 * BLOCK_BYTES}", f"ssd:{tmp_path / 'ssd'}:{8 * BLOCK_BYTES}"]
    scheduler = SchedulerSide(SPACE, build_manager(tiers, slot_bytes=BLOCK_BYTES, async_writes=False),
                              block_bytes=BLOCK_BYTES)
    req = request("r1", list(range(3 * T + 1)))
    scheduler.after_alloc(req, [0, 1, 2, 3], 0)
    keys = scheduler.build_records({"r1": 3 * T + 1}, lambda _: [0, 1, 2, 3]).saves[0].keys
    shm = DiskStore(tmp_path / "shm", name="shm")
    shm.put_many([(key, bytes(BLOCK_BYTES)) for key in keys])  # the worker's write-through (queued that step)
    assert scheduler.build_records({}, lambda _: []).deletes == {"shm": [keys[2]]}
    assert shm.delete_many([keys[2]]) == 1
    assert scheduler.build_records({}, lambda _: []).deletes == {}
    assert sorted(p.name for p in (tmp_path / "shm").glob("*/*.kvb")) == sorted(shm._path(k).name for k in keys[:2])
    scheduler.manager.close()


def test_blocks_a_load_takes_from_below_are_admitted_into_the_directory_the_worker_promotes_them_into(tmp_path):
    """The worker's manager copies what a read found below its top tier into it (shm here): the
    scheduler counts those copies in shm's index too, so shm's evictions keep it at its size."""
    tiers = [f"shm:{tmp_path / 'shm'}:{2 * BLOCK_BYTES}", f"ssd:{tmp_path / 'ssd'}:{8 * BLOCK_BYTES}"]
    manager = build_manager(tiers, slot_bytes=BLOCK_BYTES, async_writes=False)
    scheduler = SchedulerSide(SPACE, manager, block_bytes=BLOCK_BYTES, promote_into="shm")
    shm, ssd = manager.tiers
    first = request("r1", list(range(3 * T + 1)))
    scheduler.after_alloc(first, [0, 1, 2, 3], 0)
    keys = scheduler.build_records({"r1": 3 * T + 1}, lambda _: [0, 1, 2, 3]).saves[0].keys
    other = request("r0", [100 + t for t in range(2 * T + 1)])  # fills shm: r1's chain goes, tail first
    scheduler.after_alloc(other, [8, 9, 10], 0)
    records = scheduler.build_records({"r0": 2 * T + 1}, lambda _: [8, 9, 10])
    other_keys = records.saves[0].keys
    # and r1's third block, written to shm unadmitted (the SSD took it): deleted a step after its write
    assert records.deletes == {"shm": [keys[1], keys[0], keys[2]]}
    store = DiskStore(tmp_path / "ssd")
    store.put_many([(key, bytes(BLOCK_BYTES)) for key in keys])  # only the SSD holds them (shm dropped them)
    again = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(again, 0) == 3 * T
    scheduler.after_alloc(again, [4, 5, 6, 7], 3 * T)
    # shm's index took the copies: the chain's first 2 (the third never evicts them), r0's blocks going tail first
    assert scheduler.build_records({}, lambda _: []).deletes == {"shm": [other_keys[1], other_keys[0]]}
    assert [key in shm._lru for key in keys] == [True, True, False] and shm.used_bytes() == 2 * BLOCK_BYTES
    # the third is promoted all the same: its delete follows the step of the load that copies it
    assert scheduler.build_records({}, lambda _: []).deletes == {"shm": [keys[2]]}
    manager.close()


def test_tensor_parallel_shards_of_a_block_are_evicted_together_tail_first(tmp_path):
    """Two ranks, a directory of 4 files: chain A (2 blocks, 4 files) then chain B (1 block) evicts both
    shards of A's last block, so A still matches its first block (every rank holds it)."""
    scheduler = SchedulerSide(SPACE, build_manager([f"ssd:{tmp_path}:{4 * BLOCK_BYTES}"], slot_bytes=BLOCK_BYTES,
                                                   async_writes=False), world_size=2, block_bytes=BLOCK_BYTES)
    store = DiskStore(tmp_path)
    for req in (request("a", list(range(2 * T + 1))), request("b", [100 + t for t in range(T + 1)])):
        scheduler.after_alloc(req, [0, 1, 2], 0)
        records = scheduler.build_records({req.request_id: len(req.all_token_ids)}, lambda _: list(range(3)))
        store.delete_many(records.deletes.get("ssd", []))
        store.put_many([(key, bytes(BLOCK_BYTES)) for key in scheduler._rank_keys(records.saves[0].keys)])
    assert scheduler.num_matched_tokens(request("a2", list(range(2 * T + 1))), 0) == T
    scheduler.manager.close()


# -- pins from the lookup on ----------------------------------------------------------------------------

def saved_prompt(scheduler, worker, num_blocks: int) -> list[bytes]:
    """A request that sent `num_blocks` blocks down; their keys."""
    first = request("saver", list(range(num_blocks * T + 1)))
    scheduler.after_alloc(first, list(range(num_blocks + 1)), 0)
    keys = step(scheduler, worker, first, list(range(num_blocks + 1))).saves[0].keys
    scheduler.finished("saver")
    return keys


def pinned(scheduler, keys: list[bytes]) -> list[bool]:
    """Which blocks another process sees pinned (a shared lock on their byte of the lock file)."""
    owner = scheduler.manager.tiers[0]
    other = DiskStore(owner.directory)
    try:
        return [other._locks.pinned_elsewhere(key) for key in keys]
    finally:
        other.close()


def no_pins_left(scheduler) -> bool:
    owner = scheduler.manager.tiers[0]
    return not owner._pins and owner._locks.num_pinned() == 0 and not scheduler._pins


def test_a_lookup_pins_what_it_offers_until_the_load_is_done(sides):
    """Between vLLM's lookup and its allocation another process cannot evict what the lookup offered; the
    allocation keeps the pins for the load, which releases them when reported done."""
    scheduler, worker, store = sides
    keys = saved_prompt(scheduler, worker, 3)
    again = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(again, 0) == 3 * T and pinned(scheduler, keys) == [True] * 3
    assert store.delete_many(keys) == 0  # another process's evictions leave them
    scheduler.after_alloc(again, [4, 5, 6, 7], 3 * T)
    scheduler.build_records({"r2": 0}, lambda _: [4, 5, 6, 7])
    assert pinned(scheduler, keys) == [True] * 3
    scheduler.loaded_from({"r2": ["ssd"] * 3})
    assert pinned(scheduler, keys) == [False] * 3 and no_pins_left(scheduler)


def test_a_lookup_not_asked_again_is_released_at_the_step_s_end_and_a_later_one_replaces_it(sides):
    scheduler, worker, store = sides
    keys = saved_prompt(scheduler, worker, 3)
    waiting = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T  # looked up again: one pin per block, not two
    assert scheduler.manager.tiers[0]._pins == {key: 1 for key in keys}
    scheduler.build_records({}, lambda _: [])  # asked this step, not allocated: still waiting, still pinned
    assert pinned(scheduler, keys) == [True] * 3
    scheduler.build_records({}, lambda _: [])  # a step that did not ask for it (scheduled otherwise, preempted)
    assert pinned(scheduler, keys) == [False] * 3 and no_pins_left(scheduler)
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T and pinned(scheduler, keys) == [True] * 3
    scheduler.finished("r2")  # aborted while waiting
    assert no_pins_left(scheduler)


def test_a_request_waiting_for_device_blocks_keeps_its_lookup_step_after_step(sides, monkeypatch):
    """vLLM asks again each step while a request waits: the run its pins hold stands (no lookup of the whole
    prompt, no pins taken again: one block probed), and the load, once allocated, takes it."""
    scheduler, worker, store = sides
    keys = saved_prompt(scheduler, worker, 3)
    waiting = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T
    scheduler.build_records({}, lambda _: [])
    owner = scheduler.manager.tiers[0]
    asked, pins = [], []
    contains, pin = owner.contains_many, owner.pin_many
    monkeypatch.setattr(owner, "contains_many", lambda k: asked.append(list(k)) or contains(k))
    monkeypatch.setattr(owner, "pin_many", lambda k: pins.append(list(k)) or pin(k))
    for _ in range(5):
        assert scheduler.num_matched_tokens(waiting, 0) == 3 * T
        scheduler.build_records({}, lambda _: [])
    assert asked == [] and pins == []  # the whole run is held: nothing after it to probe
    assert owner._pins == {key: 1 for key in keys}
    scheduler.after_alloc(waiting, [4, 5, 6, 7], 3 * T)
    assert scheduler.build_records({"r2": 0}, lambda _: [4, 5, 6, 7]).loads[0].keys == keys
    scheduler.loaded_from({"r2": ["ssd"] * 3})
    scheduler.finished("r2")
    assert no_pins_left(scheduler)


def test_a_miss_asks_for_one_block_and_a_kept_run_from_a_pool_is_asked_again(sides, monkeypatch):
    """A prompt whose first block no tier holds costs one block's lookup, not the prompt's; a run a pool
    holds (not pinned: a pool evicts on its own) is looked up again in full at each ask."""
    scheduler, worker, store = sides
    owner = scheduler.manager.tiers[0]
    asked = []
    contains = owner.contains_many
    monkeypatch.setattr(owner, "contains_many", lambda k: asked.append(len(k)) or contains(k))
    assert scheduler.num_matched_tokens(request("new", [500 + t for t in range(6 * T + 1)]), 0) == 0
    assert asked == [1]
    saved_prompt(scheduler, worker, 3)
    waiting = request("r2", list(range(3 * T + 1)))
    asked.clear()
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T
    assert asked == [1, 3]  # the first block, then the run
    scheduler._plans["r2"].tiers = ["mooncake"] * 3  # as if a pool held the run
    asked.clear()
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T
    assert asked == [1, 3]
    scheduler.finished("r2")
    assert no_pins_left(scheduler)


def test_a_waiting_request_looks_up_again_when_the_block_after_its_run_was_saved(sides):
    """Another request with the same prefix saved the next block while this one waited: a fresh lookup
    offers the longer run (a lookup kept step after step never offers less than the tiers hold)."""
    scheduler, worker, store = sides
    saved_prompt(scheduler, worker, 2)
    waiting = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(waiting, 0) == 2 * T
    scheduler.build_records({}, lambda _: [])
    assert scheduler.num_matched_tokens(waiting, 0) == 2 * T  # nothing new: the same run
    scheduler.build_records({}, lambda _: [])
    assert scheduler.num_matched_tokens(waiting, 0) == 2 * T
    keys = saved_prompt(scheduler, worker, 3)  # in the same step, the third block is sent down
    assert scheduler.num_matched_tokens(waiting, 0) == 3 * T
    assert scheduler.manager.tiers[0]._pins == {key: 1 for key in keys}  # the old pins replaced, not doubled
    scheduler.finished("r2")
    assert no_pins_left(scheduler)


def test_an_allocation_of_fewer_tokens_keeps_only_their_pins(sides):
    scheduler, worker, store = sides
    keys = saved_prompt(scheduler, worker, 3)
    req = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(req, 0) == 3 * T
    scheduler.after_alloc(req, [4, 5, 6, 7], T)
    assert pinned(scheduler, keys) == [True, False, False]
    scheduler.finished("r2")  # aborted before its load was reported
    assert no_pins_left(scheduler)
    other = request("r3", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(other, 0) == 3 * T
    scheduler.after_alloc(other, [4, 5, 6, 7], 0)  # allocated with no external tokens: nothing loads
    assert no_pins_left(scheduler) and pinned(scheduler, keys) == [False] * 3


def test_a_lookup_offers_only_the_run_it_could_pin(sides, monkeypatch):
    """A block evicted between the lookup's match and its pin ends the offered run; pins past it are released."""
    scheduler, worker, store = sides
    keys = saved_prompt(scheduler, worker, 3)
    match = scheduler._match

    def match_then_evict(chain):
        tiers = match(chain)
        store.delete_many([keys[1]])  # another process evicts the middle block right then
        return tiers

    monkeypatch.setattr(scheduler, "_match", match_then_evict)
    assert scheduler.num_matched_tokens(request("r2", list(range(3 * T + 1))), 0) == T
    assert pinned(scheduler, keys) == [True, False, False]
    scheduler.finished("r2")
    assert no_pins_left(scheduler)


def test_a_delete_the_worker_could_not_do_is_shipped_again_until_done(sides, tmp_path, monkeypatch):
    """Another process pinned a file the scheduler evicted: the worker's delete leaves it; the scheduler sees
    it still there at a later step and ships it again, until it goes (no file outside every index)."""
    monkeypatch.setattr(disk, "SHIPPED_RECHECK_SECONDS", 0.0)
    scheduler, worker, store = sides
    keys = saved_prompt(scheduler, worker, 3)
    other = DiskTier(tmp_path, 8 * BLOCK_BYTES)
    assert other.pin_many([keys[2]]) == [True]
    new = request("r3", [100 + t for t in range(2 * T + 1)])
    scheduler.after_alloc(new, [8, 9, 10], 0)
    assert step(scheduler, worker, new, [8, 9, 10]).deletes == {"ssd": [keys[2], keys[1]]}
    assert store._path(keys[2]).exists() and not store._path(keys[1]).exists()
    assert step(scheduler, worker, new, [8, 9, 10]).deletes == {"ssd": [keys[2]]}  # pinned still: stays
    assert store._path(keys[2]).exists()
    other.unpin([keys[2]])
    assert step(scheduler, worker, new, [8, 9, 10]).deletes == {"ssd": [keys[2]]}
    assert not store._path(keys[2]).exists()
    assert step(scheduler, worker, new, [8, 9, 10]).deletes == {}
    assert len(list(tmp_path.glob("*/*.kvb"))) == scheduler.manager.tiers[0].num_blocks() == 3
    assert worker.take_stats()["deleted_blocks"] == 2
    other.close()


def test_a_delete_runs_between_the_last_step_s_saves_and_this_step_s_while_the_load_thread_is_busy(tmp_path):
    """A step saves a block; the scheduler evicts it and admits it again the next step (its delete and its
    save in one step's metadata) while a slow load holds the worker's load thread. The delete runs on the
    writes lane, queued as the metadata arrives: after the first save, ahead of the second, so the file
    written again stays (a delete on the load thread would run after that save and remove it)."""
    manager = TierManager([make_tier(f"ssd:{tmp_path}:{3 * BLOCK_BYTES}", slot_bytes=BLOCK_BYTES, owner=False)])
    store = manager.tiers[0]
    worker = WorkerSide(LAYOUT, get_codec("raw"), manager, stores={"ssd": store})
    worker.register({name: torch.randn(NUM_BLOCKS, H, T, 2 * D) for name in NAMES},
                    lambda name: int(name.split(".")[2]))
    key, slow_load = bytes(range(16)), threading.Event()
    try:
        worker._loader.submit(slow_load.wait, 10)
        worker.delete({})
        worker.begin_step([SaveSpec("r", [key], [0])])
        worker.finish_save()
        worker.delete({"ssd": [key]})  # evicted, and admitted again: saved with this step
        worker.begin_step([SaveSpec("r", [key], [1])])
        worker.finish_save()
        worker.wait_saves()
        assert store.contains_many([key]) == [True]
        slow_load.set()
        worker._loader.submit(lambda: None).result(timeout=10)
        assert store.contains_many([key]) == [True] and worker.take_stats()["deleted_blocks"] == 1
    finally:
        slow_load.set()
        worker.shutdown()
        manager.close()


def test_a_worker_without_a_writes_thread_deletes_at_once(sides):
    """Saves written in the step (no writes thread): the step's deletes run as its metadata arrives, before
    them, not on the process's writes lane (busy here), where they could follow a save of the same key."""
    _, worker, store = sides
    key, gate = bytes(range(16)), threading.Event()
    store.put_many([(key, b"x" * 64)])
    try:
        assert transfer_executor().write(lambda: gate.wait(10))
        worker.delete({"ssd": [key]})
        assert store.contains_many([key]) == [False] and worker.take_stats()["deleted_blocks"] == 1
    finally:
        gate.set()


def test_each_tensor_parallel_rank_deletes_only_its_own_shard_files(tmp_path):
    """World size 2: the scheduler's index holds both ranks' files of a block; what it evicts is split by
    rank, so each rank deletes its own shards' files (on its own writes lane, behind its own writes of them),
    never another rank's."""
    scheduler = SchedulerSide(SPACE, build_manager([f"ssd:{tmp_path}:{4 * BLOCK_BYTES}"], slot_bytes=BLOCK_BYTES,
                                                   async_writes=False), world_size=2, block_bytes=BLOCK_BYTES)
    stores = [DiskStore(tmp_path), DiskStore(tmp_path)]  # rank 0's and rank 1's worker
    try:
        old, new = request("a", list(range(2 * T + 1))), request("b", list(range(100, 100 + 2 * T + 1)))
        scheduler.after_alloc(old, [0, 1, 2], 0)
        records = scheduler.build_records({"a": 2 * T + 1}, lambda _: [0, 1, 2])
        old_keys = [key for spec in records.saves for key in spec.keys]
        for rank, store in enumerate(stores):  # each rank writes its shards
            store.put_many([(key, b"x" * 64) for key in shard_keys(old_keys, rank, 2)])
        scheduler.after_alloc(new, [3, 4, 5], 0)
        records = scheduler.build_records({"b": 2 * T + 1}, lambda _: [3, 4, 5])  # evicts every file of "a"
        assert sorted(records.deletes["ssd"]) == sorted(shard_keys(old_keys, 0, 2) + shard_keys(old_keys, 1, 2))
        own = [deletes_for_rank(records.deletes, records.delete_ranks, rank) for rank in (0, 1)]
        assert [sorted(o["ssd"]) for o in own] == [sorted(shard_keys(old_keys, rank, 2)) for rank in (0, 1)]
        assert stores[0].delete_many(own[0]["ssd"]) == 2
        assert stores[1].contains_many(shard_keys(old_keys, 1, 2)) == [True, True]  # rank 1's: not rank 0's to do
        assert stores[1].delete_many(own[1]["ssd"]) == 2
        assert scheduler._file_ranks["ssd"].keys() == set(shard_keys(records.saves[0].keys, 0, 2)
                                                          + shard_keys(records.saves[0].keys, 1, 2))  # shipped: forgotten
        assert deletes_for_rank({"ssd": [b"k"]}, {}, 3) == {"ssd": [b"k"]}  # one worker: every file
    finally:
        scheduler.manager.close()
        for store in stores:
            store.close()
