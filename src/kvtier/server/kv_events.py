"""`kvtier serve --kv-events-config`: what the server holds, announced as vLLM's KV cache events.

Two sources, both watched, neither calling up: the engine's device prefix cache (`BlockManager.watch()`:
a block registered is stored on the device, medium "GPU" as vLLM names its device on a CPU too; one
evicted is removed) and each tier (`TierManager.watch()`, mediums as the vLLM connector announces them:
`events/tracker.py`). Block hashes are kvtier's own chained keys (low 64 bits): a block's device
and tier copies share one; a request's `cache_salt` is in its keys (two tenants' identical blocks are
two blocks) and, as vLLM does, in the first block's `extra_keys`. A tier event names a key only;
`KvEventTracker` names it by the description the device gave it when it was registered; a block loaded
from a tier is announced there too (an earlier run's SSD file, another replica's pool block).

The decode loop only appends to the device's bounded log; the publisher's thread drains both logs
(`collect`), builds the events and sends them (`events/publisher.py`).
"""

from __future__ import annotations

from typing import Any

from kvtier.engine.block_manager import BlockEvents, BlockOrigin
from kvtier.events import wire
from kvtier.events.publisher import KvEventPublisher, KvEventsConfig
from kvtier.events.tracker import BlockInfo, KvEventTracker, Stored


class ServeKvEvents:
    """The device's and the tiers' events as vLLM's, one batch per `collect()`."""

    def __init__(self, device: BlockEvents, block_tokens: int, tiers=None) -> None:
        self._device, self._tiers = device, tiers  # tiers: a TierEvents log, or None with no tier
        self.block_tokens = block_tokens
        self.tracker = KvEventTracker()

    @property
    def num_dropped(self) -> int:
        """Device events the thread fell too far behind to see (the log's oldest dropped)."""
        return self._device.num_dropped

    def collect(self) -> list[dict[str, Any]]:
        # the tiers' log first: a tier event follows its block's registration, so it is in this
        # device batch or an earlier one (the tracker knows the block by then)
        tier_events = self._tiers.take() if self._tiers is not None else []
        out: list[dict[str, Any]] = []
        for event in self._device.take():
            block_hash = wire.block_hash(event.key)
            if not event.stored:
                last = out[-1] if out else None
                if last is not None and last["type"] == "BlockRemoved":
                    last["block_hashes"].append(block_hash)
                else:
                    out.append(wire.block_removed([block_hash], wire.MEDIUM_GPU))
                continue
            if event.origin is None:  # registered without saying what it holds: nothing to describe it by
                continue
            info = block_info(block_hash, event.origin)
            self.tracker.describe([event.key], [info])
            if event.origin.tier is not None:  # loaded from a tier: held there, whoever wrote it (an earlier run)
                self.tracker.found([event.key], [event.origin.tier])
            out.append(to_wire(Stored(info, wire.MEDIUM_GPU), self.block_tokens))
        self.tracker.apply(tier_events)
        out += [to_wire(record, self.block_tokens) for record in self.tracker.take()]
        return out


def block_info(block_hash: int, origin: BlockOrigin) -> BlockInfo:
    """vLLM's description of a block: the cache_salt in a prompt's first block's extra keys."""
    parent = wire.block_hash(origin.parent) if origin.parent is not None else None
    salted = origin.parent is None and origin.namespace
    return BlockInfo(block_hash=block_hash, parent_hash=parent, token_ids=origin.token_ids,
                     extra_keys=(origin.namespace,) if salted else None, cache_salt=origin.namespace or None)


def to_wire(record, block_tokens: int) -> dict[str, Any]:
    if isinstance(record, Stored):
        info = record.block
        return wire.block_stored([info.block_hash], info.parent_hash, list(info.token_ids), block_tokens,
                                 record.medium, lora_id=info.lora_id, lora_name=info.lora_name,
                                 extra_keys=[info.extra_keys] if info.extra_keys is not None else None,
                                 cache_salt=info.cache_salt)
    return wire.block_removed(list(record.block_hashes), record.medium)


def start(config: KvEventsConfig, engine, manager=None) -> tuple[KvEventPublisher, ServeKvEvents]:
    """Watch `engine`'s device blocks and `manager`'s tiers; publish them as `config` says."""
    device = engine.block_manager.watch(config.max_queue_size)
    events = ServeKvEvents(device, engine.layout.block_tokens, manager.watch() if manager is not None else None)
    return KvEventPublisher(config, events.collect), events
