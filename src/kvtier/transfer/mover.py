"""`BlockMover`: the one way blocks move between the tier stack and an engine's KV memory.

- restore (`restore` / `restoring`): the tier manager streams a match's blocks (`TierManager.stream`:
  read where the lookup found them, the next chunk read ahead while this one is copied, each block
  verified just before it is handed over, so its copy reads it from cache); the mover decodes each,
  checks its shape, and hands it to the caller's `BlockSink.write(index, block)` — the only part that
  differs per engine (vLLM's ExampleConnector keeps `inject_kv_into_layer` apart the same way). The
  prefix ends at the first block missing, bad, of the wrong shape, or whose write raised; the
  blocks before it stand. A block handed over may view a tier's memory (a leased DRAM slot, an SSD or
  Mooncake read buffer) and stays valid until the restore ends, so a sink may gather the blocks and
  write them layer by layer after the last (vLLM's layerwise loads: layer l ready before layer l+1).
  A sink that hands its copies to a `CopyGroup` (`transfer.copies`: a restore beside no forward, on
  several threads) passes it as `copies`: the mover finishes it before any lease ends, and a failed
  copy restores nothing (logged, counted; the destination may be half-written, the caller computes).
- save (`save(keys, blocks)`): the encode (checksum) and the manager's put of full blocks run off the
  caller's step, as a job on the process's writes lane (`TierManager.write_later`, `tiers/writeback.py`, the
  transfer executor's one writes thread), where the put writes through to the lower tiers at once: the same
  lane, bound and drop counter for saves, write-through, demotion and promotion. A full lane (or this
  manager's share of it) drops the save (a future miss, counted).
  `synchronous=True` (or a manager without a writer thread) runs each save on the caller's thread;
  `on_thread_start` runs once on the writer thread before its first save (vLLM's CPU worker:
  `integrations/vllm/cpus.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import Codec, CorruptBlockError
from kvtier.tiers.manager import Leases, PrefixMatch, TierManager, VerifiedBlock, release
from kvtier.transfer.copies import CopyGroup

log = logging.getLogger(__name__)


class BlockSink(Protocol):
    def write(self, index: int, block: torch.Tensor) -> None:
        """Block `index` of the match, verified and decoded: [L, 2, H, T, D]. Valid until the restore
        ends (a sink may keep it and write later, layer by layer). Raising ends the restore there."""


class KeptBlocks(list):
    """A sink that keeps the restored blocks, in order (each valid until the restore ends): for a caller
    that copies them itself once they are all in (an arena written on the step thread, a cache's layers)."""

    def write(self, index: int, block: torch.Tensor) -> None:
        self.append(block)


@dataclass(slots=True)
class Restored:
    """What a restore put into the destination: the first `len(tiers)` blocks of the match."""

    tiers: list[str] = field(default_factory=list)  # the tier each restored block came from

    def __len__(self) -> int:
        return len(self.tiers)


@dataclass(slots=True)
class MoverStats:
    num_blocks_restored: int = 0    # into a sink
    restore_seconds: float = 0.0    # reading, verifying, decoding and the sink's writes
    num_blocks_saved: int = 0
    num_blocks_dropped: int = 0     # a full save queue, or a save that failed
    save_seconds: float = 0.0       # encoding and the manager's put (the top tier; the rest is write-back)
    errors: int = 0


@dataclass(slots=True)
class _Save:
    keys: list[bytes]
    blocks: Sequence[torch.Tensor]  # each [L, 2, H, T, D], on the CPU (owned by the save: copied off the step)
    skip_held: bool
    chains: Sequence[list[bytes]] = ()  # the requests' chains the blocks extend (root first, new keys included)


class BlockMover:
    """Restores and saves for one engine. `layout`: restored blocks must have its shape and dtype.
    The save queue is the manager's writer (its bound is the manager's `max_pending_writes`)."""

    def __init__(self, manager: TierManager, codec: Codec, *, layout: KVLayout | None = None,
                 synchronous: bool = False, on_thread_start: Callable[[], None] | None = None) -> None:
        self.manager = manager
        self.codec = codec
        self.layout = layout
        self.stats = MoverStats()
        self._lock = threading.Lock()  # the stats: restores and saves run on different threads
        self._synchronous = synchronous or not manager.has_writer_thread
        self._on_thread_start = on_thread_start
        self._started: set[int] = set()  # writer threads that ran `on_thread_start`

    # -- restore -------------------------------------------------------------------------------------
    def restore(self, match: PrefixMatch, sink: BlockSink, *, copies: CopyGroup | None = None) -> Restored:
        """Stream `match` into `sink`; returns what was restored (the first blocks, maybe not all).
        `copies`: the group the sink hands its copies to, finished before the blocks are let go."""
        with self.restoring(match, sink, copies=copies) as restored:
            return restored

    @contextmanager
    def restoring(self, match: PrefixMatch, sink: BlockSink, *, copies: CopyGroup | None = None) -> Iterator[Restored]:
        """`restore`, with every block handed to the sink still valid inside the `with`: leased tier
        memory is given back at its exit (a sink that writes layer by layer does it there)."""
        start = time.perf_counter()
        restored = Restored()
        held: Leases = []
        try:
            with closing(self.manager.stream(match, hold=held)) as blocks:
                for index, block in enumerate(blocks):
                    kv = self._decode(block)
                    if kv is None or not self._write(sink, index, kv):
                        break
                    restored.tiers.append(block.tier)
            if copies is not None and not self._finish(copies, len(restored)):
                restored = Restored()
            self._count_restored(len(restored), start)
            yield restored
        except BaseException as exc:
            if copies is not None:
                copies.cancel(exc)  # no copy may read a lease about to end
            raise
        finally:
            release(held)

    def _count_restored(self, num_blocks: int, start: float) -> None:
        with self._lock:
            self.stats.num_blocks_restored += num_blocks
            self.stats.restore_seconds += time.perf_counter() - start

    def _finish(self, copies: CopyGroup, num_blocks: int) -> bool:
        try:
            copies.finish()
            return True
        except Exception:  # noqa: BLE001 - the blocks are computed instead
            log.exception("copying %d restored blocks into their destination failed; recomputing them", num_blocks)
            with self._lock:
                self.stats.errors += 1
            return False

    def _decode(self, block: VerifiedBlock) -> torch.Tensor | None:
        """The block's KV, or None (logged) if it does not decode to the expected shape."""
        try:
            kv = self.codec.decode_verified(block.header, block.payload)
        except CorruptBlockError as exc:
            log.warning("block %s from %s rejected (%s); recomputing from it", block.key.hex()[:12], block.tier, exc)
            return None
        layout = self.layout
        if layout is not None and (tuple(kv.shape) != layout.block_shape or str(kv.dtype) != f"torch.{layout.dtype}"):
            log.warning("block %s has shape %s %s, expected %s %s; recomputing from it", block.key.hex()[:12],
                        tuple(kv.shape), kv.dtype, layout.block_shape, layout.dtype)
            return None
        return kv

    def _write(self, sink: BlockSink, index: int, kv: torch.Tensor) -> bool:
        try:
            sink.write(index, kv)
            return True
        except Exception:  # noqa: BLE001 - the blocks written so far stand; the rest is computed
            log.exception("writing a restored block into its destination failed after %d blocks", index)
            with self._lock:
                self.stats.errors += 1
            return False

    # -- save ----------------------------------------------------------------------------------------
    def save(self, keys: list[bytes], blocks: Sequence[torch.Tensor], *, skip_held: bool = False,
             chains: Sequence[list[bytes]] = ()) -> bool:
        """Encode `blocks` (each [L, 2, H, T, D], the block `keys[i]` names) and put them down the
        tiers, off the caller's thread. `skip_held`: first ask the tiers, write only what none holds.
        `chains`: the requests' chains the blocks extend (each its blocks so far, root first, these new ones
        included): a turn's save carries only its new blocks, and every tier that holds the chain's earlier
        ones refreshes them with the put, tail first, without rewriting them (`TierManager.put_many`) — else
        the new blocks would outrank the root they extend, and a full tier would strand them.
        False: the writer's queue was full and the save is dropped (counted). A block that must be in host
        memory now and stay there (an offloaded sequence's, leaving its device window) is not saved but pinned
        (`LLMEngine._offload_block`, `HostBlockPool.pin`): it shares `encode` and the manager's store."""
        if not keys:
            return True
        job = _Save(list(keys), blocks, skip_held, chains)
        if self._synchronous:
            self._save(job)
            return True
        if self.manager.write_later(lambda: self._save_on_writer(job), blocks=len(job.keys)):
            return True
        with self._lock:  # never stall a step on write-back
            self.stats.num_blocks_dropped += len(job.keys)
        return False

    def encode(self, key: bytes, block: torch.Tensor) -> bytes:
        """Block `key` ([L, 2, H, T, D]) as the tiers keep it: the codec's bytes under a header bound to its
        key (what a save puts down; an offloaded sequence's block leaving its device window too)."""
        return self.codec.encode(block, key)

    def _save_on_writer(self, job: _Save) -> None:
        if self._on_thread_start is not None and threading.get_ident() not in self._started:
            self._started.add(threading.get_ident())
            self._on_thread_start()  # e.g. where the writer runs beside an engine's forward
        self._save(job)

    def _save(self, job: _Save) -> None:
        start = time.perf_counter()
        saved = dropped = errors = 0
        try:
            items = list(zip(job.keys, job.blocks))
            if job.skip_held:
                held = self.manager.contains_many(job.keys)
                items = [item for item, is_held in zip(items, held) if not is_held]
            if items or job.chains:
                self.manager.put_many([(key, self.encode(key, block)) for key, block in items], chains=job.chains)
            saved = len(items)
        except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
            log.exception("saving %d blocks failed", len(job.keys))
            dropped, errors = len(job.keys), 1
        with self._lock:
            self.stats.num_blocks_saved += saved
            self.stats.num_blocks_dropped += dropped
            self.stats.errors += errors
            self.stats.save_seconds += time.perf_counter() - start

    def wait_saves(self) -> None:
        """Until every save handed over is in the tiers (the writer's queue drained: write-through too)."""
        if not self._synchronous:
            self.manager.flush()

    def close(self) -> None:
        """The saves handed over land first; the writer itself is the manager's (closed with it)."""
        self.wait_saves()
