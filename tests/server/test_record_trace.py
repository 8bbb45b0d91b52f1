"""`kvtier serve --record-trace`: live traffic lands in the Mooncake trace format and replays."""

from __future__ import annotations

import httpx

from kvtier.codecs import get_codec
from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
from kvtier.tiers.manager import build_manager
from kvtier.server.app import create_app
from kvtier.server.tokenizer import ByteTokenizer
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.replay import replay
from kvtier.sim.trace import read_trace, trace_hash_ids
from server_support import BLOCK, running


def test_hash_ids_are_chained_per_block_with_a_partial_last_block():
    a = trace_hash_ids(list(range(10)), block_tokens=4)
    b = trace_hash_ids([*range(8), 99], block_tokens=4)
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]  # shared first two blocks, different (partial) third
    assert trace_hash_ids([5, *range(1, 10)], block_tokens=4)[1] != a[1]  # a change earlier changes later ids
    assert trace_hash_ids(list(range(10)), "tenant-b", block_tokens=4)[0] != a[0]  # the salt is part of it
    assert all(0 <= h < 2**63 for h in a)


def test_served_requests_are_recorded_and_replay(tiny_model, tmp_path):
    path = tmp_path / "live.jsonl"
    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager(["dram:4MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    engine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=256 * layout.block_bytes,
                                                            block_tokens=BLOCK, max_model_tokens=2048), manager))
    app = create_app(engine, ByteTokenizer(), "tiny", manager=manager, on_shutdown=manager.close,
                     record_trace=path)
    long = "a shared system prompt, " * 30  # 720 bytes = tokens: two 512-token trace blocks
    with running(app) as url:
        for prompt, n in ((long + "first", 3), (long + "second", 5), ("short", 2)):
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0})
            assert r.status_code == 200, r.text
    requests = read_trace(path)
    assert [(r.input_length, r.output_length) for r in requests] == [(725, 3), (726, 5), (5, 2)]
    assert requests[0].hash_ids[0] == requests[1].hash_ids[0] != requests[2].hash_ids[0]
    assert requests[0].hash_ids[1] != requests[1].hash_ids[1]
    assert requests[0].timestamp_ms <= requests[1].timestamp_ms <= requests[2].timestamp_ms
    result = replay(requests, ClusterConfig(num_nodes=1, hbm_tokens=10**6))
    assert result.hit_tokens == 512  # the second request's first block, cached by the first
