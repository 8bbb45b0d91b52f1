"""The block mover: restoring a matched prefix into KV memory and saving full blocks down the tiers —
one mechanism for every engine; each caller supplies only its destination write (a `BlockSink`)."""

from kvtier.transfer.mover import BlockMover, BlockSink, KeptBlocks, MoverStats, Restored

__all__ = ["BlockMover", "BlockSink", "KeptBlocks", "MoverStats", "Restored"]
