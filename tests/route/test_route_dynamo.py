"""`kvtier route --policy dynamo` against the real NVIDIA Dynamo selection service (`.venv-dynamo`, in a network
namespace of its own where root allows) and stub replicas: the router speaks its 1.6.1 API (register,
select, book, prefill done, free) and the prefill it books steers the next requests."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import EventPublisher, StubReplica, router_over, running, stored_chain  # noqa: E402

from kvtier.route.app import REPLICA_HEADER  # noqa: E402
from kvtier.route.replicas import Replica  # noqa: E402
from kvtier.route.selectors import DynamoSelector  # noqa: E402
from kvtier.server.tokenizer import ByteTokenizer  # noqa: E402
from kvtier.bench.dynamo import DYNAMO_PYTHON, DynamoSelectService  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's selection service): `make dynamo` creates it "
                              "(`make test` does)"),
]

PROMPT = {"model": "smollm2", "prompt": "the same prompt, long enough for two blocks", "max_tokens": 4}


def test_the_real_selector_books_each_request_s_load_and_frees_it(tmp_path):
    hold = {"event": threading.Event()}
    stubs = [StubReplica("a", hold_first=hold), StubReplica("b", hold_first=hold)]
    with DynamoSelectService(tmp_path / "select.log") as selector, running(*stubs) as urls, \
            router_over(urls, "dynamo", tokenizer=ByteTokenizer(), selector_url=selector.url,
                        kv_events=[f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]) as (url, router):
        workers = httpx.get(selector.url + "/workers").json()
        assert sorted(w["worker_id"] for w in workers) == [1, 2]
        held = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=PROMPT, timeout=30))
        held.start()
        while not any(r.num_in_flight for r in router.replicas.replicas):
            time.sleep(0.01)
        busy = next(r for r in router.replicas.replicas if r.num_in_flight)
        # nothing cached anywhere: the prefill booked on the first replica sends the same prompt elsewhere
        for _ in range(3):
            reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=10)
            assert reply.status_code == 200 and reply.headers[REPLICA_HEADER] != busy.name
        hold["event"].set()
        held.join()
        assert not router.selector_down
        metrics = httpx.get(url + "/metrics").text
    assert 'kvtier_route_requests_total{code="200",policy="dynamo"' in metrics
    assert "kvtier_route_selector_fallbacks_total 0.0" in metrics


def test_requests_arriving_together_are_each_booked_before_the_next_is_chosen(tmp_path):
    """Nothing cached anywhere: 4 requests sent at once, all still in prefill, spread over both replicas
    (each selection sees the prefill the previous one booked), not all onto the worker an unbooked tie favours."""
    gate = threading.Event()
    stubs = [StubReplica("a", hold_all=gate), StubReplica("b", hold_all=gate)]
    with DynamoSelectService(tmp_path / "select.log") as selector, running(*stubs) as urls, \
            router_over(urls, "dynamo", tokenizer=ByteTokenizer(), selector_url=selector.url,
                        kv_events=[f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]) as (url, router):
        replies = []
        threads = [threading.Thread(target=lambda: replies.append(
            httpx.post(url + "/v1/completions", json=PROMPT, timeout=30))) for _ in range(4)]
        for thread in threads:
            thread.start()
        while len(stubs[0].bodies) + len(stubs[1].bodies) < 4:  # all 4 arrived, none answered
            time.sleep(0.01)
        gate.set()
        for thread in threads:
            thread.join()
    assert [r.status_code for r in replies] == [200] * 4
    assert sorted(len(s.bodies) for s in stubs) == [2, 2]


def _choice_of_a_cached_turn_beside_running_requests(tmp_path, env: dict[str, str] | None) -> int:
    """Replica 1 holds a conversation's 13-block prefix in its host tier (`CPU`, credit 0.75 each) and runs
    2 requests of 13 blocks, replica 2 runs one: which replica the selector picks for the turn (16 blocks)."""
    block = 4
    tmp_path.mkdir()
    a, b = EventPublisher(f"ipc://{tmp_path}/a.sock"), EventPublisher(f"ipc://{tmp_path}/b.sock")
    prefix = list(range(100, 100 + 13 * block))
    running = [list(range(1000 * i, 1000 * i + 13 * block)) for i in (1, 2, 3)]
    try:
        with DynamoSelectService(tmp_path / "select.log", env=env) as service:
            replicas = [Replica(1, "http://a", a.endpoint), Replica(2, "http://b", b.endpoint)]
            selector = DynamoSelector(service.url, replicas, model_name="m", block_size=block)
            asyncio.run(selector.register())
            time.sleep(1.0)  # the subscriptions join (ZMQ drops what is published before)
            a.publish(stored_chain(prefix, 1, block, "CPU"))
            deadline = time.monotonic() + 20
            while service.overlap(prefix, model_name="m").get(1, {}).get("host_pinned_blocks") != 13:
                assert time.monotonic() < deadline, "replica 1's host blocks never reached the index"
                time.sleep(0.2)
            for i, (tokens, where) in enumerate(zip(running, (1, 1, 2))):  # booked where they run, past prefill
                httpx.post(service.url + "/reservations", json={"model_name": "m", "worker_id": where,
                                                                "token_ids": tokens, "selection_id": f"r{i}"}
                           ).raise_for_status()
                httpx.post(service.url + f"/reservations/r{i}/prefill_complete").raise_for_status()
            turn = prefix + [7] * 3 * block
            picked = httpx.post(service.url + "/select", json={"model_name": "m", "token_ids": turn,
                                                               "selection_id": "turn"}).json()
            return picked["worker_id"]
    finally:
        a.sock.close(0)
        b.sock.close(0)


def test_the_selector_s_prefill_load_scale_keeps_a_cached_turn_on_its_busier_replica(tmp_path):
    """Dynamo's cost per replica: prefill_load_scale x (blocks to compute after the cached prefix's credit)
    + the blocks of the requests it runs. Scale 1 (its default): replica 1 costs (16 - 9.75) + 42 against
    replica 2's 16 + 29 and the turn moves; `DYN_ROUTER_PREFILL_LOAD_SCALE=4` (what `bench route`'s
    `dynamo:4` starts the service with) makes it 25 + 42 against 64 + 29 and the turn stays."""
    assert _choice_of_a_cached_turn_beside_running_requests(tmp_path / "s1", None) == 2
    scaled = {"DYN_ROUTER_PREFILL_LOAD_SCALE": "4"}
    assert _choice_of_a_cached_turn_beside_running_requests(tmp_path / "s4", scaled) == 1


def test_the_real_selector_matches_a_tenant_s_blocks_under_its_cache_salt_only(tmp_path):
    """Blocks announced with `cache_salt` (as kvtier serve's events carry it) are a match for a selection
    with that salt, and for none without it or with another (`DynamoSelector.choose(..., cache_salt=)`)."""
    block, tokens = 4, list(range(100, 116))
    a, b = EventPublisher(f"ipc://{tmp_path}/a.sock"), EventPublisher(f"ipc://{tmp_path}/b.sock")
    replicas = [Replica(1, "http://a", a.endpoint), Replica(2, "http://b", b.endpoint)]
    try:
        with DynamoSelectService(tmp_path / "select.log") as service:
            selector = DynamoSelector(service.url, replicas, model_name="m", block_size=block)

            async def matched(salt: str | None) -> dict:
                choice = await selector.choose(tokens + [1], replicas, cache_salt=salt)
                await selector.finished(choice)
                return {"replica": choice.replica.replica_id, "gpu": choice.matched_tokens["gpu"]}

            async def scenario() -> list[dict]:
                await selector.register()
                await asyncio.sleep(1.0)  # the subscriptions join (ZMQ drops what is published before)
                a.publish([dict(e, cache_salt="tenant-a") for e in stored_chain(tokens, 1, block, "GPU")])
                for _ in range(50):
                    if (await matched("tenant-a"))["gpu"]:
                        break
                    await asyncio.sleep(0.2)
                out = [await matched(salt) for salt in ("tenant-a", None, "tenant-b")]
                await selector.close()
                return out

            found = asyncio.run(scenario())
    finally:
        a.sock.close(0)
        b.sock.close(0)
    assert found[0] == {"replica": 1, "gpu": 16}
    assert found[1]["gpu"] == 0 and found[2]["gpu"] == 0
