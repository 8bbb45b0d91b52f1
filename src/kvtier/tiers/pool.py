"""What the two pooled-memory tiers (Mooncake Store, Redis) share: a remote key-value service that
many servers use at once, so one server's prefix serves another.

The service owns capacity and eviction (`capacity_bytes` is None). A watched tier announces a block gone
when the service says it let it go (Redis's keyspace notifications: `redis_removals.py`), else at the
tier's next miss of it (Mooncake says nothing, and its existence query renews a lease: asking in the
background would keep alive what it asks about). A backend only says how to
connect, test, read, write and remove; this class turns every failure into a counted error and
turns the tier's reads and writes off (`health.fail`) — the manager then skips it — and
`reconnect()` (the manager's background probe) builds a fresh connection. A refused write on a full
pool is counted and dropped; the tier stays up. A pool tier never raises into the manager and never
blocks it longer than the backend's own timeouts. Backends take one reader and one writer at a time
(Redis: a client over a connection pool; Mooncake: a store client that releases the GIL and splits
its transfer buffer between the two), so a slow put never holds up a lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from kvtier.tiers.base import TierStats
from kvtier.tiers.buffers import Leases
from kvtier.tiers.events import TierEvents, announce_removed, announce_stored
from kvtier.tiers.health import TierHealth

log = logging.getLogger(__name__)
KEY_PREFIX = "kvtier:"


class PoolError(RuntimeError):
    """The backend failed (service down, timeout, out of space): not a miss."""


class PoolFullError(PoolError):
    """The service is up but refused the write (no space): counted and dropped, the tier stays healthy."""


class Backend(Protocol):
    def connect(self) -> None: ...                                   # raise PoolError
    def exists(self, names: list[str]) -> list[bool]: ...
    def get(self, names: list[str]) -> list[bytes | None]: ...
    # Reads into buffers of the backend's own (Mooncake: registered, reused): (read-only view, what
    # `release` needs to give it back), or (bytes, None) for a backend that hands out copies (Redis).
    def lease(self, names: list[str]) -> list[tuple[bytes | memoryview, object] | None]: ...
    def release(self, buffers: list[object]) -> None: ...
    def put(self, items: list[tuple[str, bytes]]) -> None: ...
    def remove(self, name: str) -> bool: ...
    def used_bytes(self) -> int | None: ...                          # None: the service does not say
    def close(self) -> None: ...


class Removals(Protocol):
    """The service's own notifications of keys that left it (Redis: `tiers/redis_removals.py`)."""

    def start(self, on_removed: Callable[[list[str]], None]) -> None: ...  # calls it from a thread of its own
    def close(self) -> None: ...


def key_of(name: str) -> bytes | None:
    """The block key a pool key names (`PoolTier._names` inverted); None for a key not kvtier's block."""
    if not name.startswith(KEY_PREFIX):
        return None
    try:
        return bytes.fromhex(name[len(KEY_PREFIX):])
    except ValueError:
        return None


