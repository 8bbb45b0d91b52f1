"""vLLM's `--kv-events-config` and its ZMQ publisher, without vLLM (`vllm/distributed/kv_events.py`, 0.32).

`KvEventsConfig` takes vLLM's JSON as it is (same fields, defaults and meaning). `KvEventPublisher` does
what vLLM's `ZmqEventPublisher` does on the wire: a PUB socket (bound for `*`, `::`, `ipc://`, `inproc://`
endpoints, connected otherwise; high-water mark `hwm`) sending each batch as (topic, seq as 8 bytes
big-endian, payload: `wire.encode_batch`), and where `replay_endpoint` is set a ROUTER socket answering a
request (client id, b"", start seq as 8 bytes) with every buffered batch from that seq on (the last
`buffer_steps`), then (b"", seq -1, b"").

One thread does it all: every `interval_s` it answers replay requests and sends what `collect()` returns
(the batch's events, encoded maps; nothing is sent for an empty list). `collect` runs on that thread:
whoever produces the events (the engine's decode loop) only appends to a log `collect` drains.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from kvtier.errors import ConfigError
from kvtier.events.wire import encode_batch
from kvtier.thread_names import named_thread

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
INTERVAL_S = 0.02  # how often the thread collects: events reach subscribers within about this


@dataclass(slots=True)
class KvEventsConfig:
    """vLLM's `KVEventsConfig`: the same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000    # past batches kept for replay
    hwm: int = 100_000            # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # events waiting for the publisher thread (the oldest dropped beyond)
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"kv events publisher must be zmq or null, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"kv events {name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict | KvEventsConfig) -> KvEventsConfig:
        """From vLLM's `--kv-events-config` JSON (or a file's table)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"--kv-events-config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**value)


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ReplayBuffer:
    """The last `size` batches of a stream (seq, payload) and vLLM's replay protocol over them: a request
    (client id, b"", start seq as 8 bytes) on a ROUTER socket is answered with every buffered batch from that
    seq on, each (client, b"", topic, seq, payload), then (client, b"", b"", seq -1, b"")."""

    def __init__(self, size: int, topic: bytes = b"") -> None:
        self._batches: deque[tuple[int, bytes, bytes]] = deque(maxlen=size)
        self._topic = topic

    def append(self, seq: int, payload: bytes, topic: bytes | None = None) -> None:
        self._batches.append((seq, self._topic if topic is None else topic, payload))

    def serve(self, sock) -> None:
        """Answer the one request waiting on `sock` (a ROUTER socket the caller polled)."""
        frames = sock.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV events replay request: %s", frames)
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._batches):
            if seq >= start_seq:
                sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client, b"", b"", END_SEQ, b""))


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, collect: Callable[[], list[dict[str, Any]]], *,
                 data_parallel_rank: int = 0, interval_s: float = INTERVAL_S) -> None:
        import zmq

        self.config, self._collect, self._rank, self._interval_s = config, collect, data_parallel_rank, interval_s
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self.endpoint = self._open(self._pub, config.endpoint, bind=_is_bind_endpoint(config.endpoint))
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint, bind=True)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {config.endpoint}: {exc}") from None
        self._buffer = ReplayBuffer(config.buffer_steps, self._topic)
        self.num_batches = 0
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "kvtier-kv-events")
        self._thread.start()

    @staticmethod
    def _open(sock, endpoint: str, *, bind: bool) -> str:
        """Bind (returning the bound address: a `:0` port resolved) or connect."""
        import zmq

        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode() if endpoint.endswith(":0") else endpoint

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if self._replay is not None:
                if poller.poll(timeout=self._interval_s * 1000):
                    self._serve_replay()
            else:
                self._stop.wait(self._interval_s)
            self._send_collected()
        self._send_collected()  # what was left at close

    def _send_collected(self) -> None:
        try:
            events = self._collect()
            if events:
                self._send(events)
        except Exception:  # noqa: BLE001 — a bad batch must not stop the thread (vLLM's logs and goes on)
            log.exception("publishing KV events failed")
            time.sleep(0.1)

    def _send(self, events: list[dict[str, Any]]) -> None:
        seq, payload = self.num_batches, encode_batch(time.time(), events, self._rank)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append(seq, payload)
        self.num_batches += 1

    def _serve_replay(self) -> None:
        self._buffer.serve(self._replay)

    def close(self) -> None:
        """Send what is left, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=500)
