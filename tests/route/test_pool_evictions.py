"""A block the Redis pool evicts leaves the router's index for every replica when Redis evicts it, not at
some replica's next miss: the pool tier hears Redis's keyspace notification (`tiers/redis_removals.py`), its
replica's event stream announces the block `BlockRemoved` (`SHARED`), and the relay (`route/event_relay.py`)
passes that to every replica on the pool.

Real redis-server on 127.0.0.1 (a small `maxmemory`, `allkeys-lru`), real ZMQ streams in vLLM's wire format,
and, where `.venv-dynamo` exists, NVIDIA Dynamo's selection service reading the relay.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import msgpack
import pytest
import redis
import zmq


from kvtier.bench.pools import RedisServer, Service, _binary
from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.events import wire
from kvtier.events.publisher import KvEventPublisher, KvEventsConfig
from kvtier.events.tracker import BlockInfo, KvEventTracker
from kvtier.ports import free_port
from kvtier.route.event_relay import EventRelay
from kvtier.route.replicas import Replica
from kvtier.route.selectors import DynamoSelector
from kvtier.server.kv_events import to_wire
from kvtier.bench.dynamo import DYNAMO_PYTHON, DynamoSelectService
from kvtier.tiers.manager import TierManager
from kvtier.tiers.redis import redis_tier
from kvtier.tiers.redis_removals import missing_flags
from support.waiting import wait_until

pytestmark = pytest.mark.services

BLOCK = 4
TOKENS = list(range(100, 100 + 4 * BLOCK))
SPACE = KeySpace("test-model", KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=BLOCK))
KEYS = block_keys(SPACE, TOKENS)
HASHES = [wire.block_hash(key) for key in KEYS]
BLOCK_BYTES = 16_000  # ~60 of them fill a 2 MB Redis beside its own ~1 MB
DEADLINE_S = 30.0


class PoolReplica:
    """A replica's tier side as `kvtier serve` runs it (`server/kv_events.py`): a watched Redis pool tier
    whose events its tracker names and a publisher sends on the replica's ZMQ stream."""

    def __init__(self, spec: str, endpoint: str) -> None:
        self.manager = TierManager([redis_tier(spec)], async_writes=False)
        self.tier = self.manager.tiers[0]
        self._log = self.manager.watch()
        self._tracker = KvEventTracker()
        self._lock = threading.Lock()  # the test's describe vs the publisher thread's collect
        self.publisher = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=endpoint),
                                          self._collect)
        self.endpoint = endpoint

    def _collect(self) -> list[dict]:
        with self._lock:
            self._tracker.apply(self._log.take())
            return [to_wire(record, BLOCK) for record in self._tracker.take()]

    def store_chain(self) -> None:
        """The 4 blocks of TOKENS, described (a request's) and written to the pool."""
        infos = [BlockInfo(h, HASHES[i - 1] if i else None, tuple(TOKENS[i * BLOCK:(i + 1) * BLOCK]))
                 for i, h in enumerate(HASHES)]
        with self._lock:
            self._tracker.describe(KEYS, infos)
        self.manager.put_many([(key, bytes(BLOCK_BYTES)) for key in KEYS])

    def close(self) -> None:
        self.publisher.close()
        self.manager.close()


def _wait(fetch, ok, what: str):
    return wait_until(fetch, ok, what, DEADLINE_S)


def _fill_until(pool, done) -> list[bool]:
    """Another server's blocks (an unwatched tier) written into the pool until `done()`; which of the chain's
    blocks the pool holds then."""
    filler = redis_tier(pool.spec)
    try:
        for batch in range(1000):
            if done():
                return filler.contains_many(KEYS)
            filler.put_many([(f"filler-{batch}-{i}".encode(), bytes(BLOCK_BYTES)) for i in range(4)])
            time.sleep(0.02)
        raise AssertionError(f"not done after 4,000 writes: {done()}")
    finally:
        filler.close()


class _Listener:
    """Every batch on a ZMQ stream, decoded (a thread)."""

    def __init__(self, endpoint: str) -> None:
        self.events: list[dict] = []
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _, _, payload = self._sock.recv_multipart()
                self.events += msgpack.unpackb(payload, raw=False)[1]

    def hashes(self, kind: str) -> set[int]:
        return {h for e in list(self.events) if e["type"] == kind and e["medium"] == "SHARED"
                for h in e["block_hashes"]}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)


@pytest.fixture
def pool(tmp_path):
    with RedisServer(tmp_path, maxmemory="2mb") as server:
        yield server