class PoolTier:
    capacity_bytes = None
    in_process = False  # the blocks crossed the network: full payload proof
    # Each batched get pays the service's round trips and, over TCP, CPU on both ends: fewer, larger gets
    # (two of 8 for a 16-block prefix) restored 3-8% faster than gets of 4 on 2026-12-06 (docs/benchmarks/pools.md),
    # the second get still overlapping the first's verify and copies.
    stream_chunk_blocks = 8

    def __init__(self, name: str, backend: Backend, *, connect: bool = True, removals: Removals | None = None) -> None:
        self.name = name
        self.backend = backend
        self._events: TierEvents | None = None
        self._removals = removals  # started when watched: the service says what left it
        self._removals_started = False
        self.stats = TierStats()
        self.health = TierHealth(name)
        self._written_bytes = 0
        self._written_blocks = 0
        self._leases = Leases()  # the backend's buffers lent out, by key
        if not connect:
            self.health.fail("not connected yet")
        elif (problem := self._connect()) is not None:
            self.health.fail(f"connect failed: {problem}")

    @property
    def events(self) -> TierEvents | None:
        """`TierManager.watch()`'s log: what lands and leaves, announced."""
        return self._events

    @events.setter
    def events(self, log: TierEvents | None) -> None:
        self._events = log
        if log is not None and self._removals is not None and not self._removals_started:
            self._removals_started = True
            self._removals.start(self._removed)

    def _removed(self, names: list[str]) -> None:
        """The service says these keys left it (evicted, expired, deleted by anyone): announced now (a
        watcher ignores blocks it never saw stored). Runs on the watcher's thread."""
        announce_removed(self, [key for key in map(key_of, names) if key is not None])

    @staticmethod
    def _names(keys: list[bytes]) -> list[str]:
        return [KEY_PREFIX + key.hex() for key in keys]

    def _failed(self, what: str, exc: Exception) -> None:
        self.stats.errors += 1
        self.health.fail(f"{what} failed ({exc}); serving from the other tiers")

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            held = self.backend.exists(self._names(keys))
        except PoolError as exc:
            self._failed("lookup", exc)
            return [False] * len(keys)
        self._announce_missing(keys, held)
        return held

    def _announce_missing(self, keys: list[bytes], found: list) -> None:
        """A service that evicts without saying so (Mooncake; a Redis that refused its notifications): a
        block we wrote is known gone at its next miss (a watcher ignores misses of blocks it never saw stored)."""
        if self.events is not None:
            announce_removed(self, [key for key, got in zip(keys, found) if not got])

    def pin_many(self, keys: list[bytes]) -> list[bool]:
        """The service owns eviction: nothing can be pinned, a later read may miss (and fall through)."""
        return self.contains_many(keys)

    def unpin(self, keys: list[bytes]) -> None:
        pass

    def placed_below(self, keys: list[bytes]) -> None:
        pass  # the service evicts on its own: nothing is handed back for demotion

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self._read(keys, self.backend.get)

    def lease_many(self, keys: list[bytes]) -> list[bytes | memoryview | None]:
        """`get_many`, read into the backend's reused buffers where it has them (no allocation, one
        copy fewer): read-only views, valid until `release(keys)` gives the buffers back. A backend
        without them (Redis) hands out copies: nothing to give back."""
        got = self._read(keys, self.backend.lease, lambda item: item[0])
        for key, item in zip(keys, got):
            if item is not None and item[1] is not None:
                self._leases.add(key, item[1])
        return [None if item is None else item[0] for item in got]

    def release(self, keys: list[bytes]) -> None:
        """Give back the buffers `lease_many` read `keys` into (one lease each)."""
        if bufs := self._leases.end(keys):
            self.backend.release(bufs)

    def num_leased(self) -> int:
        return len(self._leases)

    def _read(self, keys: list[bytes], read, data=lambda item: item) -> list:
        """`read(names)` with the tier's bookkeeping; `data(item)` is an item's bytes."""
        start = time.perf_counter()
        try:
            out = read(self._names(keys))
        except PoolError as exc:
            self._failed("get", exc)
            out = [None] * len(keys)
        else:
            self._announce_missing(keys, out)
        hits = [data(item) for item in out if item is not None]
        self.stats.hits += len(hits)
        self.stats.misses += len(out) - len(hits)
        self.stats.bytes_read += sum(map(len, hits))
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Write blocks; the service evicts on its own, so nothing is returned for demotion."""
        if not items:
            return []
        start = time.perf_counter()
        try:
            self.backend.put([(name, data) for name, (_, data) in zip(self._names([k for k, _ in items]), items)])
        except PoolFullError as exc:
            self.stats.errors += 1
            log.debug("%s tier: write dropped: %s", self.name, exc)
            return []
        except PoolError as exc:
            self._failed("put", exc)
            return []
        size = sum(len(d) for _, d in items)
        self.stats.puts += len(items)
        self.stats.bytes_written += size
        self.stats.write_seconds += time.perf_counter() - start
        self._written_bytes += size
        self._written_blocks += len(items)
        announce_stored(self, [key for key, _ in items])
        return []

    def delete(self, key: bytes) -> bool:
        try:
            removed = self.backend.remove(self._names([key])[0])
        except PoolError as exc:
            self._failed("delete", exc)
            return False
        announce_removed(self, [key])  # gone either way: deleted now, or evicted by the service before
        return removed

    def used_bytes(self) -> int:
        """The service's own figure where it gives one, else the bytes this process wrote."""
        if self.health.readable:  # a dead service would cost a timeout per scrape
            try:
                used = self.backend.used_bytes()
                if used is not None:
                    return used
            except PoolError:
                pass
        return self._written_bytes

    def num_blocks(self) -> int:
        return self._written_blocks  # this process's writes: the service holds other servers' blocks too

    def reconnect(self) -> bool:
        if self.health.healthy:
            return True
        problem = self._connect()
        if problem is None:
            self.health.recover()
        else:
            self.stats.errors += 1
            log.debug("%s tier: reconnect failed: %s", self.name, problem)
        return problem is None

    def _connect(self) -> str | None:
        """A fresh connection; the problem if there is none."""
        try:
            self.backend.close()
        except PoolError:
            pass
        try:
            self.backend.connect()
        except PoolError as exc:
            return str(exc)
        return None

    def close(self) -> None:
        if self._removals is not None:
            self._removals.close()
        try:
            self.backend.close()
        except PoolError:
            pass
