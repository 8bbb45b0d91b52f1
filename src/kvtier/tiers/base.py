"""The tier protocol and its statistics. Each tier is one class behind this protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.tiers.health import TierHealth


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


class Tier(Protocol):
    """A block store. Never raises on I/O failure: it counts an error and turns off the side of
    `health` the failure concerns (a dead pool: reads and writes; a full disk: writes); the manager
    then skips that side until `reconnect()`, its background probe, succeeds.

    Threads: the manager calls a tier from at most two threads at once, one on the read side
    (`contains_many`, `get_many`, `delete`) and one on the write side (`contains_many`, `put_many`),
    so that a slow write never holds up a read; a tier must allow that pair. `reconnect()` runs with
    the side(s) that are down locked out. `used_bytes` / `num_blocks` may be called from any thread."""

    name: str                      # "dram", "ssd", "mooncake", "redis"
    capacity_bytes: int | None     # None: the backend owns eviction (pools)
    stats: TierStats
    health: TierHealth             # readable / writable, transitions, retry back-off

    def contains_many(self, keys: list[bytes]) -> list[bool]: ...
    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...        # None = miss
    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]: ...  # evicted, LRU first
    def delete(self, key: bytes) -> bool: ...
    def used_bytes(self) -> int: ...
    def num_blocks(self) -> int: ...
    def reconnect(self) -> bool: ...  # probe; on success `health.recover()`; returns `health.healthy`
    def close(self) -> None: ...
    # A tier that can hand out its own memory also offers `lease_many(keys)` -> read-only views, valid
    # until `release(keys)`, and `num_leased()`: DRAM its slots (pinned), the SSD and Mooncake their
    # reused read buffers; the manager uses them for `read(match, lease=True)` and `stream`.
