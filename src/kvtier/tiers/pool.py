"""What the two pooled-memory tiers (Mooncake Store, Redis) share: a remote key-value service that
many servers use at once, so one server's prefix serves another.

The service owns capacity and eviction (`capacity_bytes` is None). A backend only says how to
connect, test, read, write and remove; this class turns every failure into a counted error and
`healthy = False` — after which reads are misses and writes are dropped — and `reconnect()` (which
the manager calls after a back-off) builds a fresh connection. A pool tier never raises into the
manager and never blocks it longer than the backend's own timeouts.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from kvtier.tiers.base import TierStats

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
    def put(self, items: list[tuple[str, bytes]]) -> None: ...
    def remove(self, name: str) -> bool: ...
    def used_bytes(self) -> int | None: ...                          # None: the service does not say
    def close(self) -> None: ...


class PoolTier:
    capacity_bytes = None

    def __init__(self, name: str, backend: Backend, *, connect: bool = True) -> None:
        self.name = name
        self.backend = backend
        self.stats = TierStats()
        self.healthy = False
        self._written_bytes = 0
        self._written_blocks = 0
        if connect:
            self.reconnect()

    @staticmethod
    def _names(keys: list[bytes]) -> list[str]:
        return [KEY_PREFIX + key.hex() for key in keys]

    def _failed(self, what: str, exc: Exception) -> None:
        self.stats.errors += 1
        if self.healthy:
            log.warning("%s tier: %s failed (%s); serving from the other tiers until it reconnects",
                        self.name, what, exc)
        self.healthy = False

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        if not self.healthy or not keys:
            return [False] * len(keys)
        try:
            return self.backend.exists(self._names(keys))
        except PoolError as exc:
            self._failed("lookup", exc)
            return [False] * len(keys)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        if not self.healthy:
            self.stats.misses += len(keys)
            return [None] * len(keys)
        start = time.perf_counter()
        try:
            out = self.backend.get(self._names(keys))
        except PoolError as exc:
            self._failed("get", exc)
            out = [None] * len(keys)
        hits = [d for d in out if d is not None]
        self.stats.hits += len(hits)
        self.stats.misses += len(out) - len(hits)
        self.stats.bytes_read += sum(map(len, hits))
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Write blocks; the service evicts on its own, so nothing is returned for demotion."""
        if not self.healthy or not items:
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
        return []

    def delete(self, key: bytes) -> bool:
        if not self.healthy:
            return False
        try:
            return self.backend.remove(self._names([key])[0])
        except PoolError as exc:
            self._failed("delete", exc)
            return False

    def used_bytes(self) -> int:
        """The service's own figure where it gives one, else the bytes this process wrote."""
        if self.healthy:
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
        if self.healthy:
            return True
        try:
            self.backend.close()
        except PoolError:
            pass
        try:
            self.backend.connect()
            self.healthy = True
            if self.stats.errors:
                log.warning("%s tier: reconnected", self.name)
        except PoolError as exc:
            self.stats.errors += 1
            log.debug("%s tier: reconnect failed: %s", self.name, exc)
        return self.healthy

    def close(self) -> None:
        try:
            self.backend.close()
        except PoolError:
            pass
        self.healthy = False
