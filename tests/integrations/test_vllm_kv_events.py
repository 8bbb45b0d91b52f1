"""kvtier's tiers in vLLM's KV cache events, read by the real consumer: NVIDIA Dynamo's standalone KV
indexer (`.venv-dynamo`, `make dynamo`) subscribed to one real vLLM + kvtier server (the CPU build in
`.venv-vllm`) started with nothing but `--kv-events-config`. One engine start for the module.

The replica: 32 device blocks, kvtier on `shm:` (announced as CPU: Dynamo's host tier) over an SSD
directory (STORAGE: its disk tier), each holding a few prompts of 12 blocks. A tap beside the indexer
records the raw stream (the same ZMQ publisher) to check what the events say block by block. The tests
run in order, each on the state the previous ones left.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvtier import models
from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.integrations.vllm.config import model_fingerprint
from kvtier.bench.dynamo import DYNAMO_PYTHON
from kvtier.route.event_relay import EventRelay
from kvtier.testing.dynamo import DynamoIndexer, KvEventTap

sys.path.insert(0, str(Path(__file__).parent))
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, kv_events_args, start_vllm, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=".venv-vllm is missing: `make vllm` creates it (`make test` does)"),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's KV indexer): `make dynamo` creates it, as `make test` does"),
]

BLOCK_FILE_BYTES = 30 * 2 * 3 * 64 * BLOCK_TOKENS * 4 + 64  # SmolLM2 fp32, one block of all layers + its header
SHM_BLOCKS, SSD_BLOCKS, DEVICE_BLOCKS = 14, 56, 32  # the SSD holds four prompts, the device two and a half
WORKER_ID, MODEL = 1, "smollm2"
ROUTED_ID = 2  # the same replica again, its stream read through `kvtier route`'s relay (`route/event_relay.py`)
PROMPT_CHARS = 1400  # ~400 tokens: 12 full blocks


@pytest.fixture(scope="module")
def prompts(shakespeare_text) -> list[str]:
    return [shakespeare_text[i * 5000:i * 5000 + PROMPT_CHARS] for i in range(7)]


@pytest.fixture(scope="module")
def replica(tmp_path_factory, smollm2):
    """vLLM + kvtier publishing KV events on an ipc socket; Dynamo's indexer and a tap subscribed to it, and the
    indexer to the same stream through kvtier route's relay (as worker `ROUTED_ID`)."""
    root = tmp_path_factory.mktemp("kvevents")
    shm_dir = Path("/dev/shm") / f"kvtier-events-{uuid.uuid4().hex[:8]}"
    endpoint, replay = f"ipc://{root}/events.sock", f"ipc://{root}/replay.sock"
    tiers = [f"shm:{shm_dir}:{SHM_BLOCKS * BLOCK_FILE_BYTES + BLOCK_FILE_BYTES // 2}",
             f"ssd:{root / 'ssd'}:{SSD_BLOCKS * BLOCK_FILE_BYTES + BLOCK_FILE_BYTES // 2}"]
    relay = EventRelay([endpoint], root / "relay").start()
    try:
        with (DynamoIndexer(root / "indexer.log") as indexer,
              KvEventTap(endpoint, root / "events.jsonl", python=VLLM_PYTHON) as tap,
              start_vllm(root / "vllm.log", tiers, num_device_blocks=DEVICE_BLOCKS,
                         extra_args=kv_events_args(endpoint, replay)) as server):
            indexer.register(WORKER_ID, endpoint, model_name=MODEL, block_size=BLOCK_TOKENS, replay_endpoint=replay)
            indexer.register(ROUTED_ID, relay.endpoints[0], model_name=MODEL, block_size=BLOCK_TOKENS,
                             replay_endpoint=relay.replay_endpoints[0])
            time.sleep(1.0)  # the subscriptions settle before the first event
            yield {"server": server, "indexer": indexer, "tap": tap, "ssd": root / "ssd", "shm": shm_dir}
    finally:
        relay.close()
        shutil.rmtree(shm_dir, ignore_errors=True)


def _query(replica, token_ids: list[int]) -> dict:
    return replica["indexer"].query(token_ids, model_name=MODEL).get(str(WORKER_ID), {})


def _full(token_ids: list[int]) -> int:
    return len(token_ids) // BLOCK_TOKENS * BLOCK_TOKENS


