"""`TierIO`: the engine's tier I/O, off the step thread — a thin user of `kvtier.transfer.BlockMover`.

The scheduler decides *what* moves (it matches a prompt's blocks in the tiers — pinning them there
until the load has read them — allocates device blocks for the hits and parks the sequence in
WAITING_FOR_KV, as vLLM's scheduler does with a KV connector); the mover does the moving, and the
engine supplies only the destination write:
- loads (this worker's thread): `BlockMover.restore(match, sink)` streams the blocks from where the
  match found them, each verified just before it is decoded and written into its device block by
  `write_block` (DRAM blocks read in place, leased slots; the device blocks are the waiting sequence's
  own: no forward reads them, and the scheduler frees them only once the load has returned; on CUDA
  the copies go on a side stream; on the CPU they run on `LoadJob.copy_threads` threads, more than one
  only for a load handed over in a step that computes nothing — `transfer.copies`). The step thread
  only polls finished loads; a block is registered in the device prefix cache once its KV is really
  there. An arena whose block writes touch state a forward uses (the quantized formats) gets the
  decoded blocks back, still leased, for the step thread to copy before the next forward
  (`TierIO(write_block=None)`). A load of an offloaded sequence (longer than the device) also
  holds the blocks after its sink blocks in DRAM slots (`LoadJob.host_match`, `HostBlockPool.pin_match`:
  read from below once, stored and pinned there), once its device blocks are all in; the step thread
  takes the slots from the `LoadDone` (or unpins them, for a request that ended meanwhile);
- stores: the step thread copies each full block out of the arena (its slot may be reused next
  step); the mover's save queue does the tier check ("does a tier still hold it?"), the encode
  (checksum) and the manager's put on its own thread, so a waiting request never queues behind
  write-back.
Records crossing the thread carry ids, keys and CPU tensors only. A load that fails (a dead pool,
a bad block) comes back short: the sequence computes the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch

from kvtier.codecs import Codec
from kvtier.tiers.manager import PrefixMatch, TierManager
from kvtier.offload.pool import HostBlockPool, PinnedInHost
from kvtier.transfer import BlockMover, KeptBlocks
from kvtier.transfer.copies import CopyGroup
from kvtier.thread_names import named_thread

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadJob:
    request_id: str
    match: PrefixMatch          # the tier blocks to read, in prefix order
    block_ids: list[int]        # the device blocks they go to (one each)
    copy_threads: int = 1       # threads its copies may use (more only when no forward runs beside it)
    # an offloaded sequence's blocks after its sinks (the same lookup, split): held in DRAM slots once
    # every device block above is in (else only unpinned)
    host_match: PrefixMatch | None = None


@dataclass(slots=True)
class LoadDone:
    request_id: str
    block_ids: list[int]
    tiers: list[str]            # the tier each loaded block came from; fewer than block_ids: bad or gone
    num_written: int = 0        # the first blocks, already in the device blocks (written by the worker)
    blocks: list[torch.Tensor] = field(default_factory=list)  # the rest, decoded [L, 2, H, T, D], to copy
    release: Callable[[], None] = lambda: None  # call once `blocks` are copied: they may view DRAM slots
    host: PinnedInHost = field(default_factory=PinnedInHost)  # the host_match's blocks, pinned in DRAM slots


@dataclass(slots=True)
class TransferStats:
    num_loads: int = 0
    num_blocks_loaded: int = 0
    num_blocks_written: int = 0
    load_seconds: float = 0.0       # on the worker
    store_seconds: float = 0.0      # on the save thread
    errors: int = 0


class _DeviceBlocks:
    """The engine's sink, the one place restored blocks go into the device arena: block i of the load goes
    into device block `block_ids[i]` — on the worker, its copies handed to `copies` (done when the group
    finishes); on the step thread (`copies` None: arenas whose block writes touch what a forward uses),
    written at once."""

    def __init__(self, write_block: Callable[..., None], block_ids: list[int], copies: CopyGroup | None = None
                 ) -> None:
        self.write_block = write_block
        self.block_ids = block_ids
        self.copies = copies

    def write(self, index: int, block: torch.Tensor) -> None:
        if self.copies is None:
            self.write_block(self.block_ids[index], block)
        else:
            self.write_block(self.block_ids[index], block, self.copies)


class TierIO:
    """One load thread (and the mover's save thread) between the engine and the tier manager.
    `write_block(block_id, kv, copies)` puts a decoded block into its device block, its host copies
    handed to the `CopyGroup` (None: loads come back decoded, for the step thread to copy: `write_decoded`).
    `host_pool`: where a load's host part is held (offload on). `synchronous=True` runs every job at
    submission (tests, debugging); results are the same, only when they happen differs."""

    def __init__(self, manager: TierManager, codec: Codec, *,
                 write_block: Callable[[int, torch.Tensor, CopyGroup], None] | None = None,
                 host_pool: HostBlockPool | None = None, synchronous: bool = False) -> None:
        self.manager = manager
        self.host_pool = host_pool
        self.codec = codec
        self.write_block = write_block
        self.mover = BlockMover(manager, codec, synchronous=synchronous)
        self._stream = torch.cuda.Stream() if write_block is not None and torch.cuda.is_available() else None
        self._errors = 0
        self._num_loads = 0  # jobs run (a job's device restore and host hold are one load)
        self._num_host_blocks = 0  # blocks loads held in DRAM slots (`host_pool`), and the time it took
        self._host_seconds = 0.0
        self._loads: deque[LoadJob] = deque()
        self._done: deque[LoadDone] = deque()
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if not synchronous:
            self._thread = named_thread(self._work, "kvtier-transfer")
            self._thread.start()

    @property
    def stats(self) -> TransferStats:
        """A snapshot (the engine's stats and metrics read these names)."""
        m = self.mover.stats
        return TransferStats(self._num_loads, m.num_blocks_restored + self._num_host_blocks, m.num_blocks_saved,
                             m.restore_seconds + self._host_seconds, m.save_seconds, m.errors + self._errors)

    # -- the step thread ---------------------------------------------------------------------------
    def load(self, job: LoadJob) -> None:
        with self._cond:
            self._loads.append(job)
            self._cond.notify_all()
        if self._thread is None:
            self._run_next()

    def store(self, items: list[tuple[bytes, torch.Tensor]], *, skip_held: bool = False,
              chains: list[list[bytes]] = ()) -> None:
        """`chains`: the sequences' chains the blocks extend, refreshed with them (`BlockMover.save`)."""
        if items:
            self.mover.save([key for key, _ in items], [block for _, block in items], skip_held=skip_held,
                            chains=chains)

    def poll(self, timeout_s: float = 0.0) -> list[LoadDone]:
        """Finished loads; waits up to `timeout_s` for the first one when none is ready."""
        with self._cond:
            if not self._done and timeout_s > 0:
                self._cond.wait_for(lambda: bool(self._done), timeout=timeout_s)
            done, self._done = list(self._done), deque()
        return done

    def write_decoded(self, done: LoadDone, write_block: Callable[[int, torch.Tensor], None]) -> int:
        """Step thread, before the next forward: a load's decoded blocks (`TierIO(write_block=None)`) into
        their device blocks through `write_block(block_id, kv)`, in order. Returns the load's blocks now
        in; a write that raises ends it there (logged: the rest is computed)."""
        sink = _DeviceBlocks(write_block, done.block_ids[done.num_written:])
        num_written = done.num_written
        try:
            for index, block in enumerate(done.blocks):
                sink.write(index, block)
                num_written += 1
        except Exception:  # noqa: BLE001 — the rest of its prompt is computed instead
            log.exception("copying a loaded prefix into the device failed")
        return num_written

    def wait(self) -> None:
        """Until every submitted job has run, and the manager's own lower-tier writes have landed."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._loads or self._busy))
        self.mover.wait_saves()
        self.manager.flush()

    def close(self) -> None:
        self.wait()
        if self._thread is not None:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout=10)
            self._thread = None
        self.mover.close()

    # -- the worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loads or self._closed)
                if self._closed and not self._loads:
                    return
            self._run_next()

    def _run_next(self) -> None:
        with self._cond:
            if not self._loads:
                return
            job = self._loads.popleft()
            self._busy += 1
        try:
            if not job.match:  # a host part only: the sink blocks are on the device already
                done = LoadDone(job.request_id, job.block_ids, [])
            else:
                done = self._write_load(job) if self.write_block is not None else self._decode_load(job)
        except Exception:  # noqa: BLE001 - a failed transfer costs a recompute, never the engine
            log.exception("kv transfer failed")
            self._errors += 1
            self.manager.unpin(job.match)  # idempotent: ended already if its stream had started
            done = LoadDone(job.request_id, job.block_ids, [])
        if job.host_match is not None:
            done.host = self._pin_in_host(job.host_match, whole=len(done.tiers) == len(job.block_ids))
        with self._cond:
            self._num_loads += 1
            self._done.append(done)
            self._busy -= 1
            self._cond.notify_all()

    def _write_load(self, job: LoadJob) -> LoadDone:
        """Each block verified (by the stream), decoded and written into its device block in turn (its
        copies on `job.copy_threads` threads, over while the blocks are still leased). Failed copies:
        the load comes back empty (the blocks may be half-written; the sequence computes them)."""
        on_side_stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        threads = job.copy_threads if self._stream is None else 1
        with on_side_stream, CopyGroup(threads) as copies:
            restored = self.mover.restore(job.match, _DeviceBlocks(self.write_block, job.block_ids, copies),
                                          copies=copies)
        if self._stream is not None:
            self._stream.synchronize()  # the KV is on the device before the sequence may run
        return LoadDone(job.request_id, job.block_ids, restored.tiers, num_written=len(restored))

    def _pin_in_host(self, match: PrefixMatch, *, whole: bool) -> PinnedInHost:
        """The host part of a load, when the device part came in whole (the host blocks follow the
        sink blocks: without them they are of no use); its pins end either way."""
        start = time.perf_counter()
        try:
            pinned = self.host_pool.pin_match(match) if whole else PinnedInHost()
            self._num_host_blocks += len(pinned)
            self._host_seconds += time.perf_counter() - start
            return pinned
        except Exception:  # noqa: BLE001 - the sequence computes them
            log.exception("holding a loaded prefix in host memory failed")
            self._errors += 1
            return PinnedInHost()
        finally:
            self.manager.unpin(match)  # idempotent: a stream that ran ended them already

    def _decode_load(self, job: LoadJob) -> LoadDone:
        """The decoded blocks, still leased (DRAM blocks stay in place), for the step thread to copy."""
        kept = KeptBlocks()
        held = ExitStack()
        restored = held.enter_context(self.mover.restoring(job.match, kept))
        return LoadDone(job.request_id, job.block_ids, restored.tiers, blocks=list(kept), release=held.close)
