"""The Redis pool tier: blocks as Redis strings, the server's `maxmemory-policy allkeys-lru`
doing the eviction. Start a server for it with

    redis-server --bind 127.0.0.1 --port 6379 --maxmemory 8gb --maxmemory-policy allkeys-lru --save ''

and use the tier spec `redis://127.0.0.1:6379/0`. A tier whose events are watched turns on the server's
keyspace notifications of evicted keys itself (`redis_removals.py`).
"""

from __future__ import annotations

import redis as redis_client

from kvtier.tiers.pool import PoolError, PoolTier
from kvtier.tiers.redis_removals import RedisRemovals

TIMEOUT_S = 2.0


class RedisBackend:
    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis_client.Redis | None = None

    def _call(self, fn):
        if self._client is None:
            raise PoolError("not connected")
        try:
            return fn(self._client)
        except redis_client.RedisError as exc:
            raise PoolError(f"{type(exc).__name__}: {exc}") from exc

    def connect(self) -> None:
        """A client over a connection pool: thread-safe, so the reader and the writer each get a
        connection and a lookup never waits behind a slow put."""
        client = redis_client.Redis.from_url(self.url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        try:
            client.ping()
        except redis_client.RedisError as exc:
            client.close()
            raise PoolError(f"{type(exc).__name__}: {exc}") from exc
        self._client = client

    def exists(self, names: list[str]) -> list[bool]:
        def run(c):
            pipe = c.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]
        return self._call(run)

    def get(self, names: list[str]) -> list[bytes | None]:
        return self._call(lambda c: c.mget(names))

    def lease(self, names: list[str]) -> list[tuple[bytes, None] | None]:
        """Redis hands out copies: `get`'s bytes, nothing to give back."""
        return [None if data is None else (data, None) for data in self.get(names)]

    def release(self, buffers: list[object]) -> None:
        pass

    def put(self, items: list[tuple[str, bytes]]) -> None:
        def run(c):
            pipe = c.pipeline(transaction=False)
            for name, data in items:
                pipe.set(name, data, nx=True)  # content-addressed: an existing block is the same block
            pipe.execute()
        self._call(run)

    def remove(self, name: str) -> bool:
        return bool(self._call(lambda c: c.delete(name)))

    def used_bytes(self) -> int | None:
        return int(self._call(lambda c: c.info("memory"))["used_memory"])

    def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                client.close()
            except redis_client.RedisError:
                pass


def redis_tier(url: str, *, connect: bool = True) -> PoolTier:
    """Watched, the tier announces a block Redis evicts when Redis says so (`redis_removals.py`)."""
    return PoolTier("redis", RedisBackend(url), connect=connect, removals=RedisRemovals(url))
