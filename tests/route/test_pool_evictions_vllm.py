"""A real vLLM + kvtier replica (the CPU build in `.venv-vllm`) on a Redis pool announces the blocks Redis evicts
(`tiers/redis_removals.py`): `BlockRemoved` with medium `SHARED`, under vLLM's own block hashes, on its
`--kv-events-config` stream, without reading the blocks again. vLLM sends connector events with its steps,
so the removals leave with the replica's next request.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis

from kvtier import models
from kvtier.bench.pools import RedisServer
from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.integrations.vllm.config import model_fingerprint
from kvtier.testing.dynamo import KvEventTap
from kvtier.tiers.redis import redis_tier

sys.path.insert(0, str(Path(__file__).parents[1] / "integrations"))
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, kv_events_args, start_vllm, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.services,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=".venv-vllm is missing: `make vllm` creates it (`make test` does)"),
]

BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK_TOKENS * 4 + 64  # SmolLM2 fp32, one block of all layers + its header
PROMPT_CHARS = 1400  # ~400 tokens: 12 full blocks


def _pool_names(token_ids: list[int]) -> list[str]:
    """The Redis keys of the prompt's full blocks (kvtier's keys: the model, vLLM CPU's KV layout, raw)."""
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=BLOCK_TOKENS,
                      page="cpu_attn:vec")
    space = KeySpace(model_fingerprint(str(models.cache_dir() / "smollm2-135m-instruct")), layout, "raw", "")
    return [f"kvtier:{key.hex()}" for key in block_keys(space, token_ids)]


def _shared(events: list[dict], kind: str) -> set[int]:
    return {h for e in events if e["type"] == kind and e.get("medium") == "SHARED" for h in e["block_hashes"]}


def test_a_block_redis_evicts_is_announced_removed_by_the_vllm_replica(tmp_path, smollm2, shakespeare_text):
    endpoint, replay = f"ipc://{tmp_path}/events.sock", f"ipc://{tmp_path}/replay.sock"
    with (RedisServer(tmp_path, maxmemory="64mb") as pool,
          KvEventTap(endpoint, tmp_path / "events.jsonl", python=VLLM_PYTHON) as tap,
          start_vllm(tmp_path / "vllm.log", [pool.spec], extra_args=kv_events_args(endpoint, replay)) as server):
        reply = server.complete(shakespeare_text[:PROMPT_CHARS], max_tokens=4)
        names = _pool_names(reply["prompt_token_ids"])
        stored = wait_for(lambda: _shared(tap.events(), "BlockStored"), lambda s: len(s) >= len(names),
                          "the prompt's blocks announced in the pool")
        check, filler = redis.Redis(port=pool.port), redis_tier(pool.spec)
        try:
            assert all(check.exists(name) for name in names)
            for batch in range(200):  # another server's blocks, until Redis has let every one of the prompt's go
                if not any(check.exists(name) for name in names):
                    break
                filler.put_many([(f"filler-{batch}-{i}".encode(), bytes(BLOCK_BYTES)) for i in range(4)])
            assert not any(check.exists(name) for name in names)
        finally:
            check.close()
            filler.close()
        server.complete(shakespeare_text[5000:5000 + 200], max_tokens=4)  # a step: the connector's events go out
        removed = wait_for(lambda: _shared(tap.events(), "BlockRemoved"), lambda r: stored <= r,
                           "the evicted blocks announced removed")
        assert stored <= removed