def _chain(events: list[dict], token_ids: list[int], medium: str, salt: str | None = None) -> list[int]:
    """The block hashes `medium`'s BlockStored events give the full blocks of `token_ids`, first to last,
    following parents (`salt`: the first block's extra key, vLLM's cache_salt)."""
    by_parent: dict[tuple, int] = {}
    for event in events:
        if event["type"] != "BlockStored" or (event.get("medium") or "GPU") != medium:
            continue
        tokens, size, parent = event["token_ids"], event["block_size"], event["parent_block_hash"]
        for j, block_hash in enumerate(event["block_hashes"]):
            keys = (event.get("extra_keys") or [None] * (j + 1))[j]
            first_salt = keys[-1] if parent is None and j == 0 and keys else None
            by_parent[(parent, tuple(tokens[j * size:(j + 1) * size]), first_salt)] = block_hash
            parent = block_hash
    hashes, parent = [], None
    for i in range(len(token_ids) // BLOCK_TOKENS):
        block = tuple(token_ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        block_hash = by_parent.get((parent, block, salt if i == 0 else None))
        if block_hash is None:
            break
        hashes.append(block_hash)
        parent = block_hash
    return hashes


def _removed(events: list[dict], medium: str) -> set[int]:
    return {h for e in events if e["type"] == "BlockRemoved" and (e.get("medium") or "GPU") == medium
            for h in e["block_hashes"]}


def _tiers_holding(replica, hashes: list[int]) -> dict[str, set[int]]:
    """Dynamo's index: storage tier -> which of `hashes` it holds for the replica."""
    out: dict[str, set[int]] = {}
    wanted = set(hashes)
    for entry in replica["indexer"].dump().get(f"{MODEL}:default", {}).get("events", []):
        if entry["worker_id"] != WORKER_ID:
            continue
        for block in entry["event"]["data"].get("stored", {}).get("blocks", []):
            if block["block_hash"] in wanted:
                out.setdefault(entry["storage_tier"], set()).add(block["block_hash"])
    return out


def test_a_reply_s_blocks_are_indexed_on_the_device_and_in_each_tier_under_vllm_s_hashes(replica, prompts):
    reply = replica["server"].complete(prompts[0], max_tokens=8)
    ids, full = reply["prompt_token_ids"], _full(reply["prompt_token_ids"])
    assert full >= 10 * BLOCK_TOKENS
    counts = wait_for(lambda: _query(replica, ids), lambda q: q.get("disk") == full and q.get("cpu") == full,
                   "the prompt on the device and in the tiers")
    assert (counts["gpu"], counts["cpu"], counts["disk"]) == (full, full, full)
    events = replica["tap"].events()
    device = _chain(events, ids, "GPU")
    assert len(device) == full // BLOCK_TOKENS
    # kvtier's events name each block by vLLM's own prefix-cache hash: the router links the copies
    assert _chain(events, ids, "CPU") == device
    assert _chain(events, ids, "STORAGE") == device
    stored = [e for e in events if e["type"] == "BlockStored" and e.get("medium") == "STORAGE"]
    assert all(e["block_size"] == BLOCK_TOKENS and len(e["token_ids"]) == BLOCK_TOKENS for e in stored)
    held = wait_for(lambda: _tiers_holding(replica, device), lambda t: len(t) == 3, "three tiers in the dump")
    assert {tier: len(hashes) for tier, hashes in held.items()} == \
        {"device": len(device), "host_pinned": len(device), "disk": len(device)}
    replica["first"] = (ids, device)


def test_blocks_the_device_evicted_still_count_at_kvtier_s_tier(replica, prompts):
    ids, device = replica["first"]
    for prompt in prompts[1:4]:  # 3 x 13 device blocks of 32: the first prompt's are reused; shm keeps one prompt
        replica["server"].complete(prompt, max_tokens=8)
    counts = wait_for(lambda: _query(replica, ids), lambda q: q.get("gpu") == 0 and q.get("cpu") == 0,
                   "the device and shm evicting the first prompt")
    assert (counts["gpu"], counts["cpu"], counts["disk"]) == (0, 0, _full(ids))  # still on the SSD
    events = replica["tap"].events()
    assert set(device) <= _removed(events, "GPU") and set(device) <= _removed(events, "CPU")
    assert not set(device) & _removed(events, "STORAGE")
    assert set(_tiers_holding(replica, device)) == {"disk"}


def test_blocks_kvtier_evicted_are_gone_from_the_index(replica, prompts):
    ids, device = replica["first"]
    replica["server"].complete(prompts[4], max_tokens=8)  # a fifth prompt: the SSD lets the first one's blocks go
    left = wait_for(lambda: _query(replica, ids), lambda q: q.get("disk", 0) < _full(ids),
                    "the SSD evicting the first prompt's blocks")["disk"]
    # tail first (7857b89): the SSD let the chain's last blocks go; what it kept is still the prompt's prefix
    kept = left // BLOCK_TOKENS
    removed = _removed(replica["tap"].events(), "STORAGE")
    assert device[-1] in removed and not set(device[:kept]) & removed
    held = set().union(*_tiers_holding(replica, device).values(), set())
    assert held == set(device[:kept])  # the evicted ones are gone from the index, the prefix is not
    # the index's count of each tier's blocks is kvtier's: one block file each on the SSD and in shm
    counts = wait_for(lambda: _tier_counts(replica), lambda c: c == _file_counts(replica), "the index's counts")
    assert counts["disk"] > SSD_BLOCKS - 13 and counts["host_pinned"] > 0


def _tier_counts(replica) -> dict[str, int]:
    """Dynamo's index: how many blocks of the replica each storage tier below the device holds."""
    counts = replica["indexer"].tier_counts(MODEL, WORKER_ID)
    counts.pop("device", None)
    return counts


def _file_counts(replica) -> dict[str, int]:
    """kvtier's own: block files on the SSD and in shared memory."""
    return {"disk": sum(1 for _ in replica["ssd"].rglob("*.kvb")),
            "host_pinned": sum(1 for _ in replica["shm"].rglob("*.kvb"))}


def _block_file(ssd: Path, token_ids: list[int], index: int) -> Path:
    """The SSD file of block `index` of `token_ids` (its kvtier key: the model, vLLM CPU's KV layout, raw)."""
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=BLOCK_TOKENS,
                      page="cpu_attn:vec")
    space = KeySpace(model_fingerprint(str(models.cache_dir() / "smollm2-135m-instruct")), layout, "raw", "")
    key = block_keys(space, token_ids)[index]
    return ssd / key.hex()[:2] / f"{key.hex()}.kvb"


def test_a_block_deleted_as_corrupt_is_withdrawn_then_announced_again_once_recomputed(replica, prompts):
    server, ssd = replica["server"], replica["ssd"]
    ids = server.complete(prompts[2], max_tokens=8)["prompt_token_ids"]
    hashes = _chain(replica["tap"].events(), ids, "STORAGE")
    last = (len(ids) - 1) // BLOCK_TOKENS - 1  # the last block a request of this prompt loads
    assert len(hashes) > last
    victim = _block_file(ssd, ids, last)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # one payload byte: the block's checksum no longer holds
    victim.write_bytes(bytes(data))
    for prompt in prompts[5:7]:  # the prompt off the device and shm again: the next one loads from the SSD
        server.complete(prompt, max_tokens=8)
    server.complete(prompts[2], max_tokens=8)
    wait_for(lambda: _removed(replica["tap"].events(), "STORAGE"), lambda removed: hashes[last] in removed,
          "the corrupt block's BlockRemoved")
    # recomputed by vLLM and saved again: announced again, the whole prompt back on the SSD in the index
    wait_for(lambda: _query(replica, ids), lambda q: q.get("disk") == _full(ids),
             "the recomputed block announced again")
    stored_after = [e for e in replica["tap"].events() if e["type"] == "BlockStored" and e.get("medium") == "STORAGE"
                    and hashes[last] in e["block_hashes"]]
    assert len(stored_after) == 2  # first written, then written again after its removal


def test_two_tenants_blocks_are_apart_in_the_events_and_the_index(replica, prompts):
    server = replica["server"]
    a = server.complete(prompts[6], max_tokens=8, cache_salt="tenant-a")
    b = server.complete(prompts[6], max_tokens=8, cache_salt="tenant-b")
    ids = a["prompt_token_ids"]
    assert b["prompt_token_ids"] == ids
    salts = ("tenant-a", "tenant-b")
    chain_a, chain_b = wait_for(lambda: [_chain(replica["tap"].events(), ids, "STORAGE", salt) for salt in salts],
                             lambda chains: all(len(c) == len(ids) // BLOCK_TOKENS for c in chains),
                             "both tenants on the SSD")
    assert not set(chain_a) & set(chain_b)  # salted hashes: no block of one is a block of the other
    events = replica["tap"].events()
    assert chain_a == _chain(events, ids, "GPU", "tenant-a") and chain_b == _chain(events, ids, "GPU", "tenant-b")
    replica["tenants"] = (chain_a, chain_b)
    replica["tenant_prompt"] = ids


def test_dynamo_keeps_two_tenants_blocks_apart(replica):
    """Dynamo 1.6.1 keys a block under its tenant by the event's `cache_salt` field and ignores the salt in
    `extra_keys`. kvtier's tier events carry the field: each tenant's SSD blocks are entries of their own and
    match under that tenant's salt. vLLM's own device events do not: read straight from vLLM, a tenant's device
    blocks match nothing under its salt; read through kvtier route's relay, they do."""
    chain_a, chain_b = replica["tenants"]
    disk = _tiers_holding(replica, chain_a + chain_b).get("disk", set())
    assert {chain_a[0], chain_b[0]} <= disk  # each tenant's first block under its own hash
    ids = replica["tenant_prompt"]
    for salt in ("tenant-a", "tenant-b"):
        routed = wait_for(lambda: replica["indexer"].query(ids, model_name=MODEL, cache_salt=salt),
                          lambda q: q.get(str(ROUTED_ID), {}).get("gpu") == _full(ids),
                          f"{salt}'s device blocks under its salt, through the relay")
        direct = routed.get(str(WORKER_ID), {})
        assert direct.get("disk") == _full(ids)  # kvtier's own tier events: salted at the source
        assert direct.get("gpu", 0) == 0  # vLLM's device events: no cache_salt field
    assert replica["indexer"].query(ids + [0], model_name=MODEL, cache_salt="tenant-c") == {}
