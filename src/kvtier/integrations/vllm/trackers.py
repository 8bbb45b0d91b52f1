"""Scheduler-side bookkeeping, free of vLLM imports (testable on its own): what each request may load
from the tiers, which of its device blocks to send down, and the records that go to the worker.

Records that cross to the worker carry keys and block ids only, never tensors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache

import xxhash

from kvtier.blocks import KeyChain, KeySpace


@dataclass(slots=True)
class LoadSpec:
    """Fill `block_ids` (device blocks) with the blocks named by `keys`, in order. `tiers`: where the
    scheduler's lookup found each (tier names): the worker reads there, it does not look them up again."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    tiers: list[str]


@dataclass(slots=True)
class SaveSpec:
    """Copy `block_ids` (full, computed device blocks of request `req_id`) down the tiers under `keys`.
    `held_keys`: the request's blocks before them (root first), the chain the save extends: refreshed with it
    in the worker's tiers that hold them (`BlockMover.save(chains=...)`)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    held_keys: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class LoadPlan:
    """What `get_num_new_matched_tokens` found: blocks `first_block ..` held by `tiers` (one name each)."""

    first_block: int
    keys: list[bytes]
    tiers: list[str]


def shard_keys(keys: list[bytes], rank: int, world_size: int) -> list[bytes]:
    """The keys rank `rank` of `world_size` (tensor parallel) stores its shard of each block under: the
    chain key bound to the rank and the world size (one worker: the chain key itself)."""
    if world_size == 1:
        return keys
    tag = f"/tp{rank}of{world_size}".encode()
    return [_shard_key(key, tag) for key in keys]


@lru_cache(maxsize=1 << 16)
def _shard_key(key: bytes, tag: bytes) -> bytes:
    """Derived once per block and rank (the scheduler's lookups and every step's records ask again)."""
    return xxhash.xxh3_128(key + tag).digest()


def for_rank(specs: list, rank: int, world_size: int) -> list:
    """`LoadSpec`s or `SaveSpec`s with their keys (a save's `held_keys` too) for rank `rank`'s shards."""
    out = []
    for spec in specs:
        keys = {"keys": shard_keys(spec.keys, rank, world_size)}
        if isinstance(spec, SaveSpec):
            keys["held_keys"] = shard_keys(spec.held_keys, rank, world_size)
        out.append(replace(spec, **keys))
    return out


def request_namespace(cache_salt: str | None, lora_name: str | None = None) -> str:
    """The tenant part of a key: the request's `cache_salt`, and its LoRA adapter (different KV)."""
    namespace = cache_salt or ""
    return f"{namespace}\x00lora:{lora_name}" if lora_name else namespace


class RequestTracker:
    """One request's chained keys (extended as its tokens grow) and what of it went to the tiers."""

    def __init__(self, space: KeySpace) -> None:
        self.space = space
        self.chain = KeyChain(space)       # the request's keys, grown with its tokens
        self.num_saved_blocks = 0          # blocks [0, num_saved_blocks) are in the tiers or queued
        self.device_prefix_checked = False  # its device-cached first blocks looked up in the tiers once
        self.load: LoadPlan | None = None  # the plan admitted with its loaded block ids, until finished
        self.load_block_ids: list[int] = []

    def keys_for(self, token_ids: list[int], num_blocks: int) -> list[bytes]:
        """Keys of the first `num_blocks` full blocks of `token_ids` (the chain is extended, never rehashed)."""
        return self.chain.extend(token_ids, num_blocks)

    def loaded_tokens_by_tier(self) -> dict[str, int]:
        if self.load is None:
            return {}
        block_tokens = self.space.layout.block_tokens
        return {tier: n * block_tokens for tier, n in Counter(self.load.tiers).items()}

    def drop_failed_loads(self, invalid_block_ids: set[int]) -> bool:
        """Forget loaded blocks from the first that failed on: they are recomputed, and saved again."""
        bad = [i for i, block_id in enumerate(self.load_block_ids) if block_id in invalid_block_ids]
        if not bad or self.load is None:
            return False
        first = bad[0]
        self.load.tiers = self.load.tiers[:first]
        self.load_block_ids = self.load_block_ids[:first]
        self.num_saved_blocks = min(self.num_saved_blocks, self.load.first_block + first)
        return True


@dataclass(slots=True)
class StepRecords:
    """The scheduler's records for one step, handed to the worker inside the connector metadata."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    deletes: dict[str, list[bytes]] = field(default_factory=dict)  # tier name -> files (keys) its index evicted
    delete_ranks: dict[str, list[int]] = field(default_factory=dict)  # ... whose shard each is (several ranks)
