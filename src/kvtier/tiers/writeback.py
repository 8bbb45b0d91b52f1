"""Write-back: the tier stack's writes below the top tier, off the compute path, on the process's writes lane.

A manager's `WriteBack` owns no thread and no queue: it queues its writes on the transfer executor's one
writes lane (`kvtier/transfer/executor.py`: one thread for every manager of the process, in submission order,
one bound, one drop counter), through a `Writes` view that counts its own. Down it go the saves an engine hands
off (`run_later(job, blocks=n)`: `BlockMover.save` — encode, then the manager's put), the promotions of blocks a
read fetched from below into the top tier (`run_later`, off the reader's critical path, after what was queued
before), write-through (every block put into the top tier, so a second process on the same SSD or pool sees
it) and demotion (a block the top tier evicted that no lower tier holds yet). A put made on the writes lane
itself (a save's) writes through and demotes there and then. Once write-through has placed a batch below, the
top tier is told (`placed_below`): its later eviction returns the key alone — no bytes copied out, no lookup
below. A write that does not fit (this manager's `max_pending` waiting, or the lane full) is dropped, counted
in blocks here and in the executor: the compute path never waits on a slow tier.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.lru import tail_first
from kvtier.transfer.executor import Writes, on_writes_lane

log = logging.getLogger(__name__)


def put_chained(tier, items: list[tuple[bytes, bytes]], chains: Sequence[list[bytes]] = ()) -> list:
    """`tier.put_many(items)` for blocks that extend `chains` (requests' blocks so far, root first, the new
    ones included: a save carries only a turn's new blocks). In a tier with an LRU of its own (`touch_many`)
    the chains' blocks it holds are refreshed with the batch, tail first (`kvtier.lru`), never rewritten: one
    that takes `chains` itself (`puts_chains`: DRAM, one lock take) keeps them from the batch's evictions;
    any other is refreshed before the put (out of its evictions' way) and after it (the root most recent)."""
    if not chains or not hasattr(tier, "touch_many"):
        return tier.put_many(items) if items else []
    if getattr(tier, "puts_chains", False):
        return tier.put_many(items, chains=chains)
    keys = [key for chain in chains for key in chain]
    tier.touch_many(keys)
    evicted = tier.put_many(items) if items else []
    tier.touch_many(keys)
    return evicted


class WriteBack:
    """`guarded(tier, what, fn, fallback, writing=True)` is the manager's call into a tier (its write
    lock, health). `threaded=False` writes on the caller's thread (tests, lookups-only stacks).
    `max_pending`: this manager's writes waiting on the lane before one is dropped."""

    def __init__(self, tiers: list, guarded, *, threaded: bool = True, max_pending: int = 1024) -> None:
        self.tiers = tiers
        self._guarded = guarded
        self._writes = Writes(max_pending) if threaded else None  # even over one tier: the saves run there
        self._closed = False

    def submit(self, items: list[tuple[bytes, bytes]], *, through: bool, chains: Sequence[list[bytes]] = ()) -> None:
        """Write `items` to the lower tiers: `through` for blocks the top tier keeps (then marked
        placed below), else a demotion of blocks it evicted. `chains`: those a save extends, refreshed in
        each lower tier with the put (`put_chained`)."""
        if len(self.tiers) < 2 or not (items or chains):
            return
        if not self.threaded or self.on_writer_thread():  # a save's put: write through now, in its job
            self._write(items, through, chains)
            return
        self._writes.write(lambda: self._write(items, through, chains), blocks=len(items))  # full: dropped, counted

    @property
    def threaded(self) -> bool:
        return self._writes is not None and not self._closed

    @property
    def num_dropped(self) -> int:
        """Blocks of this manager's writes dropped (the executor's `num_dropped`: every manager's)."""
        return self._writes.num_dropped if self._writes is not None else 0

    def on_writer_thread(self) -> bool:
        """Running on the writes lane (any manager's write: the lane is the process's)."""
        return self.threaded and on_writes_lane()

    def run_later(self, fn, *, blocks: int = 0) -> bool:
        """Run `fn()` on the writes lane, after what was queued before it. False where there is no
        writes lane or it is full: the caller runs it itself (a promotion), or drops it (a save
        of `blocks` blocks, counted here)."""
        return self.threaded and self._writes.write(fn, blocks=blocks)

    def _write(self, items: list[tuple[bytes, bytes]], through: bool, chains: Sequence[list[bytes]] = ()) -> None:
        if not through:  # evicted least recent first; a put takes the most valuable first (a chain root first)
            items = tail_first(items)
        keys = [k for k, _ in items]
        placed = False
        for tier in self.tiers[1:]:
            held = self._guarded(tier, "contains", lambda t=tier: t.contains_many(keys), [True] * len(items),
                                 writing=True) if keys else []
            new = [(k, d) for (k, d), h in zip(items, held) if not h]
            if new or chains:
                self._guarded(tier, "put", lambda t=tier, n=new: put_chained(t, n, chains), [], writing=True)
            placed = placed or tier.health.writable
        if through and placed and keys:
            top = self.tiers[0]
            self._guarded(top, "placed_below", lambda: top.placed_below(keys), None, writing=True)

    @property
    def num_pending(self) -> int:
        """Writes queued or running."""
        return self._writes.num_pending if self._writes is not None else 0

    @property
    def num_queued(self) -> int:
        """Writes waiting to start (at most `max_pending`)."""
        return self._writes.num_queued if self._writes is not None else 0

    def flush(self) -> None:
        """Until this manager's writes queued so far have run (and, the lane being in order, every write queued
        before them, whoever's; not those queued after)."""
        if self._writes is not None:
            self._writes.join()

    def close(self) -> None:
        """From now on it writes on the caller's thread (`run_later` says False), then flushes: a write made
        meanwhile never lands on the lane after the manager has closed its tiers."""
        self._closed = True
        self.flush()
