"""The connector's scheduler side without vLLM: lookups, load and save records, load errors, salts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.trackers import LoadSpec, RequestTracker, SaveSpec, request_namespace
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.tiers import SharedMemoryTier, make_tier
from kvtier.tiers.manager import build_manager

T = 4  # block tokens
SPACE = KeySpace("fp", KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=T), "raw")


def request(req_id: str, token_ids: list[int], salt: str | None = None, num_computed_tokens: int = 0):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(token_ids), cache_salt=salt, lora_request=None,
                           num_computed_tokens=num_computed_tokens)


@pytest.fixture
def manager(tmp_path):
    manager = build_manager([f"ssd:{tmp_path}:16MiB"], slot_bytes=1024, async_writes=False)
    yield manager
    manager.close()


def test_tracker_keys_extend_the_chain():
    tokens = list(range(20))
    tracker = RequestTracker(SPACE)
    assert tracker.keys_for(tokens, 2) == block_keys(SPACE, tokens[:8])
    assert tracker.keys_for(tokens, 5) == block_keys(SPACE, tokens)


def test_salt_and_lora_are_in_the_namespace():
    names = {request_namespace(None), request_namespace("a"), request_namespace("b"), request_namespace("a", "lora1")}
    assert len(names) == 4 and request_namespace(None) == ""


def test_a_dram_tier_alone_is_refused_shared_memory_is_not():
    with pytest.raises(ValueError, match="shm, SSD or pool"):
        ConnectorConfig(tiers=("dram:1GiB",))
    both = ConnectorConfig(tiers=("dram:1GiB", "ssd:/x:1GiB"))
    assert [spec.kind for spec in both.tiers] == ["dram", "ssd"] and [str(s) for s in both.shared_tiers] == ["ssd:/x:1GiB"]
    assert [str(s) for s in ConnectorConfig(tiers=("shm:/dev/shm/x:1GiB",)).shared_tiers] == ["shm:/dev/shm/x:1GiB"]
    with pytest.raises(ValueError, match="'ssd:1GiB'"):  # a bad spec names itself (a UserError and a ValueError)
        ConnectorConfig.from_extra_config({"tiers": ["ssd:1GiB"]})


def test_load_modes():
    assert ConnectorConfig.from_extra_config({"tiers": ["ssd:/x:1GiB"]}).load == "layerwise"
    assert ConnectorConfig.from_extra_config({"tiers": ["ssd:/x:1GiB"], "load": "async"}).load == "async"
    with pytest.raises(ValueError, match="load"):
        ConnectorConfig(tiers=("ssd:/x:1GiB",), load="sync")


def test_a_shared_memory_tier_is_the_disk_tier_named_shm(tmp_path):
    tier = make_tier(f"shm:{tmp_path}:1MiB", slot_bytes=1024)
    assert isinstance(tier, SharedMemoryTier) and tier.name == "shm" and tier.capacity_bytes == 1 << 20
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra_config({"tiers": ["ssd:/x:1GiB"], "tier": []})


@pytest.mark.parametrize("held", [3, 1, 0])
def test_device_cached_blocks_the_tiers_hold_are_not_saved_again(manager, held):
    """A new request whose first 3 blocks vLLM's device cache serves: those of them the tiers hold (a run
    from the first) are not copied out again, only refreshed with the chain (`held_keys`)."""
    tokens = list(range(100, 122))  # 22 tokens: 5 full blocks
    keys = block_keys(SPACE, tokens)
    manager.put_many([(key, b"block") for key in keys[:held]])
    side = SchedulerSide(SPACE, manager)
    req = request("r1", tokens, num_computed_tokens=3 * T)
    assert side.num_matched_tokens(req, 3 * T) == 0  # nothing beyond the device's blocks
    side.after_alloc(req, [10, 11, 12, 13, 14, 15], 0)
    records = side.build_records({"r1": 22 - 3 * T}, lambda req_id: [10, 11, 12, 13, 14, 15])
    assert records.saves == [SaveSpec("r1", keys[held:5], [10, 11, 12, 13, 14][held:], keys[:held])]


def test_a_later_save_carries_the_chain_before_it(manager):
    tokens = list(range(100, 122))
    keys = block_keys(SPACE, tokens)
    side = SchedulerSide(SPACE, manager)
    req = request("r1", tokens[:9])
    assert side.num_matched_tokens(req, 0) == 0
    side.after_alloc(req, [10, 11, 12], 0)
    assert side.build_records({"r1": 9}, lambda req_id: [10, 11, 12]).saves == [SaveSpec("r1", keys[:2], [10, 11], [])]
    req.all_token_ids, req.num_computed_tokens = tokens, 9
    assert side.build_records({"r1": 13}, lambda req_id: [10, 11, 12, 13, 14, 15]).saves == [
        SaveSpec("r1", keys[2:5], [12, 13, 14], keys[:2])]


def test_matched_blocks_are_loaded_and_the_rest_saved(manager):
    tokens = list(range(100, 122))  # 22 tokens: 5 full blocks
    keys = block_keys(SPACE, tokens)
    manager.put_many([(key, b"block") for key in keys[:3]])
    side = SchedulerSide(SPACE, manager)
    req = request("r1", tokens)
    assert side.num_matched_tokens(req, 0) == 3 * T
    side.after_alloc(req, [10, 11, 12, 13, 14, 15], 3 * T)
    assert side.hit_tokens_by_tier("r1") == {"ssd": 3 * T}
    req.num_computed_tokens = 3 * T  # as vLLM sets it once the load is in
    records = side.build_records({"r1": 22 - 3 * T}, lambda req_id: [10, 11, 12, 13, 14, 15])
    assert records.loads == [LoadSpec("r1", keys[:3], [10, 11, 12], ["ssd"] * 3)]
    assert records.saves == [SaveSpec("r1", keys[3:5], [13, 14], keys[:3])]  # the loaded ones: refreshed, not written
    assert side.build_records({}, None).loads == []  # records are handed over once


def test_device_hits_come_first_and_the_last_token_is_never_offered(manager):
    tokens = list(range(16))  # 4 full blocks; the last token must be computed, so 3 are offered
    keys = block_keys(SPACE, tokens)
    manager.put_many([(key, b"block") for key in keys])
    side = SchedulerSide(SPACE, manager)
    req = request("r1", tokens)
    assert side.num_matched_tokens(req, 0) == 3 * T
    assert side.num_matched_tokens(req, 2 * T) == T  # vLLM's own cache holds 2 blocks: one more from the tiers
    side.after_alloc(req, [7, 8, 9, 6], T)
    records = side.build_records({}, None)
    assert records.loads == [LoadSpec("r1", keys[2:3], [9], ["ssd"])]


def test_a_failed_load_is_recomputed_and_saved_again(manager):
    tokens = list(range(30))
    keys = block_keys(SPACE, tokens)
    manager.put_many([(key, b"block") for key in keys[:6]])
    side = SchedulerSide(SPACE, manager)
    req = request("r1", tokens)
    assert side.num_matched_tokens(req, 0) == 6 * T
    side.after_alloc(req, list(range(20, 28)), 6 * T)
    side.build_records({}, None)
    side.load_errors({22})  # the third block did not load: vLLM recomputes from it
    assert side.hit_tokens_by_tier("r1") == {"ssd": 2 * T}
    req.num_computed_tokens = 2 * T
    records = side.build_records({"r1": 30 - 2 * T}, lambda req_id: list(range(20, 28)))
    assert records.saves == [SaveSpec("r1", keys[2:7], [22, 23, 24, 25, 26], keys[:2])]


def test_another_salt_finds_nothing(manager):
    tokens = list(range(40, 60))
    manager.put_many([(key, b"block") for key in block_keys(SPACE.with_namespace("a"), tokens)])
    side = SchedulerSide(SPACE, manager)
    assert side.num_matched_tokens(request("r1", tokens, salt="b"), 0) == 0
    assert side.num_matched_tokens(request("r2", tokens), 0) == 0
    assert side.num_matched_tokens(request("r3", tokens, salt="a"), 0) == 4 * T


def test_the_worker_reports_where_blocks_really_came_from(manager):
    tokens = list(range(12))
    manager.put_many([(key, b"block") for key in block_keys(SPACE, tokens)])
    side = SchedulerSide(SPACE, manager)
    req = request("r1", tokens)
    side.after_alloc(req, [1, 2, 3], side.num_matched_tokens(req, 0))
    side.loaded_from({"r1": ["dram", "ssd"]})
    assert side.hit_tokens_by_tier("r1") == {"dram": T, "ssd": T}
    side.finished("r1")
    assert side.hit_tokens_by_tier("r1") == {}


def test_a_save_trimmed_to_what_the_directories_took_keeps_the_chain_it_extends():
    from kvtier.integrations.vllm.scheduler import _keep

    spec = SaveSpec("r1", [b"k1", b"k2", b"k3"], [1, 2, 3], [b"h0"])
    assert _keep(spec, [True, False, True]) == SaveSpec("r1", [b"k1", b"k3"], [1, 3], [b"h0"])
