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
    name: str
    capacity_bytes: int | None
    stats: TierStats
    healthy: bool

    def contains_many(self, keys: list[bytes]) -> list[bool]: ...
    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...
    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]: ...
    def delete(self, key: bytes) -> bool: ...
    def used_bytes(self) -> int: ...
    def close(self) -> None: ...
