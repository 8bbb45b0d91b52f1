"""`kvtier serve --kv-events-config` read by the real consumer: NVIDIA Dynamo's standalone KV indexer
(`.venv-dynamo`, `make dynamo`) subscribed to a real `kvtier serve` app (the tiny model, 16 device blocks over
a DRAM tier of ten blocks and an SSD directory). `/query` for a prompt's tokens shows the replica with its
blocks per tier; the tests run in order on the state the previous ones left.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from kvtier.blocks import block_keys
from kvtier.config import EngineConfig
from kvtier.server.cli import build_app
from kvtier.server.config import ServeConfig
from kvtier.bench.dynamo import DYNAMO_PYTHON
from kvtier.testing.dynamo import DynamoIndexer
from kvtier.tiers.spec import parse_specs

sys.path.insert(0, str(Path(__file__).parent))
from server_support import running  # noqa: E402
from test_kv_events import BLOCK, BLOCK_BYTES, DEVICE_BLOCKS, DRAM_BLOCKS, PROMPTS, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's KV indexer): `make dynamo` creates it, as `make test` does"),
]

WORKER_ID, MODEL = 7, "tiny"
SSD_BLOCKS = 30  # three prompts of 9 blocks: a fourth makes the SSD evict


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-dynamo")
    endpoint, replay = f"ipc://{root}/events.sock", f"ipc://{root}/replay.sock"
    config = ServeConfig(model="tiny", tiers=parse_specs([f"dram:{DRAM_BLOCKS * (BLOCK_BYTES + 64)}",
                                                         f"ssd:{root / 'ssd'}:{SSD_BLOCKS * (BLOCK_BYTES + 64)}"]),
                         kv_events_config=json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint,
                                                      "replay_endpoint": replay}),
                         engine=EngineConfig(device_kv_budget_bytes=DEVICE_BLOCKS * BLOCK_BYTES, block_tokens=BLOCK,
                                             max_prefill_tokens=64, max_model_tokens=512))
    app = build_app(config)
    with DynamoIndexer(root / "indexer.log") as indexer, running(app) as url:
        indexer.register(WORKER_ID, endpoint, model_name=MODEL, block_size=BLOCK, replay_endpoint=replay)
        time.sleep(1.0)  # the subscription settles before the first event
        yield {"url": url, "app": app, "indexer": indexer, "ssd": root / "ssd"}


def _complete(replica, prompt: str, **extra) -> list[int]:
    import httpx

    reply = httpx.post(replica["url"] + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return list(prompt.encode())  # the byte tokenizer's ids


def _query(replica, token_ids: list[int], **extra) -> dict:
    body = {"token_ids": token_ids, "model_name": MODEL, **extra}
    status, text = replica["indexer"]._request("POST", "/query", body)
    assert status == 200, text
    return json.loads(text).get("instances", {}).get(str(WORKER_ID), {})


def _full(token_ids: list[int]) -> int:
    return len(token_ids) // BLOCK * BLOCK


def test_query_shows_the_replica_with_its_blocks_on_the_device_and_in_each_tier(replica):
    ids = _complete(replica, PROMPTS[0])
    full = _full(ids)
    counts = wait_for(lambda: _query(replica, ids), lambda q: q.get("gpu") == full and q.get("disk") == full,
                      "the prompt on the device, in DRAM and on the SSD")
    assert (counts["gpu"], counts["cpu"], counts["disk"]) == (full, full, full)


def test_blocks_the_device_evicted_still_count_at_the_tiers(replica):
    ids = list(PROMPTS[0].encode())
    for prompt in PROMPTS[1:3]:
        _complete(replica, prompt)
    counts = wait_for(lambda: _query(replica, ids), lambda q: not q.get("gpu") and not q.get("cpu"),
                      "the device and DRAM evicting the first prompt")
    assert (counts.get("gpu", 0), counts.get("cpu", 0), counts["disk"]) == (0, 0, _full(ids))  # on the SSD


def test_a_corrupt_block_is_gone_from_the_index_until_recomputed(replica):
    ids = list(PROMPTS[0].encode())
    engine = replica["app"].state.kvtier.engine.engine
    key = block_keys(engine.scheduler.space, ids)[2]
    victim = replica["ssd"] / key.hex()[:2] / f"{key.hex()}.kvb"
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert _query(replica, ids)["disk"] == _full(ids)  # the index cannot know yet
    _complete(replica, PROMPTS[0])  # loads blocks 0-1, deletes block 2 as corrupt, recomputes it and the rest
    counts = wait_for(lambda: _query(replica, ids), lambda q: q.get("gpu") == _full(ids), "the prompt back")
    assert counts["disk"] == _full(ids)


def test_the_index_holds_what_kvtier_holds_after_the_ssd_evicts(replica):
    for prompt in PROMPTS[3:5]:  # 2 x 9 blocks more on a 30-block SSD: the least recently used go
        _complete(replica, prompt)
    engine = replica["app"].state.kvtier.engine.engine
    own = wait_for(lambda: (_tier_counts(replica), _own_counts(replica, engine)), lambda c: c[0] == c[1],
                   "the index's per-tier counts to be kvtier's")[1]
    assert own["disk"] <= SSD_BLOCKS and own["host_pinned"] <= DRAM_BLOCKS
    on_ssd = {key for key in map(bytes.fromhex, (f.stem for f in replica["ssd"].rglob("*.kvb")))}
    evicted = 0
    for prompt in PROMPTS[:5]:  # per prompt, /query's disk match is the prefix of its blocks kvtier holds
        ids = list(prompt.encode())
        keys = block_keys(engine.scheduler.space, ids)
        held = next((i for i, key in enumerate(keys) if key not in on_ssd), len(keys))
        evicted += held < len(keys)
        assert _query(replica, ids).get("disk", 0) == held * BLOCK, prompt
    assert evicted  # some prompt lost blocks to the SSD's eviction, and the index says so


def _tier_counts(replica) -> dict[str, int]:
    """Dynamo's index: how many blocks of the replica each storage tier holds."""
    return replica["indexer"].tier_counts(MODEL, WORKER_ID)


def _own_counts(replica, engine) -> dict[str, int]:
    """kvtier's own: keyed device blocks, blocks in DRAM, block files on the SSD."""
    tiers = {tier.name: tier.num_blocks() for tier in engine.manager.tiers}
    return {"device": len(engine.block_manager.key_to_block), "host_pinned": tiers["dram"],
            "disk": sum(1 for _ in replica["ssd"].rglob("*.kvb"))}


def test_another_tenant_s_query_never_matches_a_tenant_s_blocks(replica):
    ids = _complete(replica, PROMPTS[5], cache_salt="tenant-a")
    engine = replica["app"].state.kvtier.engine.engine
    wait_for(lambda: (_tier_counts(replica), _own_counts(replica, engine)), lambda c: c[0] == c[1],
             "tenant a's blocks in the index")
    assert _query(replica, ids, cache_salt="tenant-b") == {}


def test_dynamo_matches_a_tenant_s_blocks_under_its_salt_only(replica):
    """kvtier serve's events carry each salted block's `cache_salt` (a field Dynamo's indexer reads; vLLM's
    own events put the salt in `extra_keys`, which it ignores): tenant a's query matches its blocks, a query
    without the salt or with another matches none."""
    ids = _complete(replica, PROMPTS[5], cache_salt="tenant-a")
    wait_for(lambda: _query(replica, ids, cache_salt="tenant-a"), lambda q: q.get("gpu") == _full(ids),
             "tenant a's blocks under its salt")
    assert _query(replica, ids) == {}
    assert _query(replica, ids, cache_salt="tenant-b") == {}