@pytest.fixture
def replicas(pool, tmp_path):
    a, b = (PoolReplica(pool.spec, f"ipc://{tmp_path}/{name}.sock") for name in "ab")
    relay = EventRelay([a.endpoint, b.endpoint], tmp_path / "relay", shared_pool=True).start()
    try:
        for replica in (a, b):
            assert replica.tier._removals.subscribed.wait(DEADLINE_S)
        yield a, b, relay
    finally:
        relay.close()
        a.close()
        b.close()


def test_a_block_redis_evicts_is_removed_for_every_replica_on_the_pool(pool, replicas):
    a, b, relay = replicas
    listeners = [_Listener(endpoint) for endpoint in relay.endpoints]
    try:
        time.sleep(0.5)  # the relay's and the listeners' subscriptions join (ZMQ drops what is published before)
        a.store_chain()
        for listener in listeners:  # a's own stream, and b's with a's pool blocks relayed into it
            _wait(lambda: listener.hashes("BlockStored"), lambda got: got == set(HASHES), "the chain stored")
        # nobody reads the chain again: no miss tells anyone
        held = _fill_until(pool, lambda: all(listener.hashes("BlockRemoved") == set(HASHES) for listener in listeners))
        assert held == [False] * len(KEYS)
    finally:
        for listener in listeners:
            listener.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason="no .venv-dynamo: `make dynamo` creates it (`make test` does)")
def test_dynamo_stops_counting_a_pool_block_once_redis_evicts_it(pool, replicas, tmp_path):
    a, b, relay = replicas
    with DynamoSelectService(tmp_path / "select.log") as service:
        selector = DynamoSelector(service.url, [Replica(1, "http://a", relay.endpoints[0]),
                                                Replica(2, "http://b", relay.endpoints[1])],
                                  model_name="m", block_size=BLOCK)

        async def register() -> None:
            await selector.register()
            await selector.close()

        asyncio.run(register())
        time.sleep(1.0)  # the service's subscriptions join

        def pool_blocks():
            scores = service.overlap(TOKENS, model_name="m")
            return {w: scores.get(w, {}).get("disk_blocks", 0) for w in (1, 2)}

        a.store_chain()
        _wait(pool_blocks, lambda n: n == {1: 4, 2: 4}, "a's pool blocks for a and b")
        held = _fill_until(pool, lambda: pool_blocks() == {1: 0, 2: 0})  # the evicted blocks gone for a and b
        assert not held[0]  # the chain's first block evicted: what follows it is no prefix of anything


def test_the_tier_turns_the_notifications_on_and_keeps_the_server_s_own(tmp_path):
    port = free_port()
    argv = [_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--notify-keyspace-events", "Kl"]
    with Service([(argv, port)], tmp_path):
        tier = redis_tier(f"redis://127.0.0.1:{port}/0")
        try:
            TierManager([tier], async_writes=False).watch()
            assert tier._removals.subscribed.wait(DEADLINE_S) and tier._removals.configured
            flags = redis.Redis(port=port).config_get("notify-keyspace-events")["notify-keyspace-events"]
            assert set(flags) == set("KlEexg")
        finally:
            tier.close()
    assert missing_flags("") == "Eexg" and missing_flags("AE") == "" and missing_flags("KEA") == ""


def test_a_redis_that_refuses_config_is_logged_once_and_misses_still_announce(tmp_path, caplog):
    """A managed Redis without CONFIG: today's behaviour, said once."""
    port = free_port()
    argv = [_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--rename-command", "CONFIG", ""]
    with Service([(argv, port)], tmp_path), caplog.at_level(logging.WARNING, "kvtier.tiers.redis_removals"):
        tier = redis_tier(f"redis://127.0.0.1:{port}/0")
        try:
            log = TierManager([tier], async_writes=False).watch()
            assert tier._removals.subscribed.wait(DEADLINE_S) and tier._removals.configured is False
            client = redis.Redis(port=port)
            watcher_ids = {c["id"] for c in client.client_list(_type="pubsub")}
            client.client_kill_filter(_type="pubsub")  # the watcher reconnects (and meets the refusal again)
            _wait(lambda: {c["id"] for c in client.client_list(_type="pubsub")} - watcher_ids, bool, "resubscribed")
            tier.put_many([(KEYS[0], b"x")])
            client.flushdb()  # gone without a notification
            assert tier.contains_many(KEYS[:1]) == [False]
            assert [(e.stored, e.keys) for e in log.take()] == [(True, (KEYS[0],)), (False, (KEYS[0],))]
        finally:
            tier.close()
    assert [r.message.count("refused CONFIG") for r in caplog.records] == [1]
