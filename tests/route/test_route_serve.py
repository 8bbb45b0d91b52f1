"""`kvtier route --policy dynamo` over two `kvtier serve` replicas (the tiny model, in this process) that publish
their device and tier blocks with `--kv-events-config`, NVIDIA Dynamo's selection service (`.venv-dynamo`)
reading them: a request goes to the replica holding its prefix, on the device or only in its tiers."""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvtier.config import EngineConfig
from kvtier.route.app import REPLICA_HEADER, Router, create_app
from kvtier.route.replicas import Replica, ReplicaSet
from kvtier.route.selectors import make_selector
from kvtier.server.cli import build_app
from kvtier.server.config import ServeConfig
from kvtier.server.tokenizer import ByteTokenizer
from kvtier.testing.app_thread import AppThread
from kvtier.bench.dynamo import DYNAMO_PYTHON, DynamoSelectService
from kvtier.tiers.spec import parse_specs

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_support import running  # noqa: E402
from test_kv_events import BLOCK, BLOCK_BYTES, PROMPTS, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's selection service): `make dynamo` creates it "
                              "(`make test` does)"),
]

MODEL, DEVICE_BLOCKS = "tiny", 16


def _serve_app(root: Path):
    endpoint, replay = f"ipc://{root}/events.sock", f"ipc://{root}/replay.sock"
    config = ServeConfig(model="tiny", tiers=parse_specs([f"dram:{100 * (BLOCK_BYTES + 64)}"]),
                         kv_events_config=json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint,
                                                      "replay_endpoint": replay}),
                         engine=EngineConfig(device_kv_budget_bytes=DEVICE_BLOCKS * BLOCK_BYTES, block_tokens=BLOCK,
                                             max_prefill_tokens=64, max_model_tokens=512))
    return build_app(config), endpoint, replay


def _complete(url: str, prompt: str) -> httpx.Response:
    reply = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply


def test_dynamo_routes_to_the_kvtier_serve_replica_holding_the_prefix_on_its_device_or_its_tier(tmp_path):
    with ExitStack() as stack:
        selector = stack.enter_context(DynamoSelectService(tmp_path / "select.log"))
        urls, replicas = [], []
        for i in range(2):
            (tmp_path / f"r{i}").mkdir()
            app, endpoint, replay = _serve_app(tmp_path / f"r{i}")
            urls.append(stack.enter_context(running(app)))
            replicas.append(Replica(i + 1, urls[-1], endpoint, replay))
        router = Router(ReplicaSet(replicas), make_selector("dynamo", replicas, selector_url=selector.url,
                                                            model_name=MODEL, block_size=BLOCK),
                        tokenizer=ByteTokenizer())
        front = stack.enter_context(AppThread(create_app(router), name="router"))
        time.sleep(1.0)  # the selector's subscriptions settle before the first event

        def indexed(prompt: str, worker_id: int, tier: str = "device_blocks") -> int:
            overlap = selector.overlap(list(prompt.encode()), model_name=MODEL)
            return overlap.get(worker_id, {}).get(tier, 0)

        def routed(prompt: str) -> int:
            reply = _complete(front.url, prompt)
            return [u.removeprefix("http://") for u in urls].index(reply.headers[REPLICA_HEADER])

        for replica, prompt in enumerate(PROMPTS[:2]):  # each replica warmed with a prompt of its own, directly
            _complete(urls[replica], prompt)
            wait_for(lambda: indexed(prompt, replica + 1), lambda n: n == len(prompt) // BLOCK,
                     f"replica {replica + 1}'s blocks in the selector's index")
        # not the order round-robin (0, 1, 0) or least-loaded with nothing in flight (0, 0, 0) would give
        assert [routed(PROMPTS[1] + " more"), routed(PROMPTS[0] + " more"), routed(PROMPTS[0] + " else")] == [1, 0, 0]
        for prompt in PROMPTS[2:4]:  # replica 2's device reuses the first prompt's blocks; its DRAM keeps them
            _complete(urls[1], prompt)
        wait_for(lambda: (indexed(PROMPTS[1], 2), indexed(PROMPTS[1], 2, "host_pinned_blocks")),
                 lambda n: n == (0, len(PROMPTS[1]) // BLOCK), "replica 2's device evicting, its DRAM keeping")
        # Dynamo credits kvtier's host tier (round-robin would answer 1 then 0)
        assert [routed(PROMPTS[0] + " third"), routed(PROMPTS[1] + " again")] == [0, 1]
