"""The tier protocol and its statistics. Each tier is one class behind this protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    """A block store. Never raises on I/O failure: it counts an error, turns `healthy` off, and
    answers misses / drops puts until `reconnect()` (called by the manager after a back-off)
    succeeds."""

    name: str                      # "dram", "ssd", "mooncake", "redis"
    capacity_bytes: int | None     # None: the backend owns eviction (pools)
    stats: TierStats
    healthy: bool

    def contains_many(self, keys: list[bytes]) -> list[bool]: ...
    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...        # None = miss
    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]: ...  # evicted, LRU first
    def delete(self, key: bytes) -> bool: ...
    def used_bytes(self) -> int: ...
    def num_blocks(self) -> int: ...
    def reconnect(self) -> bool: ...  # try to become healthy again; returns `healthy`
    def close(self) -> None: ...
