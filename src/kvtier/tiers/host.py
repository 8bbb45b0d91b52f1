"""Host DRAM tier: one preallocated arena of fixed-size slots (pinned when CUDA is present).

Metadata only in Python: `key_to_slot` and a free-slot stack of ints, slot lengths in a numpy
array, recency in the shared `LRUIndex`. Payload bytes live in the arena tensor. A mutex covers each
block's bookkeeping and copy (memory-speed work), so the manager's reader and writer may call at the
same time and neither waits longer than one block copy.

A block larger than a slot is the caller's bug for that block: it is counted as an error and
skipped, the tier stays up. Memory does not fail, but a tier that raised (a bug) is turned off by
the manager; `reconnect()` checks the bookkeeping, drops the contents if it no longer adds up, and
brings the tier back.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from kvtier.index import LRUIndex
from kvtier.tiers.base import TierStats
from kvtier.tiers.health import TierHealth

log = logging.getLogger(__name__)


class HostTier:
    name = "dram"

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

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._key_to_slot for key in keys]

    def _read(self, slot: int) -> bytes:
        start = slot * self.slot_bytes
        return self._arena_np[start:start + self._slot_len[slot]].tobytes()

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        start = time.perf_counter()
        out: list[bytes | None] = []
        for key in keys:
            with self._lock:
                slot = self._key_to_slot.get(key)
                data = None if slot is None else self._read(slot)
                if data is not None:
                    self._lru.touch(key)
            if data is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(data)
            out.append(data)
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Store blocks; returns the evicted (key, data), least recently used first."""
        start = time.perf_counter()
        evicted: list[tuple[bytes, bytes]] = []
        for key, data in items:
            if len(data) > self.slot_bytes:
                self._oversize(len(data))
                continue
            with self._lock:
                if key in self._key_to_slot:
                    self._lru.touch(key)
                else:
                    evicted += self._put(key, data)
        self.stats.write_seconds += time.perf_counter() - start
        return evicted

    def _put(self, key: bytes, data: bytes) -> list[tuple[bytes, bytes]]:
        evicted = []
        for victim, _ in self._lru.insert(key, 1):
            slot = self._key_to_slot.pop(victim)
            evicted.append((victim, self._read(slot)))
            self._free_slots.append(slot)
            self.stats.evictions += 1
        slot = self._free_slots.pop()
        offset = slot * self.slot_bytes
        self._arena_np[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._slot_len[slot] = len(data)
        self._key_to_slot[key] = slot
        self.stats.puts += 1
        self.stats.bytes_written += len(data)
        return evicted

    def _oversize(self, num_bytes: int) -> None:
        self.stats.errors += 1
        self._num_oversize += 1
        if self._num_oversize == 1:  # a caller bug: say it once, count every time
            log.warning("dram tier: a block of %d B exceeds the slot of %d B; not stored (the tier stays up)",
                        num_bytes, self.slot_bytes)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            slot = self._key_to_slot.pop(key, None)
            if slot is None:
                return False
            self._lru.pop(key)
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
                self._key_to_slot.clear()
                self._lru.clear()
                self._free_slots = list(range(self.num_slots - 1, -1, -1))
                self._slot_len[:] = 0
        self.health.recover()
        return True

    def _consistent(self) -> bool:
        slots = set(self._key_to_slot.values())
        return (len(slots) == len(self._key_to_slot) == len(self._lru)
                and len(slots) + len(self._free_slots) == self.num_slots
                and slots.isdisjoint(self._free_slots) and all(key in self._lru for key in self._key_to_slot))

    def close(self) -> None:
        pass
