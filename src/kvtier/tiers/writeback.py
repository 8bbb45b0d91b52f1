"""Write-back: the tier stack's writes below the top tier, off the compute path, on one queue.

This is the process's one writer: one queue, one thread, one bound, one drop counter. Down it go the
saves an engine hands off (`run_later(job, blocks=n)`: `BlockMover.save` — encode, then the manager's put),
the promotions of blocks a read fetched from below into the top tier (`run_later`, off the reader's critical
path), write-through (every block put into the top tier, so a second process on the same SSD or pool sees
it) and demotion (a block the top tier evicted that no lower tier holds yet). A put made on the writer
thread itself (a save's) writes through and demotes there and then: no second queue. Once write-through has
placed a batch below, the top tier is told (`placed_below`): its later eviction returns the key alone — no
bytes copied out, no lookup below. A full queue drops the batch (counted in blocks): the compute path never
waits on a slow tier.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from kvtier.lru import tail_first

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
    lock, health). `threaded=False` writes on the caller's thread (tests, lookups-only stacks)."""

    def __init__(self, tiers: list, guarded, *, threaded: bool = True, max_pending: int = 1024) -> None:
        self.tiers = tiers
        self._guarded = guarded
        self.num_dropped = 0
        self._queue: queue.Queue | None = None
        if threaded:  # even over one tier: the saves run here
            self._queue = queue.Queue(max_pending)
            self._thread = threading.Thread(target=self._drain, name="kvtier-writes", daemon=True)
            self._thread.start()

    def submit(self, items: list[tuple[bytes, bytes]], *, through: bool, chains: Sequence[list[bytes]] = ()) -> None:
        """Write `items` to the lower tiers: `through` for blocks the top tier keeps (then marked
        placed below), else a demotion of blocks it evicted. `chains`: those a save extends, refreshed in
        each lower tier with the put (`put_chained`)."""
        if len(self.tiers) < 2 or not (items or chains):
            return
        if self._queue is None or self.on_writer_thread():  # a save's put: write through now, in its job
            self._write(items, through, chains)
            return
        try:
            self._queue.put_nowait((items, through, chains))
        except queue.Full:  # never block the compute path on a slow tier
            self.num_dropped += len(items)

    @property
    def threaded(self) -> bool:
        return self._queue is not None

    def on_writer_thread(self) -> bool:
        return self._queue is not None and threading.current_thread() is self._thread

    def run_later(self, fn, *, blocks: int = 0) -> bool:
        """Run `fn()` on the writer thread, after what was queued before it. False where there is no
        writer thread or its queue is full: the caller runs it itself (a promotion), or drops it (a save
        of `blocks` blocks, counted here)."""
        if self._queue is None:
            return False
        try:
            self._queue.put_nowait(fn)
            return True
        except queue.Full:
            self.num_dropped += blocks
            return False

    def _drain(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                if callable(batch):
                    batch()
                    continue
                self._write(*batch)
            except Exception:  # a failing tier must not kill the writer
                log.exception("write to a lower tier failed")
            finally:
                self._queue.task_done()

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
        """Batches queued or being written."""
        return self._queue.unfinished_tasks if self._queue is not None else 0

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        self.flush()
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._queue = None
