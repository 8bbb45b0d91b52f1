"""`KVTransfer`: the engine's tier I/O, off the step thread.

The scheduler decides *what* moves (it matches a prompt's blocks in the tiers, allocates device
blocks for the hits and parks the sequence in WAITING_FOR_KV, as vLLM's scheduler does with a KV
connector); this worker does the moving:
- loads: tier -> verify (once, by the manager: the block its key names) -> decode -> the device
  block, on the worker. The manager streams the blocks, each verified just before it is copied, so
  the copy reads it from cache (about one memcpy per block, not a checksum pass and then a copy);
  DRAM blocks are read in place (leased slots), the device blocks are the waiting sequence's own
  (no forward reads them, and the scheduler frees them only once the load has returned), and on
  CUDA the copies go on a side stream. The step thread only polls finished loads; a block is
  registered in the device prefix cache once its KV is really there. An arena whose block writes
  touch state a forward uses (the quantized formats) gets the decoded blocks copied on the step
  thread instead, before the next forward (`KVTransfer(write_block=None)`);
- stores: the step thread copies each full block out of the arena (its slot may be reused next
  step); the tier check ("does a tier still hold it?"), encode (checksum) and the manager's put
  run on the worker. Loads go before stores: a waiting request never queues behind write-back.
Records crossing the thread carry ids, keys and CPU tensors only. A load that fails (a dead pool,
a bad block) comes back short: the sequence computes the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import closing, nullcontext
from dataclasses import dataclass, field

import torch

from kvtier.codecs import Codec
from kvtier.tiers.manager import PrefixMatch, TierManager

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadJob:
    request_id: str
    match: PrefixMatch          # the tier blocks to read, in prefix order
    block_ids: list[int]        # the device blocks they go to (one each)


@dataclass(slots=True)
class LoadDone:
    request_id: str
    block_ids: list[int]
    tiers: list[str]            # the tier each loaded block came from; fewer than block_ids: bad or gone
    num_written: int = 0        # the first blocks, already in the device blocks (written by the worker)
    blocks: list[torch.Tensor] = field(default_factory=list)  # the rest, decoded [L, 2, H, T, D], to copy
    release: Callable[[], None] = lambda: None  # call once `blocks` are copied: they may view DRAM slots


@dataclass(slots=True)
class StoreJob:
    items: list[tuple[bytes, torch.Tensor]]  # (key, block copied out of the arena)
    skip_held: bool                          # first ask the tiers; write only what none holds


@dataclass(slots=True)
class TransferStats:
    num_loads: int = 0
    num_blocks_loaded: int = 0
    num_blocks_written: int = 0
    load_seconds: float = 0.0       # on the worker
    store_seconds: float = 0.0      # on the worker
    errors: int = 0


class KVTransfer:
    """One worker thread between the engine and the tier manager. `write_block(block_id, kv)` puts a
    decoded block into its device block (None: loads come back decoded, for the step thread to copy).
    `synchronous=True` runs every job at submission (tests, debugging); results are the same, only
    when they happen differs."""

    def __init__(self, manager: TierManager, codec: Codec, *,
                 write_block: Callable[[int, torch.Tensor], None] | None = None, synchronous: bool = False) -> None:
        self.manager = manager
        self.codec = codec
        self.write_block = write_block
        self._stream = torch.cuda.Stream() if write_block is not None and torch.cuda.is_available() else None
        self.stats = TransferStats()
        self._loads: deque[LoadJob] = deque()
        self._stores: deque[StoreJob] = deque()
        self._done: deque[LoadDone] = deque()
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if not synchronous:
            self._thread = threading.Thread(target=self._work, name="kvtier-transfer", daemon=True)
            self._thread.start()

    # -- the step thread ---------------------------------------------------------------------------
    def load(self, job: LoadJob) -> None:
        self._submit(self._loads, job)

    def store(self, items: list[tuple[bytes, torch.Tensor]], *, skip_held: bool = False) -> None:
        if items:
            self._submit(self._stores, StoreJob(items, skip_held))

    def poll(self, timeout_s: float = 0.0) -> list[LoadDone]:
        """Finished loads; waits up to `timeout_s` for the first one when none is ready."""
        with self._cond:
            if not self._done and timeout_s > 0:
                self._cond.wait_for(lambda: bool(self._done), timeout=timeout_s)
            done, self._done = list(self._done), deque()
        return done

    def wait(self) -> None:
        """Until every submitted job has run, and the manager's own lower-tier writes have landed."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._loads or self._stores or self._busy))
        self.manager.flush()

    def close(self) -> None:
        if self._thread is not None:
            self.wait()
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout=10)
            self._thread = None

    def _submit(self, queue: deque, job) -> None:
        with self._cond:
            queue.append(job)
            self._cond.notify_all()
        if self._thread is None:
            self._run_next()

    # -- the worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loads or self._stores or self._closed)
                if self._closed and not (self._loads or self._stores):
                    return
            self._run_next()

    def _run_next(self) -> None:
        with self._cond:
            queue = self._loads if self._loads else self._stores
            if not queue:
                return
            job = queue.popleft()
            self._busy += 1
        done = None
        try:
            if isinstance(job, LoadJob):
                done = self._run_load(job)
            else:
                self._run_store(job)
        except Exception:  # noqa: BLE001 - a failed transfer costs a recompute, never the engine
            log.exception("kv transfer failed")
            self.stats.errors += 1
            if isinstance(job, LoadJob):
                done = LoadDone(job.request_id, job.block_ids, [])
        finally:
            with self._cond:
                if done is not None:
                    self._done.append(done)
                self._busy -= 1
                self._cond.notify_all()

    def _run_load(self, job: LoadJob) -> LoadDone:
        start = time.perf_counter()
        done = self._write_load(job) if self.write_block is not None else self._decode_load(job)
        self.stats.num_loads += 1
        self.stats.num_blocks_loaded += len(done.tiers)
        self.stats.load_seconds += time.perf_counter() - start
        return done

    def _write_load(self, job: LoadJob) -> LoadDone:
        """Each block verified (by the stream), decoded and written into its device block in turn."""
        tiers: list[str] = []
        on_side_stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        try:
            with closing(self.manager.stream(job.match)) as blocks, on_side_stream:
                for block, block_id in zip(blocks, job.block_ids):
                    self.write_block(block_id, self.codec.decode_verified(block.header, block.payload))
                    tiers.append(block.tier)
        except Exception:  # noqa: BLE001 - the blocks written so far stand; the rest is computed
            log.exception("loading a prefix into the device failed after %d blocks", len(tiers))
            self.stats.errors += 1
        if self._stream is not None:
            self._stream.synchronize()  # the KV is on the device before the sequence may run
        return LoadDone(job.request_id, job.block_ids, tiers, num_written=len(tiers))

    def _decode_load(self, job: LoadJob) -> LoadDone:
        prefix = self.manager.read(job.match, lease=True)  # DRAM blocks stay in place until copied
        try:
            blocks = [self.codec.decode_verified(hdr, buf) for hdr, buf in zip(prefix.headers, prefix.payloads)]
        except Exception:
            prefix.release()
            raise
        return LoadDone(job.request_id, job.block_ids, prefix.tiers, blocks=blocks, release=prefix.release)

    def _run_store(self, job: StoreJob) -> None:
        start = time.perf_counter()
        items = job.items
        if job.skip_held:
            held = self.manager.contains_many([key for key, _ in items])
            items = [item for item, is_held in zip(items, held) if not is_held]
        if items:
            self.manager.put_many([(key, self.codec.encode(block, key)) for key, block in items])
            self.stats.num_blocks_written += len(items)
        self.stats.store_seconds += time.perf_counter() - start
