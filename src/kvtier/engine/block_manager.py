"""Device block bookkeeping: ids, keys and reference counts — no tensors (those are the runner's).

A block is in exactly one of three states:
- used: `ref_counts[b] > 0`, in some sequences' block tables (shared when they share a prefix);
- cached-free: ref 0 but holding the KV of a full block with a key; it stays findable by
  `match_prefix` until `allocate` reuses it, least recently freed first;
- free: ref 0 and nothing worth keeping.
Reusing a cached-free block *evicts* it: `allocate` hands back its (key, block id) so the engine
can write the KV to the tiers before the block is overwritten.

`watch()` hands out a log of what enters the prefix cache (`register`: a block named by its key, with
the parent, tokens and namespace it was hashed from) and what leaves it (evicted), for a watcher on
another thread (`kvtier serve --kv-events-config`). Unwatched, `events` is None and costs nothing more.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

MAX_EVENTS = 100_000  # a watcher that falls this far behind loses the oldest (counted)


@dataclass(frozen=True, slots=True)
class BlockOrigin:
    """What a block's key was hashed from: the previous block's key (None: a sequence's first block),
    the block's tokens and the key space's namespace (the request's cache_salt); `tier`: the tier its KV was
    loaded from (None: computed here)."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    namespace: str = ""
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """`key` entered the device prefix cache (`stored`, from `origin` when its registration said) or was evicted."""

    stored: bool
    key: bytes
    origin: BlockOrigin | None = None


class BlockEvents:
    """A bounded log: appended by the engine's thread, drained by one watcher; when full the oldest
    event is dropped and counted (the engine never waits for the watcher)."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self._lock = threading.Lock()
        self._events: deque[BlockEvent] = deque(maxlen=max_events)
        self.num_dropped = 0

    def append(self, event: BlockEvent) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.num_dropped += 1
            self._events.append(event)

    def take(self) -> list[BlockEvent]:
        """Every event since the last `take`, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events


class BlockManager:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the device KV budget holds no block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_to_key: list[bytes | None] = [None] * num_blocks
        self.key_to_block: dict[bytes, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.events: BlockEvents | None = None

    def watch(self, max_events: int = MAX_EVENTS) -> BlockEvents:
        """The log of blocks registered and evicted from now on (one watcher)."""
        assert self.events is None, "the device blocks are watched already"
        self.events = BlockEvents(max_events)
        return self.events

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out (free + cached-free)."""
        return len(self.free_block_ids) + len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def match_prefix(self, keys: list[bytes]) -> list[int]:
        """Block ids of the longest prefix of `keys` held on the device (not acquired)."""
        block_ids = []
        for key in keys:
            block_id = self.key_to_block.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def acquire(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            assert block_id in self.cached_free, f"acquiring block {block_id} that holds nothing"
            del self.cached_free[block_id]
        self.ref_counts[block_id] += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self) -> tuple[int, tuple[bytes, int] | None] | None:
        """A block with ref 1, and the (key, id) it evicted if it was cached-free; None when full."""
        evicted = None
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            key = self.block_to_key[block_id]
            del self.key_to_block[key]
            self.block_to_key[block_id] = None
            evicted = (key, block_id)
            if self.events is not None:
                self.events.append(BlockEvent(False, key))
        else:
            return None
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id, evicted

    def register(self, block_id: int, key: bytes, origin: BlockOrigin | None = None) -> bool:
        """Name a used block's (now full and computed) KV; False if another block has that key.
        `origin` (what the key was hashed from) goes to the watcher only."""
        assert self.ref_counts[block_id] > 0, f"registering free block {block_id}"
        if self.block_to_key[block_id] == key:
            return True
        assert self.block_to_key[block_id] is None, f"block {block_id} already has a key"
        if key in self.key_to_block:  # computed twice (two sequences prefilled it at once): keep the first
            return False
        self.block_to_key[block_id] = key
        self.key_to_block[key] = block_id
        if self.events is not None:
            self.events.append(BlockEvent(True, key, origin))
        return True

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each; in reverse so a table's tail is evicted before its head."""
        for block_id in reversed(block_ids):
            assert self.ref_counts[block_id] > 0, f"double free of block {block_id}"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id]:
                continue
            if self.block_to_key[block_id] is not None:
                self.cached_free[block_id] = None
            else:
                self.free_block_ids.append(block_id)

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """(key, id) of every block with a key, used or not."""
        return list(self.key_to_block.items())
