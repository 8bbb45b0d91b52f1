"""kvtier's tiers in vLLM's KV cache events (`--kv-events-config`): the connector's event API, both sides.

- Worker (`WorkerEvents`): its tier stack is watched (`TierManager.watch()`); after each step vLLM asks
  `get_kv_connector_kv_cache_events()` and gets what the tiers announced since (kvtier keys and tier
  names: `KvtierKVEvents`), with how many lower-tier writes are still queued.
- Scheduler (`SchedulerEvents`): `describe` snapshots each block it sends down or loads (vLLM's hash,
  parent, tokens, LoRA, extra keys) while its request is alive; the worker's announcements (through
  `update_connector_output`) and those of its own tiers (lookups: an SSD file or pool block found gone)
  become `BlockStored` / `BlockRemoved` under vLLM's own block hash in `take_events()`, which vLLM
  publishes with its device events. The operator adds `--kv-events-config` and starts nothing else.

One addition vLLM's own events do not carry: `cache_salt` on every block of a salted request (`SaltedBlockStored`,
the field `kvtier serve`'s events carry, `events/wire.py`). NVIDIA Dynamo's indexer keys a block under its tenant
by that field and ignores the salt in `extra_keys`; without it two tenants' identical prompts become one entry of
its index. vLLM's own device events still lack it: `kvtier route` adds it on their way to the selector
(`route/event_relay.py`).

Tier writes land after the step that sent them: with nothing else running vLLM would not step again,
and the last request's blocks would stay unannounced. `lingering()` (the connector's
`has_pending_push_work`) keeps the engine stepping — empty steps — while saves were sent or tier events
arrived in the last `QUIET_S`, or the worker still has lower-tier writes queued, for at most `MAX_LINGER_S`
after the last save.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

from kvtier.events.tracker import BlockInfo, KvEventTracker, Stored
from kvtier.integrations.vllm.tp_events import ShardedBlocks
from kvtier.tiers.events import TierEvent
from kvtier.tiers.manager import TierManager

class SaltedBlockStored(BlockStored, tag="BlockStored"):
    """vLLM's `BlockStored` (the same tag and fields: unsalted, the same map, `omit_defaults`) with the
    request's `cache_salt` on each block, as Dynamo's indexer reads it."""

    cache_salt: str | None = None


QUIET_S = 0.5       # keep stepping this long after the last save sent or tier event seen
MAX_LINGER_S = 30.0  # and never longer than this after the last save (a write that hangs)


@dataclass
class KvtierKVEvents(KVConnectorKVEvents):
    """Worker -> scheduler, once per step: what the worker's tiers announced, and its lower-tier write
    batches still queued."""

    events: list[TierEvent] = field(default_factory=list)
    num_pending_writes: int = 0
    num_workers: int = 1

    def add_events(self, events: list) -> None:
        self.events.extend(events)

    def aggregate(self) -> KvtierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events = []


class WorkerEvents:
    def __init__(self, manager: TierManager) -> None:
        self._manager = manager
        self._log = manager.watch()
        self._num_pending = 0

    def take(self) -> KvtierKVEvents | None:
        """What the tiers announced since the last step (None: nothing, and no change in the pending writes)."""
        events, pending = self._log.take(), self._manager.num_pending_writes
        if not events and pending == self._num_pending:
            return None
        self._num_pending = pending
        return KvtierKVEvents(events, pending)


class SchedulerEvents:
    """`world_size` > 1 (tensor parallel): the ranks' events name shards; `ShardedBlocks` makes them
    whole blocks (stored once every rank's shard is in a tier) before they reach the tracker."""

    def __init__(self, manager: TierManager, block_tokens: int, world_size: int = 1) -> None:
        self.tracker = KvEventTracker()
        self.block_tokens = block_tokens
        self.shards = ShardedBlocks(world_size) if world_size > 1 else None
        self._log = manager.watch()  # the scheduler's own tiers: what its lookups found gone
        self._quiet_until = 0.0
        self._give_up_at = 0.0
        self._worker_pending = 0

    def describe(self, request, first_block: int, keys: list[bytes], tiers: list[str] | None) -> None:
        """`keys` are blocks `first_block ..` of `request`, sent down (tiers None) or found in `tiers`."""
        infos = [block_info(request, first_block + i, self.block_tokens) for i in range(len(keys))]
        infos = infos[:infos.index(None)] if None in infos else infos
        self.tracker.describe(keys[:len(infos)], infos)
        if self.shards is not None:
            self.shards.learn(keys[:len(infos)])
        if tiers is not None:
            self.tracker.found(keys[:len(infos)], tiers)
            if self.shards is not None:
                self.shards.found(keys[:len(infos)], tiers)
        else:
            now = time.monotonic()
            self._quiet_until, self._give_up_at = now + QUIET_S, now + MAX_LINGER_S

    def from_worker(self, events: KVConnectorKVEvents | None) -> None:
        if not isinstance(events, KvtierKVEvents):
            return
        self.tracker.apply(self._whole(events.events))
        self._worker_pending = events.num_pending_writes
        if events.events:
            self._quiet_until = max(self._quiet_until, time.monotonic() + QUIET_S)

    def take(self) -> list[KVCacheEvent]:
        self.tracker.apply(self._whole(self._log.take()))
        return [to_vllm(record) for record in self.tracker.take()]

    def _whole(self, events: list[TierEvent]) -> list[TierEvent]:
        return events if self.shards is None else self.shards.combine(events)

    def lingering(self) -> bool:
        now = time.monotonic()
        return now < self._give_up_at and (now < self._quiet_until or self._worker_pending > 0)


def block_info(request, index: int, block_tokens: int) -> BlockInfo | None:
    """Block `index` of `request` as vLLM's own `BlockStored` describes it (one vLLM block = one kvtier
    block, hashed per block); None if vLLM has not hashed it (yet)."""
    hashes = request.block_hashes
    if index >= len(hashes):
        return None
    start, end = index * block_tokens, (index + 1) * block_tokens
    extra_keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    event_keys = to_event_extra_keys([extra_keys])
    lora = request.lora_request
    return BlockInfo(block_hash=maybe_convert_block_hash(hashes[index]),
                     parent_hash=maybe_convert_block_hash(hashes[index - 1]) if index > 0 else None,
                     token_ids=tuple(request.all_token_ids[start:end]),
                     lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
                     extra_keys=event_keys[0] if event_keys else None, cache_salt=request.cache_salt or None)


def to_vllm(record) -> KVCacheEvent:
    if isinstance(record, Stored):
        info = record.block
        return SaltedBlockStored(block_hashes=[info.block_hash], parent_block_hash=info.parent_hash,
                                 token_ids=list(info.token_ids), block_size=len(info.token_ids),
                                 lora_id=info.lora_id, medium=record.medium, lora_name=info.lora_name,
                                 extra_keys=[info.extra_keys] if info.extra_keys is not None else None,
                                 cache_salt=info.cache_salt)
    return BlockRemoved(block_hashes=list(record.block_hashes), medium=record.medium)
