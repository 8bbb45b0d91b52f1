"""Host DRAM tier: one preallocated arena of fixed-size slots (pinned when CUDA is present).

Metadata only in Python: `key_to_slot` and a free-slot stack of ints, slot lengths in a numpy
array, recency in the shared `LRUIndex` (a request's blocks refreshed tail first: `kvtier.lru`). Payload
bytes live in the arena tensor. A mutex covers each block's bookkeeping and copy (memory-speed work), so
the manager's reader and writer may call at the same time and neither waits longer than one block copy.

Zero-copy reads: `lease_many(keys)` hands out read-only views of the slots themselves and pins
them until `release(keys)`, so the reader verifies and decodes straight from the arena and copies
once, into its destination; `lease_slots` leases by address instead (a row of `payload_view`), for a
reader that keeps reading the arena in place, storing a block it lacks first. `pin_many(keys)` pins the slots a load will read (the lookup a load follows)
until `unpin(keys)`. A pinned slot is never evicted nor reused: a put that finds every slot
pinned is dropped (counted), and a key deleted while leased frees its slot at its last release.

A block larger than a slot is the caller's bug for that block: it is counted as an error and
skipped, the tier stays up. Memory does not fail, but a tier that raised (a bug) is turned off by
the manager; `reconnect()` checks the bookkeeping, drops the contents if it no longer adds up, and
brings the tier back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.codecs.header import HEADER_BYTES, CorruptBlockError, verify
from kvtier.lru import LRUIndex
from kvtier.tiers.base import STREAM_CHUNK_BLOCKS, TierStats
from kvtier.tiers.buffers import Leases
from kvtier.tiers.events import TierEvents, announce_removed, announce_stored
from kvtier.tiers.health import TierHealth

log = logging.getLogger(__name__)


def _header_matches(buf, key: bytes) -> bool:
    try:
        verify(buf, key, payload=False)  # its own slot: the key-bound header
    except CorruptBlockError:
        return False
    return True


class HostTier:
    name = "dram"
    in_process = True  # its slots never leave this process: blocks are checked by their key-bound header
    stream_chunk_blocks = STREAM_CHUNK_BLOCKS
    events: TierEvents | None = None  # `TierManager.watch()`: what lands and leaves, announced

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise ValueError(f"dram tier needs capacity >= one slot ({slot_bytes} B), got {capacity_bytes} B")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.capacity_bytes = self.num_slots * slot_bytes
        pin = torch.cuda.is_available()
        self._arena = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=pin)
        self._arena_np = self._arena.numpy()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._slot_len = np.zeros(self.num_slots, dtype=np.int64)
        self._key_to_slot: dict[bytes, int] = {}
        self._lru = LRUIndex(self.num_slots)  # capacity in slots: each block takes one
        self.stats = TierStats()
        self.health = TierHealth(self.name)
        self._lock = threading.Lock()
        self._num_oversize = 0
        self._slot_pins = np.zeros(self.num_slots, dtype=np.int64)
        self._leases = Leases()  # slots leased out, by key, not yet released
        self._pins = Leases()    # slots pinned by a lookup a load will follow (`pin_many`), by key
        self._below = np.zeros(self.num_slots, dtype=bool)  # a lower tier holds the slot's block too
        self._orphans: set[int] = set()             # pinned slots whose key was deleted meanwhile
        self.num_dropped_puts = 0                   # every slot pinned (or its batch's own): nothing to evict

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._key_to_slot for key in keys]

    def pin_many(self, keys: list[bytes]) -> list[bool]:
        """`contains_many`, each held block's slot pinned (never evicted nor reused) until `unpin`."""
        with self._lock:
            held = []
            for key in keys:
                slot = self._key_to_slot.get(key)
                if slot is not None:
                    self._slot_pins[slot] += 1
                    self._pins.add(key, slot)
                held.append(slot is not None)
            return held

    def unpin(self, keys: list[bytes]) -> None:
        with self._lock:
            self._unpin_slots(self._pins.end(keys))

    def placed_below(self, keys: list[bytes]) -> None:
        """A lower tier holds these blocks now: evicting them copies nothing out (no demotion)."""
        with self._lock:
            for key in keys:
                slot = self._key_to_slot.get(key)
                if slot is not None:
                    self._below[slot] = True

    def _slot(self, slot: int) -> np.ndarray:
        offset = slot * self.slot_bytes
        return self._arena_np[offset:offset + self._slot_len[slot]]

    def _read(self, slot: int) -> bytes:
        return self._slot(slot).tobytes()

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self._read_many(keys, lease=False)

    def lease_many(self, keys: list[bytes]) -> list[memoryview | None]:
        """Like `get_many`, without the copy: read-only views of the slots, pinned until `release`."""
        return self._read_many(keys, lease=True)

    def _read_many(self, keys: list[bytes], *, lease: bool) -> list:
        """Each key's bytes (copied under the lock: a put may reuse the slot next) or, leasing, a view
        of its slot, pinned so that nothing moves it until `release`; None where not held."""
        start = time.perf_counter()
        out: list = []
        for key in keys:
            with self._lock:
                slot = self._key_to_slot.get(key)
                data = None
                if slot is not None:
                    if lease:
                        self._slot_pins[slot] += 1
                        self._leases.add(key, slot)
                        data = memoryview(self._slot(slot)).toreadonly()
                    else:
                        data = self._read(slot)
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(data)
            out.append(data)
        with self._lock:  # a read is a use: the blocks read, tail first
            self._lru.touch_many([key for key, data in zip(keys, out) if data is not None])
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def touch_many(self, keys: list[bytes]) -> None:
        """Refresh a request's blocks (root first) tail first: the manager, after a read that came in chunks."""
        with self._lock:
            self._lru.touch_many(keys)

    def release(self, keys: list[bytes]) -> None:
        """End the leases `lease_many` gave out for `keys` (one each): their slots may move again."""
        with self._lock:
            self._unpin_slots(self._leases.end(keys))

    def _unpin_slots(self, slots: list[int]) -> None:
        for slot in slots:
            self._slot_pins[slot] -= 1
            if self._slot_pins[slot] == 0 and slot in self._orphans:
                self._orphans.discard(slot)
                self._free_slots.append(slot)
                self._lru.capacity = self.num_slots - len(self._orphans)

    def num_leased(self) -> int:
        return len(self._leases)

    # -- reading the arena in place: leases by slot ------------------------------------------------
    def lease_slots(self, items: list[tuple[bytes, bytes | None]], *, placed_below: bool = False
                    ) -> tuple[list[int | None], list[tuple[bytes, bytes | None]]]:
        """`lease_many` by address, for a reader of the arena in place (`payload_view`): lease each block's
        slot until `release([key])`, storing it from its data first where this tier does not hold it (data
        None: left unheld). A block held already is leased where it is, its key-bound header checked (a bad
        one is dropped and, with data, stored again). `placed_below`: a lower tier holds the blocks stored
        here now (their eviction copies nothing out). Store and lease happen under one lock: no put can
        evict a block between them. Returns each block's slot (None: not held and no data, oversize, every
        slot leased) and the blocks evicted to make room, as `put_many` does."""
        slots: list[int | None] = []
        evicted: list[tuple[bytes, bytes | None]] = []
        with self._lock:
            for key, data in items:
                slot = self._checked_slot(key)
                if slot is None and data is not None and len(data) <= self.slot_bytes:
                    evicted += self._put(key, data)
                    slot = self._key_to_slot.get(key)
                    if slot is not None and placed_below:
                        self._below[slot] = True
                if slot is not None:
                    self._slot_pins[slot] += 1
                    self._leases.add(key, slot)
                slots.append(slot)
            self._lru.touch_many([key for (key, _), slot in zip(items, slots) if slot is not None])
        return slots, evicted

    def _checked_slot(self, key: bytes) -> int | None:
        """`key`'s slot, its key-bound header checked (it never left this process); a bad block is dropped."""
        slot = self._key_to_slot.get(key)
        if slot is None or _header_matches(self._slot(slot), key):
            return slot
        log.warning("dram tier: block %s failed its header check; dropped", key.hex()[:12])
        self.stats.corrupt += 1
        self._drop(key)
        return None

    def payload_view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """`[num_slots, *shape]` typed view of every slot's payload (after the 64-byte header): the block
        in slot s is row s (`lease_slots` gives s). Read-only use: only puts write slots."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.slot_bytes % itemsize or HEADER_BYTES % itemsize:
            raise ValueError(f"slots of {self.slot_bytes} B do not align to {dtype}")
        per_slot = self.slot_bytes // itemsize
        numel = math.prod(shape)
        if HEADER_BYTES // itemsize + numel > per_slot:
            raise ValueError(f"a payload of shape {shape} does not fit a slot of {self.slot_bytes} B")
        rows = self._arena.view(dtype).view(self.num_slots, per_slot)
        return rows[:, HEADER_BYTES // itemsize:HEADER_BYTES // itemsize + numel].unflatten(1, shape)

    puts_chains = True  # `put_many(items, chains=...)`: refreshes the chains a save extends itself (writeback.py)

    def put_many(self, items: list[tuple[bytes, bytes]], chains: Sequence[list[bytes]] = ()
                 ) -> list[tuple[bytes, bytes | None]]:
        """Store blocks, most valuable first (a request's in prompt order, root first); returns the evicted,
        least recently used first: (key, data), or (key, None) for a block a lower tier holds
        (`placed_below`): nothing copied out for it. Stored in order (stored events: a parent before its
        children) and never evicting each other (a chain longer than the tier keeps its first blocks), then
        refreshed tail first (`kvtier.lru`). `chains`: the requests' chains the blocks extend (root first,
        the new keys included): what this tier holds of them is not rewritten, kept from the batch's
        evictions and refreshed with it, tail first, under one lock take — a turn's new blocks never outrank
        the root they extend, and a full tier evicts the chain from its tail."""
        start = time.perf_counter()
        evicted: list[tuple[bytes, bytes | None]] = []
        chain_keys = [key for chain in chains for key in chain]
        batch = {key for key, _ in items}.union(chain_keys)
        for key, data in items:
            if len(data) > self.slot_bytes:
                self._oversize(len(data))
                continue
            with self._lock:
                if key not in self._key_to_slot:
                    evicted += self._put(key, data, batch)
        with self._lock:
            self._lru.touch_many([key for key, _ in items])
            self._lru.touch_many(chain_keys)  # chains one after another: the first chain's root ends most recent
        self.stats.write_seconds += time.perf_counter() - start
        return evicted

    def _put(self, key: bytes, data: bytes, batch: set[bytes] = frozenset()) -> list[tuple[bytes, bytes | None]]:
        """`key` into a free or evicted slot; never evicts a leased or pinned block, nor one of `batch`."""
        evicted = []
        victims = self._lru.insert(key, 1, pinned=self._leases.keys() | self._pins.keys() | batch)
        if victims is None:  # every slot is leased, pinned or taken by the batch's earlier blocks
            self.num_dropped_puts += 1
            return evicted
        for victim, _ in victims:
            slot = self._key_to_slot.pop(victim)
            evicted.append((victim, None if self._below[slot] else self._read(slot)))
            self._free_slots.append(slot)
            self.stats.evictions += 1
        announce_removed(self, [victim for victim, _ in victims])
        slot = self._free_slots.pop()
        offset = slot * self.slot_bytes
        self._arena_np[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._slot_len[slot] = len(data)
        self._below[slot] = False
        self._key_to_slot[key] = slot
        self.stats.puts += 1
        self.stats.bytes_written += len(data)
        announce_stored(self, [key])
        return evicted

    def _oversize(self, num_bytes: int) -> None:
        self.stats.errors += 1
        self._num_oversize += 1
        if self._num_oversize == 1:  # a caller bug: say it once, count every time
            log.warning("dram tier: a block of %d B exceeds the slot of %d B; not stored (the tier stays up)",
                        num_bytes, self.slot_bytes)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            return self._drop(key)

    def _drop(self, key: bytes) -> bool:
        slot = self._key_to_slot.pop(key, None)
        if slot is None:
            return False
        self._lru.pop(key)
        announce_removed(self, [key])
        if self._slot_pins[slot]:  # a reader still holds a view of it: freed at its last release
            self._orphans.add(slot)
            self._lru.capacity = self.num_slots - len(self._orphans)
        else:
            self._free_slots.append(slot)
            self._slot_len[slot] = 0
        return True

    def used_bytes(self) -> int:
        return len(self._key_to_slot) * self.slot_bytes

    def num_blocks(self) -> int:
        return len(self._key_to_slot)

    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def reconnect(self) -> bool:
        """After a tier bug raised mid-call: keep the contents if the bookkeeping adds up, else drop them."""
        with self._lock:
            if not self._consistent():
                log.warning("dram tier: bookkeeping inconsistent after an error; dropping its %d blocks",
                            len(self._key_to_slot))
                announce_removed(self, list(self._key_to_slot))
                self._key_to_slot.clear()
                self._lru.clear()
                # a slot still leased to a reader stays out of use until its release
                self._orphans = {slot for slot in range(self.num_slots) if self._slot_pins[slot]}
                self._free_slots = [slot for slot in range(self.num_slots - 1, -1, -1) if slot not in self._orphans]
                self._lru.capacity = self.num_slots - len(self._orphans)
        self.health.recover()
        return True

    def _consistent(self) -> bool:
        slots = set(self._key_to_slot.values())
        return (len(slots) == len(self._key_to_slot) == len(self._lru)
                and len(slots) + len(self._free_slots) + len(self._orphans) == self.num_slots
                and slots.isdisjoint(self._free_slots) and slots.isdisjoint(self._orphans)
                and all(key in self._lru for key in self._key_to_slot))

    def close(self) -> None:
        pass
