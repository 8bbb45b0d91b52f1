"""The LRU block index: keys, sizes and recency, no payloads.

One implementation serves every place that must decide which block to evict: the DRAM, SSD and pool
tiers keep their bookkeeping here, and `kvtier simulate` replays traces through the same class, so
a simulated hit rate is the hit rate the real store would have had.

A request's blocks form a chain (prompt order, root first) and a prefix lookup stops at its first miss, so
an LRU that lost a chain's root would keep the rest of it stored and unmatchable. Every place that takes
one request's blocks in one call refreshes them tail first (`tail_first`, `LRUIndex.touch_many`): the root
ends most recent and eviction takes a chain from its tail, as vLLM's free block queue and SGLang's radix
cache (leaves first) do. A save carries only a turn's new blocks, so it names the chains they extend
(`BlockMover.save(chains=...)`): each tier refreshes what it holds of them with the new blocks, never the new
ones alone, which would outrank the root they extend.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def tail_first(chain: Sequence[T]) -> list[T]:
    """A chain's items (prompt order, root first) in the order an LRU refreshes them: the root last, most
    recent (see the module docstring)."""
    return list(chain)[::-1]


class LRUIndex:
    """Keys with a byte (or token) size each, bounded by `capacity`; least recently used first out.

    `capacity` is in whatever unit the caller's sizes use (bytes for tiers, tokens or blocks in the
    simulator). A capacity of 0 holds nothing; `None` is unbounded.
    """

    __slots__ = ("capacity", "used", "_key_to_size", "num_evictions")

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._key_to_size: OrderedDict[Hashable, int] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._key_to_size)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._key_to_size

    def __iter__(self) -> Iterator[Hashable]:
        """Keys from least to most recently used."""
        return iter(self._key_to_size)

    def size_of(self, key: Hashable) -> int:
        return self._key_to_size[key]

    def touch(self, key: Hashable) -> bool:
        """Mark `key` most recently used; False if absent."""
        if key not in self._key_to_size:
            return False
        self._key_to_size.move_to_end(key)
        return True

    def touch_many(self, chain: Sequence[Hashable]) -> None:
        """Mark the keys of a chain (root first) most recently used, tail first: the root ends most recent.
        Absent keys are skipped."""
        for key in tail_first(chain):
            self.touch(key)

    def fits(self, size: int) -> bool:
        return self.capacity is None or size <= self.capacity

    def insert(self, key: Hashable, size: int, *, pinned: Iterable[Hashable] = ()) -> list[tuple[Hashable, int]] | None:
        """Insert (or refresh) `key`; returns the (key, size) pairs evicted to make room, LRU first.

        Returns None, changing nothing, when the entry can never fit (larger than capacity, or
        everything that would have to go is in `pinned`).
        """
        assert size >= 0, size
        if not self.fits(size):
            return None
        old = self._key_to_size.get(key, 0)
        need = 0 if self.capacity is None else self.used - old + size - self.capacity
        if need > 0:
            victims = self._victims(need, {key, *pinned})  # never evict the entry being refreshed
            if victims is None:
                return None
        else:
            victims = []
        if key in self._key_to_size:
            self.used -= self._key_to_size.pop(key)
        for victim in victims:
            del self._key_to_size[victim[0]]
            self.used -= victim[1]
        self.num_evictions += len(victims)
        self._key_to_size[key] = size
        self.used += size
        return victims

    def _victims(self, need: int, pinned: set[Hashable]) -> list[tuple[Hashable, int]] | None:
        victims: list[tuple[Hashable, int]] = []
        for key, size in self._key_to_size.items():
            if need <= 0:
                break
            if key in pinned:
                continue
            victims.append((key, size))
            need -= size
        return victims if need <= 0 else None

    def pop(self, key: Hashable) -> int | None:
        """Remove `key`; returns its size, or None if absent."""
        size = self._key_to_size.pop(key, None)
        if size is not None:
            self.used -= size
        return size

    def clear(self) -> None:
        self._key_to_size.clear()
        self.used = 0
