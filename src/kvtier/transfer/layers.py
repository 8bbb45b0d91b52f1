"""A layerwise restore: layer l of every block of a few loads, proven, handed over before the last layer of
any block is read (vLLM's layerwise loads: the forward's attention of layer l waits for layer l only).

`restoring_layers(manager, codec, layout, matches)` streams the matches together through
`TierManager.stream_layers` (a layered block's header and layer table proven first, then each slice just
before its layer; other blocks read and proven whole) and yields, per layer, each match's prefix so far:
a match's prefix ends at its first block that is missing, bad (at this layer or before), or not of the
layout's shape — the blocks after it are never handed over, and later layers hand over fewer blocks. A
block cut off at layer k had layers 0..k-1 written, each proven: the caller reports it (and those after
it) as not loaded, to be recomputed. `Restored` per match: the blocks handed over in every layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import Codec, CorruptBlockError
from kvtier.tiers.manager import Leases, PrefixMatch, TierManager, VerifiedBlock, release
from kvtier.transfer.mover import Restored

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LayerOfBlocks:
    layer: int
    blocks: list[list[torch.Tensor]]  # per match, its prefix's layer `layer`: [2, H, T, D] each (MLA [1, 1, T, D])


def _joined(matches: list[PrefixMatch]) -> PrefixMatch:
    """The matches as one (their pins with them), read in one stream."""
    joined = PrefixMatch([], [], [], [])
    for match in matches:
        joined.keys += match.keys
        joined.tier_indices += match.tier_indices
        joined.tiers += match.tiers
        joined.pinned += match.pinned or [False] * len(match)
    return joined


class LayerRestore:
    """Iterate for `LayerOfBlocks`, layer 0 first; `restored` is set once the last layer was handed over."""

    def __init__(self, manager: TierManager, codec: Codec, layout: KVLayout, matches: list[PrefixMatch],
                 hold: Leases) -> None:
        self.codec = codec
        self.layout = layout
        self.restored: list[Restored] = [Restored() for _ in matches]
        self._sizes = [len(match) for match in matches]
        self._manager, self._match = manager, _joined(matches)
        self._stream = manager.stream_layers(self._match, layout.num_layers, hold=hold)
        self._started = False
        self._whole: dict[int, torch.Tensor] = {}  # blocks read whole (no layer table): decoded once

    def __iter__(self) -> Iterator[LayerOfBlocks]:
        ends = list(self._sizes)  # each match's prefix: blocks [0, end)
        tiers: list[str | None] = [None] * sum(self._sizes)
        self._started = True
        with closing(self._stream) as stream:
            for layer, blocks in enumerate(stream):
                out, offset = [], 0
                for m, size in enumerate(self._sizes):
                    kept = []
                    for j in range(ends[m]):
                        kv = self._layer(blocks[offset + j], offset + j, layer)
                        if kv is None:
                            ends[m] = j
                            break
                        kept.append(kv)
                        tiers[offset + j] = blocks[offset + j].tier
                    out.append(kept)
                    offset += size
                yield LayerOfBlocks(layer, out)
        offset = 0
        for m, size in enumerate(self._sizes):
            self.restored[m] = Restored(list(tiers[offset:offset + ends[m]]))
            offset += size

    def close(self) -> None:
        if not self._started:  # a stream never started holds no lease, but the match's pins
            self._manager.unpin(self._match)
        self._stream.close()

    def _layer(self, block: VerifiedBlock | None, i: int, layer: int) -> torch.Tensor | None:
        if block is None:
            return None
        try:
            if layer == 0:
                self._check_shape(block)
                if not block.header.layered:
                    self._whole[i] = self.codec.decode_verified(block.header, block.payload)
            if i in self._whole:
                return self._whole[i][layer]
            return self.codec.decode_layer(block.header, block.payload, layer)
        except CorruptBlockError as exc:
            log.warning("block %s from %s rejected (%s); recomputing from it", block.key.hex()[:12], block.tier, exc)
            return None

    def _check_shape(self, block: VerifiedBlock) -> None:
        hdr, layout = block.header, self.layout
        if hdr.shape != layout.block_shape or hdr.dtype != layout.dtype:
            raise CorruptBlockError(f"shape {hdr.shape} {hdr.dtype}, expected {layout.block_shape} {layout.dtype}")


@contextmanager
def restoring_layers(manager: TierManager, codec: Codec, layout: KVLayout,
                     matches: list[PrefixMatch]) -> Iterator[LayerRestore]:
    """A `LayerRestore` of `matches`; every tensor it handed over stays valid inside the `with` (leased tier
    memory is given back at its exit)."""
    held: Leases = []
    restore = LayerRestore(manager, codec, layout, matches, held)
    try:
        yield restore
    finally:
        restore.close()
        release(held)
