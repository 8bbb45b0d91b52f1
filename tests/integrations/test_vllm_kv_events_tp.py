"""KV events of a tensor-parallel vLLM + kvtier, read by the real consumer: NVIDIA Dynamo's standalone KV
indexer (`.venv-dynamo`) subscribed to one real vLLM (the CPU build in `.venv-vllm`) started with
`--tensor-parallel-size 3` and `--kv-events-config`, kvtier on a small `shm:` directory (announced as CPU:
Dynamo's host tier).

Each rank stores its shard of a block under its own key and reports its own tier events; the scheduler's
`ShardedBlocks` (`integrations/vllm/tp_events.py`) turns them back into whole blocks. What a router must
see: each block once for the replica (not once per rank), under vLLM's own block hash, and withdrawn when
kvtier evicts it.

TP=3, not 2: SmolLM2-135M has 9 attention heads and 3 KV heads, and vLLM refuses --tensor-parallel-size 2
("Total number of attention heads (9) must be divisible by tensor parallel size (2)"); with 3 each rank holds
one KV head. vLLM's CPU build binds each worker to a NUMA node of its own unless told otherwise: `nobind`.
One engine start (about 1-2 min on 2 cores), marked `vllm` as the other real-vLLM tests.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from kvtier.bench.dynamo import DYNAMO_PYTHON
from kvtier.testing.dynamo import DynamoIndexer, KvEventTap

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_kv_events import _chain, _removed  # noqa: E402
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, kv_events_args, start_vllm, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=".venv-vllm is missing: `make vllm` creates it (`make test` does)"),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's KV indexer): `make dynamo` creates it, as `make test` does"),
]

WORLD = 3
SHARD_FILE_BYTES = 30 * 2 * 1 * 64 * BLOCK_TOKENS * 4 + 64  # one rank's shard (one KV head), fp32, + header
SHM_BLOCKS = 14  # every rank's shard of 14 blocks: one prompt of 12-13 blocks, not two
WORKER_ID, MODEL = 7, "smollm2"
PROMPT_CHARS = 1400  # ~400 tokens: 12 full blocks


def test_tp_blocks_are_announced_once_per_replica_and_withdrawn_when_kvtier_evicts_them(
        tmp_path_factory, shakespeare_text, smollm2, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    root = tmp_path_factory.mktemp("tp-kvevents")
    shm_dir = Path("/dev/shm") / f"kvtier-tp-events-{uuid.uuid4().hex[:8]}"
    endpoint, replay = f"ipc://{root}/events.sock", f"ipc://{root}/replay.sock"
    tiers = [f"shm:{shm_dir}:{WORLD * SHM_BLOCKS * SHARD_FILE_BYTES + SHARD_FILE_BYTES // 2}"]
    prompts = [shakespeare_text[40000 + i * 5000:40000 + i * 5000 + PROMPT_CHARS] for i in range(3)]
    try:
        with (DynamoIndexer(root / "indexer.log") as indexer,
              KvEventTap(endpoint, root / "events.jsonl", python=VLLM_PYTHON) as tap,
              start_vllm(root / "vllm.log", tiers, extra_args=(*kv_events_args(endpoint, replay),
                                                               "--tensor-parallel-size", str(WORLD))) as server):
            indexer.register(WORKER_ID, endpoint, model_name=MODEL, block_size=BLOCK_TOKENS, replay_endpoint=replay)
            time.sleep(1.0)  # the subscriptions settle before the first event

            def query(token_ids):
                return indexer.query(token_ids, model_name=MODEL)

            reply = server.complete(prompts[0], max_tokens=8)
            assert all(f"rank {r} of {WORLD}" in server.log_tail(400_000) for r in range(WORLD))
            ids = reply["prompt_token_ids"]
            full = len(ids) // BLOCK_TOKENS * BLOCK_TOKENS
            assert full >= 10 * BLOCK_TOKENS
            counts = wait_for(lambda: query(ids), lambda q: q.get(str(WORKER_ID), {}).get("cpu") == full,
                              "the prompt on the device and in kvtier's shm tier in Dynamo's index")
            assert set(counts) == {str(WORKER_ID)}  # one replica, whatever its ranks
            assert (counts[str(WORKER_ID)]["gpu"], counts[str(WORKER_ID)]["cpu"]) == (full, full)
            assert len(list(shm_dir.rglob("*.kvb"))) >= WORLD * (full // BLOCK_TOKENS)  # every rank's shard
            events = tap.events()
            device = _chain(events, ids, "GPU")
            assert len(device) == full // BLOCK_TOKENS
            assert _chain(events, ids, "CPU") == device  # vLLM's own hashes: the router links both copies
            stored_cpu = Counter(h for e in events if e["type"] == "BlockStored" and e.get("medium") == "CPU"
                                 for h in e["block_hashes"])
            assert all(stored_cpu[h] == 1 for h in device), stored_cpu  # once per block, not once per rank
            host = wait_for(lambda: _host_entries(indexer, device), lambda h: len(h) == len(device),
                            "the prompt's blocks in the index's host tier")
            assert host == Counter(device)  # Dynamo's index: each block once for the replica, not once per rank
            assert not _removed(events, "CPU")

            for prompt in prompts[1:]:  # 2 x 13 blocks through a tier of 14: the first prompt's all go
                server.complete(prompt, max_tokens=8)
            # `cpu` is device + host: the device still holds the prompt; the index's host tier does not
            wait_for(lambda: _host_entries(indexer, device), lambda h: not h, "kvtier's shm evicting the first prompt")
            assert query(ids)[str(WORKER_ID)]["gpu"] == full
            events = tap.events()
            assert set(device) <= _removed(events, "CPU")
            removed_cpu = Counter(h for e in events if e["type"] == "BlockRemoved" and e.get("medium") == "CPU"
                                  for h in e["block_hashes"])
            assert all(removed_cpu[h] == 1 for h in device), removed_cpu  # withdrawn once, at its first shard gone
            # the index's host count is what the events left held: each block once, at most the tier's room
            live = wait_for(lambda: (indexer.tier_counts(MODEL, WORKER_ID).get("host_pinned", 0), _live(tap.events())),
                            lambda got: got[0] == got[1], "the host tier's count after the evictions")[0]
            assert 0 < live <= SHM_BLOCKS
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def _host_entries(indexer: DynamoIndexer, hashes: list[int]) -> Counter:
    """Dynamo's index: how often each of `hashes` is held in the replica's host tier (`dump()`)."""
    wanted, held = set(hashes), Counter()
    for entry in indexer.dump().get(f"{MODEL}:default", {}).get("events", []):
        if entry["worker_id"] == WORKER_ID and entry["storage_tier"] == "host_pinned":
            held.update(b["block_hash"] for b in entry["event"]["data"].get("stored", {}).get("blocks", [])
                        if b["block_hash"] in wanted)
    return held


def _live(events: list[dict]) -> int:
    """Blocks the CPU medium's events leave held: stored minus removed (each block once)."""
    held: set[int] = set()
    for event in events:
        if event.get("medium") == "CPU" and event["type"] in ("BlockStored", "BlockRemoved"):
            (held.update if event["type"] == "BlockStored" else held.difference_update)(event["block_hashes"])
    return len(held)
