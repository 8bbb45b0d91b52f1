"""The connector's shared directories have one owner: the scheduler side admits what the workers write,
decides evictions (never a block pinned for a load) and ships them in the step's records; the worker's
directory is a plain file store that deletes what it is told."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers import DiskStore, make_tier
from kvtier.tiers.manager import TierManager, build_manager

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
    worker._loader.submit(lambda: None).result()  # the deletes ran (the load thread)
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
    assert records.deletes == {"ssd": keys[:2]}  # decided by the scheduler's LRU ...
    assert [store._path(key).exists() for key in keys] == [False, False, True]  # ... done by the worker
    assert sorted(p.name for p in tmp_path.glob("*/*.kvb")) == sorted(
        store._path(key).name for key in [keys[2], *records.saves[0].keys])
    assert worker.take_stats()["deleted_blocks"] == 2
    assert scheduler.num_matched_tokens(request("r5", list(range(3 * T + 1))), 0) == 0


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
    keeps the last 2 and ships the first's delete."""
    tiers = [f"shm:{tmp_path / 'shm'}:{2 * BLOCK_BYTES}", f"ssd:{tmp_path / 'ssd'}:{8 * BLOCK_BYTES}"]
    scheduler = SchedulerSide(SPACE, build_manager(tiers, slot_bytes=BLOCK_BYTES, async_writes=False),
                              block_bytes=BLOCK_BYTES)
    req = request("r1", list(range(3 * T + 1)))
    scheduler.after_alloc(req, [0, 1, 2, 3], 0)
    records = scheduler.build_records({"r1": 3 * T + 1}, lambda _: [0, 1, 2, 3])
    keys = records.saves[0].keys
    assert len(keys) == 3 and records.saves[0].block_ids == [0, 1, 2]
    assert records.deletes == {"shm": keys[:1]}
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
    store = DiskStore(tmp_path / "ssd")
    store.put_many([(key, bytes(BLOCK_BYTES)) for key in keys])  # only the SSD holds them (shm dropped them)
    again = request("r2", list(range(3 * T + 1)))
    assert scheduler.num_matched_tokens(again, 0) == 3 * T
    scheduler.after_alloc(again, [4, 5, 6, 7], 3 * T)
    # shm's index took the copies (the 3 keys through a 2-block index: k1, evicted by k0, goes) ...
    assert scheduler.build_records({}, lambda _: []).deletes == {"shm": [keys[1]]}
    assert [key in shm._lru for key in keys] == [True, False, True] and shm.used_bytes() == 2 * BLOCK_BYTES
    manager.close()
