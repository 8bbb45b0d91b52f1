"""`kvtier route --policy dynamo` over two real vLLM + kvtier replicas (the CPU build in `.venv-vllm`), NVIDIA
Dynamo's selection service (`.venv-dynamo`) fed by their KV events (`--kv-events-config`: vLLM's device
blocks and kvtier's `shm:` tier). Both engines start together; the tests run in order on one cluster.

Each replica is warmed with a prompt of its own sent to it directly; through the router, a request that
shares a prompt's prefix goes to the replica that holds it, a chat request's token ids are vLLM's own,
and a prefix the device evicted still goes to the replica whose kvtier tier keeps it.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvtier import models
from kvtier.route.app import REPLICA_HEADER, create_app
from kvtier.route.cli import build_router
from kvtier.route.prompts import chat_token_ids
from kvtier.testing.app_thread import AppThread
from kvtier.bench.dynamo import DYNAMO_PYTHON, DynamoSelectService

sys.path.insert(0, str(Path(__file__).parents[1] / "integrations"))
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, kv_events_args, start_vllm, wait_for  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=".venv-vllm is missing: `make vllm` creates it (`make test` does)"),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's selection service): `make dynamo` creates it "
                              "(`make test` does)"),
]

MODEL, DEVICE_BLOCKS, PROMPT_CHARS = "smollm2", 32, 1400  # ~400 tokens: 12 full blocks; the device holds 2.5 prompts


@pytest.fixture(scope="module")
def prompts(shakespeare_text) -> list[str]:
    return [shakespeare_text[i * 5000:i * 5000 + PROMPT_CHARS] for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("route")
    shm_dirs, servers, events = [], [], []
    for i in range(2):
        (root / f"r{i}").mkdir()
        endpoint, replay = f"ipc://{root}/r{i}/events.sock", f"ipc://{root}/r{i}/replay.sock"
        shm_dirs.append(Path("/dev/shm") / f"kvtier-route-{uuid.uuid4().hex[:8]}")
        events.append((endpoint, replay))
        servers.append(start_vllm(root / f"r{i}" / "vllm.log", [f"shm:{shm_dirs[-1]}:256MiB"],
                                  num_device_blocks=DEVICE_BLOCKS,
                                  extra_args=(*kv_events_args(endpoint, replay), "--enable-prompt-tokens-details")))
    try:
        with ExitStack() as stack:
            selector = stack.enter_context(DynamoSelectService(root / "select.log"))
            for server in servers:
                stack.callback(server.stop)
            with ThreadPoolExecutor(2) as pool:  # both engines start at once
                list(pool.map(lambda server: server.__enter__(), servers))
            router = build_router([s.url for s in servers], "dynamo", selector_url=selector.url,
                                  tokenizer_path=str(models.cache_dir() / "smollm2-135m-instruct"),
                                  kv_events=[e for e, _ in events], kv_events_replay=[r for _, r in events],
                                  model_name=MODEL, block_size=BLOCK_TOKENS)
            front = stack.enter_context(AppThread(create_app(router), name="router"))
            yield {"servers": servers, "selector": selector, "router": router, "url": front.url}
    finally:
        for shm_dir in shm_dirs:
            shutil.rmtree(shm_dir, ignore_errors=True)


def _indexed(cluster, token_ids: list[int], worker_id: int, tier: str = "device_blocks") -> int:
    """The selector's index: how many of `token_ids`' blocks worker `worker_id` holds in `tier`."""
    return cluster["selector"].overlap(token_ids, model_name=MODEL).get(worker_id, {}).get(tier, 0)


def _warm(cluster, replica: int, prompt: str) -> list[int]:
    """`prompt` sent to replica `replica` (0, 1) directly; its token ids once the selector indexes them."""
    ids = cluster["servers"][replica].complete(prompt, max_tokens=4)["prompt_token_ids"]
    wait_for(lambda: _indexed(cluster, ids, replica + 1), lambda n: n == len(ids) // BLOCK_TOKENS,
          f"replica {replica + 1}'s blocks in the selector's index")
    return ids


def _routed(cluster, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    """Through the router: (the replica that answered, 0 or 1; its reply)."""
    reply = httpx.post(cluster["url"] + path, json={"model": MODEL, "max_tokens": 4, "temperature": 0, **body},
                       timeout=300)
    assert reply.status_code == 200, reply.text
    names = [s.url.removeprefix("http://") for s in cluster["servers"]]
    return names.index(reply.headers[REPLICA_HEADER]), reply.json()


def test_a_request_goes_to_the_replica_that_holds_its_prefix(cluster, prompts):
    ids_a, ids_b = _warm(cluster, 0, prompts[0]), _warm(cluster, 1, prompts[1])
    answered = []
    for prompt in (prompts[0] + " And more.", prompts[1] + " And more.", prompts[0] + " Or else."):
        replica, reply = _routed(cluster, {"prompt": prompt})
        answered.append(replica)
        full = (len(ids_a) if replica == 0 else len(ids_b)) // BLOCK_TOKENS * BLOCK_TOKENS
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= full - BLOCK_TOKENS
    assert answered == [0, 1, 0]
    print(f"\nrouted [0, 1, 0]; last reply cached {reply['usage']['prompt_tokens_details']['cached_tokens']} of "
          f"{reply['usage']['prompt_tokens']} prompt tokens")
    text = httpx.get(cluster["url"] + "/metrics").text
    assert 'kvtier_route_requests_total{code="200",policy="dynamo"' in text


def test_a_chat_request_s_token_ids_are_vllm_s_and_its_prefix_is_found(cluster, prompts):
    body = {"messages": [{"role": "system", "content": prompts[2]}, {"role": "user", "content": "Who speaks?"}],
            "return_token_ids": True}
    first, reply = _routed(cluster, body, "/v1/chat/completions")
    ids = chat_token_ids(cluster["router"].tokenizer, body)
    assert ids == reply["prompt_token_ids"]  # the router's tokens are the replica's: the same block hashes
    wait_for(lambda: _indexed(cluster, ids, first + 1), lambda n: n == len(ids) // BLOCK_TOKENS, "the chat's blocks")
    again = {**body, "messages": [body["messages"][0], {"role": "user", "content": "And then?"}]}
    second, reply = _routed(cluster, again, "/v1/chat/completions")
    assert second == first
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) // BLOCK_TOKENS * BLOCK_TOKENS - \
        2 * BLOCK_TOKENS  # all but the blocks the user turn changed


def test_a_prefix_the_device_evicted_goes_to_the_replica_whose_tier_keeps_it(cluster, prompts):
    ids = _warm(cluster, 1, prompts[3])
    num_blocks = len(ids) // BLOCK_TOKENS
    for prompt in prompts[4:7]:  # 3 x 13 blocks through a 32-block device: prompts[3]'s are reused
        cluster["servers"][1].complete(prompt, max_tokens=4)
    wait_for(lambda: (_indexed(cluster, ids, 2), _indexed(cluster, ids, 2, "host_pinned_blocks")),
          lambda n: n[0] == 0 and n[1] > 0, "the device evicting the prompt while shm keeps it")
    replica, reply = _routed(cluster, {"prompt": prompts[3] + " And more."})
    assert replica == 1  # device 0, host (kvtier's shm) all: Dynamo credits the host tier
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= (num_blocks - 1) * BLOCK_TOKENS
    hits = (reply.get("kv_transfer_params") or {}).get("kvtier_hit_tokens", {})
    assert hits.get("shm", 0) >= (num_blocks - 1) * BLOCK_TOKENS  # loaded from kvtier's tier, not recomputed
    print(f"\nrouted to replica 2: cached {reply['usage']['prompt_tokens_details']['cached_tokens']} of "
          f"{reply['usage']['prompt_tokens']} prompt tokens, kvtier hits {hits}")
    name = cluster["servers"][1].url.removeprefix("http://")
    matched = f'kvtier_route_selector_matched_tokens_total{{policy="dynamo",replica="{name}",tier="cpu"}}'
    assert matched in httpx.get(cluster["url"] + "/metrics").text
