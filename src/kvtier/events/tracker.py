"""KV cache events for kvtier's tiers, in vLLM's own terms (no vLLM import: the vLLM connector builds vLLM's
`BlockStored` / `BlockRemoved` from these records, `kvtier serve` encodes them itself with `wire.py`).

A router (Dynamo's KV indexer, llm-d's) learns a replica's cache from vLLM's events: each block under
vLLM's prefix-cache hash, with its parent, tokens, block size, LoRA, extra keys (`cache_salt`) and the
`medium` that holds it. kvtier's tiers announce their blocks the same way, under the same hash, so a
consumer links a block's device and tier copies: vLLM evicting the device copy leaves the tier's.

The tiers know blocks by kvtier key only (`tiers/events.py`); the scheduler knows the request each block
belongs to. `KvEventTracker` joins them: the scheduler `describe`s each block it sends down (or finds in
a tier at admission) while its request is alive, and every tier event for a described key becomes a
record under that block's vLLM hash. A block stays described while some tier holds it, so its eviction
hours later still names it, and for a while after it left every tier (another tier's write of it may be
on its way: a block evicted from `shm` before the SSD's write-through landed). Announcements are per
medium: a block in `dram` and `shm` (both "CPU") is stored once, removed when the last of them lets it go.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.tiers.events import TierEvent

# The `medium` of each tier kind, as the consumers read it: vLLM names its own "GPU", "CPU" and
# "STORAGE" (`vllm.distributed.kv_events`); Dynamo 1.6.1 counts CPU / CPU_PINNED as host, STORAGE / DISK
# as disk and SHARED / EXTERNAL / REMOTE as its external (shared) tier (lib/kv-router `StorageTier`).
MEDIUMS = {"dram": "CPU", "shm": "CPU", "ssd": "STORAGE", "mooncake": "SHARED", "redis": "SHARED"}
MAX_UNHELD_BLOCKS = 65536  # described but in no tier yet (a save on its way, or dropped): oldest forgotten


def medium_of(tier: str) -> str:
    """`ssd2` (a second SSD) is an `ssd`."""
    return MEDIUMS.get(tier.rstrip("0123456789"), "STORAGE")


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block as vLLM's own `BlockStored` describes it."""

    block_hash: int | bytes            # vLLM's prefix-cache hash (its external form: an int by default)
    parent_hash: int | bytes | None    # the previous block's; None for a prompt's first block
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple | None = None    # vLLM's event form: the cache_salt on a first block, LoRA, mm hashes
    cache_salt: str | None = None      # the tenant, on every block (NVIDIA Dynamo's indexer reads this field)


@dataclass(frozen=True, slots=True)
class Stored:
    block: BlockInfo
    medium: str


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int | bytes, ...]
    medium: str


@dataclass(slots=True)
class _Entry:
    info: BlockInfo
    tiers: set[str] = field(default_factory=set)  # the tiers holding it, by name


class KvEventTracker:
    """kvtier keys -> vLLM's block descriptions, and which tiers hold each; tier events in, records out."""

    def __init__(self) -> None:
        self._held: dict[bytes, _Entry] = {}                     # some tier holds it
        self._unheld: OrderedDict[bytes, _Entry] = OrderedDict()  # described, in no tier (yet)
        self._out: list[Stored | Removed] = []

    def describe(self, keys: list[bytes], infos: list[BlockInfo]) -> None:
        """The blocks `keys` name (a save or a load of a live request): known from now on."""
        for key, info in zip(keys, infos):
            entry = self._held.get(key)
            if entry is not None:
                entry.info = info
                continue
            self._unheld[key] = _Entry(info)
            self._unheld.move_to_end(key)
        self._forget_oldest_unheld()

    def _forget_oldest_unheld(self) -> None:
        while len(self._unheld) > MAX_UNHELD_BLOCKS:
            self._unheld.popitem(last=False)

    def found(self, keys: list[bytes], tiers: list[str]) -> None:
        """A lookup found described blocks in these tiers: held there, whoever wrote them (an earlier
        process on the same SSD, another server on the pool) — announced if they were not."""
        for key, tier in zip(keys, tiers):
            self._store(key, tier)

    def apply(self, events: list[TierEvent]) -> None:
        """What the tiers announced (`tiers/events.py`), oldest first; keys never described are not ours
        to announce (another process's blocks, a pool's miss of a block nobody stored)."""
        for event in events:
            for key in event.keys:
                if event.stored:
                    self._store(key, event.tier)
                else:
                    self._remove(key, event.tier)

    def _store(self, key: bytes, tier: str) -> None:
        entry = self._held.get(key)
        if entry is None:
            entry = self._unheld.pop(key, None)
            if entry is None:
                return
            self._held[key] = entry
        if tier in entry.tiers:
            return
        medium = medium_of(tier)
        if all(medium_of(t) != medium for t in entry.tiers):
            self._out.append(Stored(entry.info, medium))
        entry.tiers.add(tier)

    def _remove(self, key: bytes, tier: str) -> None:
        entry = self._held.get(key)
        if entry is None or tier not in entry.tiers:
            return
        entry.tiers.discard(tier)
        medium = medium_of(tier)
        if all(medium_of(t) != medium for t in entry.tiers):
            self._out.append(Removed((entry.info.block_hash,), medium))
        if not entry.tiers:  # in no tier now, but another tier's store may be on its way: kept described a while
            del self._held[key]
            self._unheld[key] = entry
            self._forget_oldest_unheld()

    def take(self) -> list[Stored | Removed]:
        """The records since the last call, in the order the tiers saw them; removals from one medium in a
        row are one record (an SSD eviction lets many blocks go at once)."""
        records, self._out = self._out, []
        out: list[Stored | Removed] = []
        for record in records:
            last = out[-1] if out else None
            if isinstance(record, Removed) and isinstance(last, Removed) and last.medium == record.medium:
                out[-1] = Removed(last.block_hashes + record.block_hashes, record.medium)
            else:
                out.append(record)
        return out

    def num_held(self, medium: str | None = None) -> int:
        """Blocks some tier (of `medium`) holds, as announced."""
        return sum(1 for e in self._held.values() if medium is None or any(medium_of(t) == medium for t in e.tiers))
