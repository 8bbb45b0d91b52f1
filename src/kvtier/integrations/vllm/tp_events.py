"""Tensor parallelism in vLLM's KV events: each rank stores its shard of a block under its own key
(`trackers.shard_keys`), and a block is a hit only when every rank's shard is held. `ShardedBlocks` turns
the ranks' tier events back into the block's own (chain) key — stored once the last rank's shard landed in a
tier, removed as soon as one rank's shard left it — before `kvtier.events.tracker` names them.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.events.tracker import MAX_UNHELD_BLOCKS
from kvtier.integrations.vllm.trackers import shard_keys
from kvtier.tiers.events import TierEvent


class ShardedBlocks:
    """Tensor parallel: the ranks' tier events (under shard keys) as events of whole blocks (chain keys).
    The scheduler `learn`s each block it describes; an event for a shard key it never learned (a block
    from before this process, or forgotten past `max_blocks`) is dropped — a router then misses a hit,
    never gains a false one."""

    def __init__(self, world_size: int, max_blocks: int = MAX_UNHELD_BLOCKS * 2) -> None:
        self.world_size = world_size
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, dict[str, set[int]]] = OrderedDict()  # chain key -> tier -> ranks in it
        self._shard: dict[bytes, tuple[bytes, int]] = {}                      # shard key -> (chain key, rank)
        self.num_unknown = 0

    def learn(self, keys: list[bytes]) -> None:
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = {}
            for rank, shard in enumerate(self._shards_of(key)):
                self._shard[shard] = (key, rank)
        while len(self._blocks) > self.max_blocks:
            old, _ = self._blocks.popitem(last=False)
            for shard in self._shards_of(old):
                self._shard.pop(shard, None)

    def found(self, keys: list[bytes], tiers: list[str]) -> None:
        """A lookup found every rank's shard of `keys[i]` in `tiers[i]` (a hit needs them all)."""
        for key, tier in zip(keys, tiers):
            if key in self._blocks:
                self._blocks[key][tier] = set(range(self.world_size))

    def _shards_of(self, key: bytes) -> list[bytes]:
        return [shard_keys([key], rank, self.world_size)[0] for rank in range(self.world_size)]

    def combine(self, events: list[TierEvent]) -> list[TierEvent]:
        out: list[TierEvent] = []
        for event in events:
            whole: list[bytes] = []
            for key in event.keys:
                named = self._shard.get(key)
                if named is None:
                    self.num_unknown += 1
                    continue
                block, rank = named
                held = self._blocks[block].setdefault(event.tier, set())
                was_whole = len(held) == self.world_size
                if event.stored:
                    held.add(rank)
                    if not was_whole and len(held) == self.world_size:
                        whole.append(block)
                else:
                    held.discard(rank)
                    if was_whole:
                        whole.append(block)  # withdrawn at its first missing shard
            if whole:
                out.append(TierEvent(event.tier, event.stored, tuple(whole)))
        return out
