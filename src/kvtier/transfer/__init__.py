"""Moving blocks: the process's transfer executor (`executor.py`: the threads every load's pieces and every
write below the top tier run on), and the block mover (`mover.py`: restoring a matched prefix into KV memory and
saving full blocks down the tiers — one mechanism for every engine; each caller supplies only its destination
write, a `BlockSink`).

The mover's names are imported on first use (PEP 562): the tiers import `kvtier.transfer.executor`, and the
mover imports the manager, which imports the tiers — an eager import here would be a cycle.
"""

from __future__ import annotations

import importlib

__all__ = ["BlockMover", "BlockSink", "KeptBlocks", "MoverStats", "Restored"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("kvtier.transfer.mover"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
