"""Redis's own word on what left the pool: keyspace notifications of keys evicted (`maxmemory-policy`),
expired or deleted, so a Redis pool tier announces a block gone when Redis lets it go, not at the
tier's next miss of it (`tiers/pool.py`).

Redis publishes them only for the classes `notify-keyspace-events` names. The watcher adds what it needs
(`E`: the keyevent channels; `e` evicted, `x` expired, `g` del) to whatever the server already has, so
the operator configures nothing, and subscribes to `__keyevent@<db>__:evicted` / `:expired` / `:del` on a
connection of its own (a thread; it reconnects after a failure). A server that refuses `CONFIG`
(a managed Redis, an ACL) is logged once: the watcher still listens (the operator may have set the
flags), and without them the tier learns an eviction at its next miss, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis as redis_client
from kvtier.thread_names import named_thread

log = logging.getLogger(__name__)

CLASS_TO_EVENT = {"e": "evicted", "x": "expired", "g": "del"}
FLAGS = "E" + "".join(CLASS_TO_EVENT)  # what the notifications need
_ALL_ALIAS = "g$lshzxetd"  # what Redis's `A` stands for
TIMEOUT_S = 2.0
POLL_S = 0.5     # how long a read waits for a notification before looking at `close()`
RETRY_S = 1.0    # after a lost connection
MAX_BATCH = 4096  # names handed over at once


def missing_flags(flags: str) -> str:
    """The classes of FLAGS that `flags` (`CONFIG GET notify-keyspace-events`) lacks."""
    have = set(flags) | (set(_ALL_ALIAS) if "A" in flags else set())
    return "".join(f for f in FLAGS if f not in have)


class RedisRemovals:
    """Calls `on_removed(names)` from its thread with the names of keys the server at `url` evicted,
    expired or deleted (every key of the database: the caller picks its own)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.configured: bool | None = None  # the flags are on (set or found); False: CONFIG refused
        self.num_removed = 0
        self.subscribed = threading.Event()  # listening (set again after each reconnect)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_removed: Callable[[list[str]], None] = lambda names: None

    def start(self, on_removed: Callable[[list[str]], None]) -> None:
        assert self._thread is None, "started twice"
        self._on_removed = on_removed
        self._thread = named_thread(self._run, "kvtier-redis-rm")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(POLL_S + TIMEOUT_S + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except redis_client.RedisError as exc:
                log.debug("redis removals: %s; listening again in %.0f s", exc, RETRY_S)
            self.subscribed.clear()
            self._stop.wait(RETRY_S)

    def _listen(self) -> None:
        client = redis_client.Redis.from_url(self.url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        pubsub = client.pubsub()
        try:
            self._configure(client)
            db = client.connection_pool.connection_kwargs.get("db", 0)
            channels = [f"__keyevent@{db}__:{event}" for event in CLASS_TO_EVENT.values()]
            pubsub.subscribe(*channels)
            for _ in channels:  # each confirmed: every removal from now on reaches us
                if pubsub.get_message(timeout=TIMEOUT_S) is None:
                    raise redis_client.TimeoutError("SUBSCRIBE not confirmed")
            self.subscribed.set()
            while not self._stop.is_set():
                if names := self._drain(pubsub):
                    self.num_removed += len(names)
                    self._on_removed(names)
        finally:
            pubsub.close()
            client.close()

    def _configure(self, client: redis_client.Redis) -> None:
        """The notifications FLAGS needs on, the server's other classes kept; a refusal logged once."""
        try:
            flags = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            if missing := missing_flags(flags):
                client.config_set("notify-keyspace-events", flags + missing)
            self.configured = True
        except redis_client.ResponseError as exc:
            if self.configured is None:  # (the server's address, not the URL: it may carry a password)
                where = client.connection_pool.connection_kwargs
                log.warning("redis %s refused CONFIG (%s): a block the pool evicts is known gone only when a "
                            "replica misses it; set `notify-keyspace-events %s` on the server to announce it "
                            "at once", where.get("path") or f"{where.get('host')}:{where.get('port')}", exc, FLAGS)
            self.configured = False

    @staticmethod
    def _drain(pubsub) -> list[str]:
        """The keys removed since the last call: waits up to POLL_S for the first, then takes what has arrived."""
        names: list[str] = []
        message = pubsub.get_message(timeout=POLL_S)
        while message is not None:
            if message["type"] == "message":
                names.append(message["data"].decode(errors="replace"))
            if len(names) >= MAX_BATCH:
                break
            message = pubsub.get_message(timeout=0)
        return names
