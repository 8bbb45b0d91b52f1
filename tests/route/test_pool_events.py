"""A shared pool's blocks in the router's index (`route/pool_events.py`): replicas on one pool announce
each other's `SHARED` blocks through the relay, so NVIDIA Dynamo's real selection service (`.venv-dynamo`)
matches a block replica A put in the pool for replica B too, and neither once the pool lost it.

The replicas here are ZMQ publishers of vLLM's wire format (msgpack `KVEventBatch`: [ts, events, dp_rank],
each event a map tagged `type`), as `tests/integrations/test_vllm_kv_events.py` records it from real vLLM.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import EventPublisher, batch as _batch  # noqa: E402

from kvtier.route.pool_events import PoolEventRelay, shared_part  # noqa: E402
from kvtier.route.replicas import Replica  # noqa: E402
from kvtier.route.selectors import DynamoSelector  # noqa: E402
from support.waiting import wait_until  # noqa: E402
from kvtier.bench.dynamo import DYNAMO_PYTHON, DynamoSelectService  # noqa: E402

BLOCK = 4
TOKENS = list(range(100, 100 + 4 * BLOCK))


def _stored(hashes: list[int], medium: str) -> list[dict]:
    """A chain of blocks over TOKENS (vLLM's `BlockStored`, one per block)."""
    return [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": hashes[i - 1] if i else None,
             "token_ids": TOKENS[i * BLOCK:(i + 1) * BLOCK], "block_size": BLOCK, "lora_id": None,
             "medium": medium, "lora_name": None, "extra_keys": None} for i, h in enumerate(hashes)]


def _removed(hashes: list[int], medium: str) -> list[dict]:
    return [{"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}]



def test_only_a_batch_s_shared_blocks_are_relayed():
    events = _stored([1, 2], "GPU") + _stored([11, 12], "SHARED") + _removed([5], "CPU") + _removed([11], "SHARED")
    ts, relayed, dp_rank = msgpack.unpackb(shared_part(_batch(events)), raw=False)
    assert relayed == events[2:4] + events[5:] and dp_rank == 0
    assert shared_part(_batch(_stored([1], "CPU") + [{"type": "AllBlocksCleared"}])) is None


async def _register(selector: DynamoSelector) -> None:
    """The router's registration of its replicas (the service subscribes to their streams from then on)."""
    await selector.register()
    await selector.close()


def _wait(fetch, ok, what: str, timeout_s: float = 20.0):
    return wait_until(fetch, ok, what, timeout_s, poll_s=0.2)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason="no .venv-dynamo: `make dynamo` creates it (`make test` does)")
def test_a_block_one_replica_put_in_the_pool_is_a_hit_for_every_replica_on_it(tmp_path):
    a, b, c = (EventPublisher(f"ipc://{tmp_path}/{name}.sock") for name in "abc")
    relay = PoolEventRelay([a.endpoint, b.endpoint], tmp_path / "relay").start()  # a, b share the pool; c does not
    try:
        with DynamoSelectService(tmp_path / "select.log") as service:
            replicas = [Replica(1, "http://a", relay.endpoints[0]), Replica(2, "http://b", relay.endpoints[1]),
                        Replica(3, "http://c", c.endpoint)]
            asyncio.run(_register(DynamoSelector(service.url, replicas, model_name="m", block_size=BLOCK)))
            time.sleep(1.0)  # the subscriptions join (ZMQ drops what is published before)

            def blocks():
                scores = service.overlap(TOKENS, model_name="m")
                return {w: (scores.get(w, {}).get("device_blocks", 0), scores.get(w, {}).get("disk_blocks", 0))
                        for w in (1, 2, 3)}

            a.publish(_stored([1, 2], "GPU"))          # a's device holds 2 blocks
            a.publish(_stored([1, 2, 3, 4], "SHARED"))  # and put all 4 in the pool (the same hashes)
            c.publish(_stored([1, 2], "SHARED"))  # c's pool is another one: its blocks stay c's
            _wait(blocks, lambda n: n == {1: (2, 4), 2: (0, 4), 3: (0, 2)}, "a's pool blocks for b, c's for c")
            assert relay.num_relayed == 1  # a's shared batch, into b's stream; a's device batch is a's own
            a.publish(_removed([3, 4], "SHARED"))  # the pool lost 2 of them: a found them gone
            _wait(blocks, lambda n: n == {1: (2, 2), 2: (0, 2), 3: (0, 2)}, "the lost blocks gone for a and b")
            b.publish(_removed([1, 2], "SHARED"))  # b finds the rest gone
            _wait(blocks, lambda n: n == {1: (2, 2), 2: (0, 0), 3: (0, 2)}, "b's loss a miss for both")
    finally:
        relay.close()
        for replica in (a, b, c):
            replica.sock.close(0)


def test_kvtier_route_shared_pool_points_the_selector_at_the_relay(tmp_path):
    from kvtier.route.cli import build_router

    sources = [f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]
    router = build_router(["http://a", "http://b"], "least-loaded", kv_events=sources,
                          kv_events_replay=[f"ipc://{tmp_path}/ra.sock", f"ipc://{tmp_path}/rb.sock"], shared_pool=True)
    try:
        assert [r.kv_events_endpoint for r in router.replicas.replicas] == router.pool_relay.endpoints
        assert router.pool_relay.sources == sources
        # the relay numbers its streams anew and answers their replay requests itself
        assert [r.kv_events_replay_endpoint for r in router.replicas.replicas] == router.pool_relay.replay_endpoints
    finally:
        asyncio.run(router.close())
    assert not router.pool_relay._thread.is_alive()


def test_a_selector_that_missed_relayed_batches_gets_them_back_by_number(tmp_path):
    """vLLM's replay protocol on the relay's own numbering: a request for the batches from seq 1 on gets
    replica b's stream as relayed (its own batch 0, then a's shared blocks as batch 1), then the end mark."""
    import zmq

    a, b = EventPublisher(f"ipc://{tmp_path}/a.sock"), EventPublisher(f"ipc://{tmp_path}/b.sock")
    relay = PoolEventRelay([a.endpoint, b.endpoint], tmp_path / "relay").start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(relay.endpoints[1])
        time.sleep(0.5)  # the relay's and this subscription join (ZMQ drops what is published before)
        b.publish(_stored([7], "GPU"))
        time.sleep(0.3)
        a.publish(_stored([1, 2], "SHARED"))
        live = [sub.recv_multipart() for _ in range(2)]  # what the selector would have read
        sub.close(0)
        dealer.connect(relay.replay_endpoints[1])
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((topic, seq, payload))
    finally:
        dealer.close(0)
        relay.close()
        a.sock.close(0)
        b.sock.close(0)
    assert [int.from_bytes(f[1], "big") for f in live] == [0, 1]
    assert replayed == [tuple(live[1])]
    assert [e["block_hashes"] for e in msgpack.unpackb(replayed[0][2], raw=False)[1]] == [[1], [2]]
