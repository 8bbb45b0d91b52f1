"""The replicas' KV events on their way to the selector (`route/event_relay.py`): each salted block with its tenant's
`cache_salt` (vLLM puts the salt in a first block's `extra_keys` only, where NVIDIA Dynamo does not look), and
replicas on one pool announcing each other's `SHARED` blocks, so Dynamo's real selection service
(`.venv-dynamo`) keeps two tenants' identical prompts apart and matches a block replica A put in the pool for
replica B too, and neither once the pool lost it.

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

from kvtier.events.wire import decode_batch as decode  # noqa: E402
from kvtier.route.event_relay import EventRelay, Tenants, shared_part  # noqa: E402
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



def _salted(events: list[dict], salt: str, lora_name: str | None = None) -> list[dict]:
    """vLLM's own form of a salted chain: the salt in the first block's `extra_keys` (after a LoRA name), no
    `cache_salt` field."""
    first = dict(events[0], lora_name=lora_name, extra_keys=[[lora_name, ["mm-1", 0], salt, b"embeds"]
                                                               if lora_name else [salt]])
    return [first, *events[1:]]


def test_only_a_batch_s_shared_blocks_are_relayed():
    events = _stored([1, 2], "GPU") + _stored([11, 12], "SHARED") + _removed([5], "CPU") + _removed([11], "SHARED")
    ts, relayed, dp_rank = shared_part(decode(_batch(events)))
    assert relayed == events[2:4] + events[5:] and dp_rank == 0
    assert shared_part(decode(_batch(_stored([1], "CPU") + [{"type": "AllBlocksCleared"}]))) is None


def test_a_salted_chain_carries_its_tenant_on_every_block_in_every_medium_across_batches():
    tenants = Tenants()
    chain = _salted(_stored([1, 2, 3, 4], "GPU"), "tenant-a")
    first, rest = decode(_batch(chain[:1])), decode(_batch(chain[1:] + _stored([1, 2], "STORAGE")[1:]))
    assert tenants.tag(first) and tenants.tag(rest)  # the children learn the salt from their parent's batch
    assert [e["cache_salt"] for e in first[1] + rest[1]] == ["tenant-a"] * 5
    unsalted = decode(_batch(_stored([21, 22], "GPU") + _removed([1], "GPU")))
    assert not tenants.tag(unsalted) and all("cache_salt" not in e for e in unsalted[1])  # passed on as it came
    lora = decode(_batch(_salted(_stored([31, 32], "CPU"), "tenant-b", lora_name="adapter")))
    assert tenants.tag(lora) and [e["cache_salt"] for e in lora[1]] == ["tenant-b"] * 2  # not the LoRA's name
    forgetful = Tenants(max_blocks=2)
    forgetful.tag(decode(_batch(_salted(_stored([41, 42, 43], "GPU"), "t"))))
    orphan = decode(_batch(_stored([41, 42, 43, 44], "GPU")[3:]))  # parent 43: still known
    early = decode(_batch(_stored([41, 42], "GPU")[1:]))  # parent 41: forgotten (the oldest of 3)
    assert forgetful.tag(orphan) and not forgetful.tag(early)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason="no .venv-dynamo: `make dynamo` creates it (`make test` does)")
def test_two_tenants_identical_prompts_stay_apart_in_the_selector_behind_the_relay(tmp_path):
    """One replica's device events as vLLM 0.32 sends them (the salt only in a first block's `extra_keys`),
    tenant a's prompt and then tenant b's identical one: through the relay each is matched under its own salt
    only, and no unsalted request matches either (straight from vLLM, Dynamo's index merges them unsalted)."""
    a = EventPublisher(f"ipc://{tmp_path}/a.sock")
    relay = EventRelay([a.endpoint], tmp_path / "relay").start()
    try:
        with DynamoSelectService(tmp_path / "select.log") as service:
            replicas = [Replica(1, "http://a", relay.endpoints[0])]
            selector = DynamoSelector(service.url, replicas, model_name="m", block_size=BLOCK)

            async def device_blocks(salt: str | None) -> int:
                choice = await selector.choose(TOKENS + [1], replicas, cache_salt=salt)
                await selector.finished(choice)
                return choice.matched_tokens["gpu"] // BLOCK

            async def until(salt: str | None, blocks: int) -> None:
                for _ in range(100):
                    if await device_blocks(salt) == blocks:
                        return
                    await asyncio.sleep(0.2)
                raise AssertionError(f"{salt}: never {blocks} blocks")

            async def scenario() -> list[int]:
                await selector.register()
                await asyncio.sleep(1.0)  # the subscriptions join (ZMQ drops what is published before)
                chain_a = _salted(_stored([1, 2, 3, 4], "GPU"), "tenant-a")
                a.publish(chain_a[:2])
                a.publish(chain_a[2:])  # a later step's blocks: no salt of their own, only a parent
                await until("tenant-a", 4)
                seen = [await device_blocks(salt) for salt in (None, "tenant-b")]
                a.publish(_salted(_stored([11, 12, 13, 14], "GPU"), "tenant-b"))  # the same tokens, b's hashes
                await until("tenant-b", 4)
                seen += [await device_blocks(salt) for salt in ("tenant-a", None)]
                await selector.close()
                return seen

            seen = asyncio.run(scenario())
    finally:
        relay.close()
        a.sock.close(0)
    assert seen == [0, 0, 4, 0] and relay.num_salted == 3


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
    relay = EventRelay([a.endpoint, b.endpoint], tmp_path / "relay", shared_pool=True).start()  # c: another pool
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


@pytest.mark.parametrize("shared_pool, host", [(True, None), (False, "127.0.0.1")])
def test_kvtier_route_points_the_selector_at_the_relay(tmp_path, shared_pool, host):
    """With or without a shared pool, the selector reads the relay's streams (tenants are tagged on both), on
    ipc sockets or on TCP at `--events-host`; the relay asks the replicas' replay endpoints for its gaps."""
    from kvtier.route.cli import build_router

    sources = [f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]
    replays = [f"ipc://{tmp_path}/ra.sock", f"ipc://{tmp_path}/rb.sock"]
    router = build_router(["http://a", "http://b"], "least-loaded", kv_events=sources, kv_events_replay=replays,
                          shared_pool=shared_pool, events_host=host)
    try:
        relay = router.event_relay
        assert [r.kv_events_endpoint for r in router.replicas.replicas] == relay.endpoints
        assert relay.sources == sources and relay.source_replays == replays and relay.shared_pool == shared_pool
        assert all(e.startswith("tcp://127.0.0.1:" if host else "ipc://") for e in relay.endpoints)
        # the relay numbers its streams anew and answers their replay requests itself
        assert [r.kv_events_replay_endpoint for r in router.replicas.replicas] == relay.replay_endpoints
    finally:
        asyncio.run(router.close())
    assert not router.event_relay._thread.is_alive()


def test_a_selector_that_missed_relayed_batches_gets_them_back_by_number(tmp_path):
    """vLLM's replay protocol on the relay's own numbering: a request for the batches from seq 1 on gets
    replica b's stream as relayed (its own batch 0, then a's shared blocks as batch 1), then the end mark."""
    import zmq

    a, b = EventPublisher(f"ipc://{tmp_path}/a.sock"), EventPublisher(f"ipc://{tmp_path}/b.sock")
    relay = EventRelay([a.endpoint, b.endpoint], tmp_path / "relay", shared_pool=True).start()
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


def test_a_hot_salted_prefix_stays_known_while_its_children_keep_coming():
    """The salt table is bounded, but a parent a new block names is a use: a tenant's system prompt that every
    request extends keeps tagging its children however many other chains come and go."""
    tenants = Tenants(max_blocks=3)
    tenants.tag(decode(_batch(_salted(_stored([1], "GPU"), "tenant-a"))))
    for k in range(10):
        tenants.tag(decode(_batch(_salted(_stored([20 + k], "GPU"), "tenant-b"))))  # another tenant's new root
        child = decode(_batch([dict(_stored([1, 30 + k], "GPU")[1], parent_block_hash=1)]))
        assert tenants.tag(child) and child[1][0]["cache_salt"] == "tenant-a"


def _relayed(sub, n: int) -> list[list[int]]:
    """The block hashes of the next `n` batches on a relay's stream, one list per batch."""
    out = []
    for _ in range(n):
        assert sub.poll(5000), f"only {len(out)} of {n} batches relayed"
        _, _, payload = sub.recv_multipart()
        out.append([h for e in decode(payload)[1] for h in e.get("block_hashes", [])])
    return out


def _subscriber(endpoint: str):
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


@pytest.mark.parametrize("with_replay", [True, False])
def test_a_gap_in_a_replica_s_stream_is_asked_for_at_its_replay_endpoint(tmp_path, with_replay):
    """Batch 1 never reaches the relay (a queue overflowed): the relay asks the replica's replay socket for it
    (vLLM's protocol) and relays 0, 1, 2 in order; with no replay endpoint it counts one missed batch. Over TCP
    (`host`: a selector on another machine)."""
    import zmq

    from kvtier.events.publisher import ReplayBuffer

    a = EventPublisher(f"ipc://{tmp_path}/a.sock")
    buffer, router = ReplayBuffer(100), zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/a-replay.sock")
    relay = EventRelay([a.endpoint], tmp_path / "relay", host="127.0.0.1",
                       source_replays=[f"ipc://{tmp_path}/a-replay.sock" if with_replay else None]).start()
    sub = _subscriber(relay.endpoints[0])
    try:
        assert relay.endpoints[0].startswith("tcp://127.0.0.1:")
        time.sleep(0.5)  # the subscriptions join
        for seq, hashes in enumerate([[1], [2], [3]]):
            buffer.append(seq, _batch(_stored(hashes, "GPU")))
            if seq != 1:
                a.sock.send_multipart((b"", seq.to_bytes(8, "big"), _batch(_stored(hashes, "GPU"))))
            if seq == 2 and with_replay:
                assert router.poll(5000)
                buffer.serve(router)  # the relay's request for batch 1
        got = _relayed(sub, 3 if with_replay else 2)
    finally:
        sub.close(0)
        relay.close()
        router.close(0)
        a.sock.close(0)
    assert got == ([[1], [2], [3]] if with_replay else [[1], [3]])
    assert relay.num_missed == (0 if with_replay else 1)


def test_what_a_replica_sends_that_is_not_vllm_s_never_stops_the_relay(tmp_path):
    a = EventPublisher(f"ipc://{tmp_path}/a.sock")
    relay = EventRelay([a.endpoint], tmp_path / "relay").start()
    sub = _subscriber(relay.endpoints[0])
    odd = msgpack.packb({"events": []})  # a map, not vLLM's batch
    try:
        time.sleep(0.5)
        a.sock.send_multipart((b"", (0).to_bytes(8, "big"), odd))
        a.sock.send_multipart((b"", b"two frames"))
        a.publish(_stored([7], "GPU"))
        assert sub.poll(5000) and sub.recv_multipart()[2] == odd  # passed on as it came
        assert _relayed(sub, 1) == [[7]]  # the 2-frame message dropped, the relay still going
        assert relay.num_unreadable == 2 and relay._thread.is_alive()
    finally:
        sub.close(0)
        relay.close()
        a.sock.close(0)


def test_a_relay_that_cannot_start_says_why_and_leaves_nothing():
    import zmq

    relay = EventRelay(["bogus://nowhere"])
    with pytest.raises(zmq.ZMQError):
        relay.start()
    assert not relay._dir.exists() and not relay._thread.is_alive()
