"""The tier stack: lookup across tiers, verified reads, promotion, write-through and demotion.

Tiers are ordered top (fastest) first. `put_many` writes the top tier synchronously and the
lower tiers on one worker thread (write-through, so a second process on the same SSD or pool sees
the blocks); blocks the top tier evicts are demoted to the next tier. Every block read is checked
with `codecs.header.verify`: a corrupt block is deleted, counted, and ends the prefix there — the
caller recomputes from that point. The manager never calls up into its callers.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvtier.codecs.header import CorruptBlockError, verify
from kvtier.tiers import Tier, TierStats, make_tier

log = logging.getLogger(__name__)


class TierManager:
    def __init__(self, tiers: list[Tier], *, async_writes: bool = True, max_pending_writes: int = 1024) -> None:
        if not tiers:
            raise ValueError("a TierManager needs at least one tier")
        self.tiers = tiers
        self.num_dropped_writes = 0
        self._lock = threading.Lock()  # tiers are not thread-safe: one caller at a time
        self._queue: queue.Queue | None = None
        if async_writes and len(tiers) > 1:
            self._queue = queue.Queue(max_pending_writes)
            self._worker = threading.Thread(target=self._drain, name="kvtier-writes", daemon=True)
            self._worker.start()

    # -- reads -----------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes]) -> list[str]:
        """Tier name of each block of the longest prefix of `keys` held anywhere."""
        with self._lock:
            held = [tier.contains_many(keys) for tier in self.tiers]
        names = []
        for i in range(len(keys)):
            tier_idx = next((t for t, flags in enumerate(held) if flags[i]), None)
            if tier_idx is None:
                break
            names.append(self.tiers[tier_idx].name)
        return names

    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        """Verified payloads of the longest prefix; lower-tier hits are promoted to the top tier."""
        out: list[bytes] = []
        promote: list[tuple[bytes, bytes]] = []
        with self._lock:
            for key in keys:
                data, tier_idx = self._get_one(key)
                if data is None:
                    break
                out.append(data)
                if tier_idx > 0:
                    promote.append((key, data))
            if promote:
                self._put_top(promote)
        return out

    def _get_one(self, key: bytes) -> tuple[bytes | None, int]:
        for idx, tier in enumerate(self.tiers):
            if not tier.contains_many([key])[0]:
                continue
            [data] = tier.get_many([key])
            if data is None:
                continue
            try:
                verify(data)
            except CorruptBlockError as exc:
                log.warning("corrupt block %s in %s: %s (recomputing)", key.hex()[:12], tier.name, exc)
                tier.stats.corrupt += 1
                tier.delete(key)
                return None, idx
            return data, idx
        return None, -1

    # -- writes ----------------------------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._lock:
            self._put_top(items)
        if len(self.tiers) > 1:
            self._enqueue(items)

    def _put_top(self, items: list[tuple[bytes, bytes]]) -> None:
        evicted = self.tiers[0].put_many(items)
        if evicted and len(self.tiers) > 1:
            self._enqueue(evicted)  # demotion (a no-op below if write-through already put it there)

    def _enqueue(self, items: list[tuple[bytes, bytes]]) -> None:
        if self._queue is None:
            self._write_lower(items)
            return
        try:
            self._queue.put_nowait(items)
        except queue.Full:  # never block the compute path on a slow tier
            self.num_dropped_writes += len(items)

    def _drain(self) -> None:
        while True:
            items = self._queue.get()
            try:
                if items is None:
                    return
                self._write_lower(items)
            except Exception:  # a failing tier must not kill the writer
                log.exception("write to a lower tier failed")
            finally:
                self._queue.task_done()

    def _write_lower(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._lock:
            for tier in self.tiers[1:]:
                new = [(k, d) for (k, d), held in zip(items, tier.contains_many([k for k, _ in items])) if not held]
                if new:
                    tier.put_many(new)

    def prefetch(self, keys: list[bytes]) -> None:
        """Promote the cached prefix of `keys` into the top tier ahead of use."""
        if self._queue is None:
            self.get_prefix(keys)
            return
        threading.Thread(target=self.get_prefix, args=(keys,), daemon=True).start()

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.join()

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats for tier in self.tiers}

    def occupancy(self) -> dict[str, tuple[int, int | None]]:
        return {tier.name: (tier.used_bytes(), tier.capacity_bytes) for tier in self.tiers}

    def close(self) -> None:
        self.flush()
        if self._queue is not None:
            self._queue.put(None)
            self._worker.join(timeout=10)
            self._queue = None
        for tier in self.tiers:
            tier.close()


def build_manager(specs: list[str], *, slot_bytes: int, async_writes: bool = True) -> TierManager:
    """Tiers from spec strings, top first: `dram:1GiB`, `ssd:/path:10GiB`."""
    return TierManager([make_tier(spec, slot_bytes=slot_bytes) for spec in specs], async_writes=async_writes)
