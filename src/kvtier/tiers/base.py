"""The tier protocol and its statistics. Each tier is one class behind this protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.tiers.events import TierEvents
from kvtier.tiers.health import TierHealth

STREAM_CHUNK_BLOCKS = 4  # `TierManager.stream` reads this many blocks per batched get, one chunk ahead (DRAM, SSD)


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
    (`contains_many`, `pin_many`, `get_many`, `lease_many`, `delete`) and one on the write side
    (`contains_many`, `put_many`, `placed_below`), so that a slow write never holds up a read; a tier
    must allow that pair. `release` / `unpin` may come from either side. `reconnect()` runs with the
    side(s) that are down locked out. `used_bytes` / `num_blocks` may be called from any thread.

    Look up once, pin, read there: `pin_many` is the lookup a load follows (vLLM's `prepare_load`):
    each held block is kept from this tier's eviction until `unpin`; `get_many` / `lease_many` then
    read a block where it is, without looking it up again (a miss is just None). Every tier leases:
    DRAM lends its slots, the SSD and Mooncake their reused read buffers, Redis copies; pools cannot
    pin (the service evicts), so their `pin_many` is `contains_many`."""

    name: str                      # "dram", "ssd", "mooncake", "redis"
    capacity_bytes: int | None     # None: the backend owns eviction (pools)
    in_process: bool               # blocks never leave this process's memory: checked by their header only
    stream_chunk_blocks: int       # blocks per batched get when `TierManager.stream` reads from here
    stats: TierStats
    health: TierHealth             # readable / writable, transitions, retry back-off
    events: TierEvents | None      # set by `TierManager.watch()`: announce what lands and leaves (tiers/events.py)

    def contains_many(self, keys: list[bytes]) -> list[bool]: ...
    def pin_many(self, keys: list[bytes]) -> list[bool]: ...             # contains, and held until unpin
    def unpin(self, keys: list[bytes]) -> None: ...                       # one pin of each (found) key
    def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...        # None = miss
    def lease_many(self, keys: list[bytes]) -> list[bytes | memoryview | None]: ...  # read-only, valid until release
    def release(self, keys: list[bytes]) -> None: ...                     # one lease of each leased key
    def num_leased(self) -> int: ...
    # Optional (file tiers: SSD, shm): `lease_layers(keys)` -> a `tiers.ranged.RangedRead` (or None) each,
    # read in pieces layer by layer, leased until release (`TierManager.stream_layers`).
    # Optional (tiers with an LRU of their own: DRAM, SSD, shm): `touch_many(keys)` refreshes a request's blocks
    # (root first) tail first (`kvtier.lru`); the manager calls it after a read that came in chunks.
    # Evicted blocks, LRU first: (key, data), or (key, None) for a block `placed_below` said a lower
    # tier holds (nothing to demote, nothing copied out).
    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes | None]]: ...
    def placed_below(self, keys: list[bytes]) -> None: ...               # write-through landed below
    def delete(self, key: bytes) -> bool: ...
    def used_bytes(self) -> int: ...
    def num_blocks(self) -> int: ...
    def reconnect(self) -> bool: ...  # probe; on success `health.recover()`; returns `health.healthy`
    def close(self) -> None: ...
    # An `in_process` tier (DRAM) is also an arena a reader may read in place: `num_slots` slots, a typed
    # `payload_view(dtype, shape)` of them, and `lease_slots(items, placed_below=)`: `lease_many` by slot,
    # storing a block it lacks first (`TierManager.lease_in_place`; a write-side call).
