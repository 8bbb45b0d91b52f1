"""Worker side: copies blocks between vLLM's paged KV cache and the tier stack.

Blocks move through `kvtier.transfer.BlockMover`, as in the engine: this side supplies only the
destination writes into vLLM's paged cache. A load reads where the scheduler's lookup found each block
(`LoadSpec.tiers`, `TierManager.locate`: no second lookup; the worker's own DRAM, which the scheduler
cannot see, is asked first, in memory; a miss falls through to the next tier), each block verified
just before it is written, the next blocks read ahead meanwhile. Loads run on one thread, in one of
two modes:
- async: while the engine keeps stepping (the request waits in vLLM's WAITING_FOR_REMOTE_KVS state, so
  nothing reads its blocks until the load is reported finished); each block is written (all layers)
  as soon as it is verified;
- layerwise: with the step that first runs the request; the thread streams the step's loads layer by
  layer (`transfer.layers`: from the SSD or `shm:`, each file's header, layer table and layer 0 read
  first, the other layers in pieces behind), writes layer l of every block once each of its slices is
  proven against its own checksum, and the forward waits for each layer just before its attention.
No KV is written before it is verified and decoded (a layered block: that layer's slice; any other:
the whole block); a missing, corrupt or foreign block ends the load there and its block ids (and those
after it) are reported back, so vLLM recomputes them (a layerwise load's request then saves nothing
this step: its new blocks attended to the holes — or, for a block found bad at layer k, to its
proven layers 0..k-1 and holes after).
Saves copy the step's newly full blocks out layer by layer as the forward leaves each layer (the blocks
may be freed after the step), into one buffer the step end hands to the mover's save queue, which
encodes and writes them; a full queue drops the save (a future miss) rather than stall a step. A save
refreshes the chain it extends (`SaveSpec.held_keys`, then its new blocks) tail first in the worker's DRAM,
without rewriting what it holds: a turn's new blocks never outrank their root. No tier error ever reaches vLLM.
The worker's SSD and `shm:` tiers are plain file stores (`DiskStore`): the scheduler owns their index and
eviction, and the files it evicted reach the worker in the step's metadata (`delete`), removed on the
writes lane between the last step's saves and this one's, off the forward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import Codec
from kvtier.integrations.vllm.cpus import run_torch_here
from kvtier.integrations.vllm.device_copies import DeviceCopies
from kvtier.integrations.vllm.layouts import block_view
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.manager import TierManager
from kvtier.transfer import BlockMover, MoverStats
from kvtier.transfer.layers import restoring_layers

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: printed with its own lines


@dataclass(slots=True)
class _StepSave:
    """This step's blocks to save, copied out one layer at a time as the forward leaves each layer."""

    specs: list[SaveSpec]
    index: torch.Tensor        # their device block ids, the specs' in order
    kv: torch.Tensor           # [L, n, 2, H, T, D] (MLA: [L, n, 1, 1, T, D]): one contiguous slab per layer
    layers_done: list[bool]


@dataclass(slots=True)
class _BlockWrites:
    """Async loads' sink: each verified block written into its device block, every layer, at once."""

    views: list[torch.Tensor]
    copies: DeviceCopies
    block_ids: list[int]

    def write(self, index: int, block: torch.Tensor) -> None:
        self.copies.copy_block_in(self.views, self.block_ids[index], block)  # block: [L, 2, H, T, D]


@dataclass(slots=True)
class _LayerwiseLoad:
    """This step's loads: `ready[l]` is set once layer l of every verified block is in the cache."""

    ready: list[threading.Event]
    future: Future | None = None


class WorkerSide:
    def __init__(self, layout: KVLayout, codec: Codec, manager: TierManager, *,
                 transfer_cpus: set[int] | None = None, stores: dict[str, DiskStore] | None = None) -> None:
        """`transfer_cpus`: where the load and save threads run their copies (`cpus.py`; None: anywhere).
        Saves queue on the process's writes lane (the manager's `max_pending_writes` bounds its share).
        `stores`: the directories among the manager's tiers, by tier name, that delete what the scheduler evicts."""
        self.layout = layout
        self.codec = codec
        self.manager = manager
        self._stores = stores or {}
        on_thread_start = partial(run_torch_here, transfer_cpus)
        self.mover = BlockMover(manager, codec, layout=layout, on_thread_start=on_thread_start)
        self._saves_seen = MoverStats()  # the mover's save counters already reported by take_stats
        self._views: list[torch.Tensor] = []  # per layer: [num_blocks, 2, H, T, D]
        self._layer_of: dict[str, int] = {}   # vLLM layer name -> index into _views
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load", initializer=on_thread_start)
        self._lock = threading.Lock()
        self._done_loads: list[tuple[str, list[int]]] = []  # (req_id, block ids that failed)
        self._loaded_tiers: dict[str, list[str]] = {}      # req_id -> the tier each loaded block came from
        self._invalid_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()   # layerwise loads that failed this step: save nothing of them
        self._stats: Counter = Counter()
        self._step_save: _StepSave | None = None
        self._layerwise: _LayerwiseLoad | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], layer_index, page: str = "planes") -> None:
        """`layer_index(name) -> int` orders vLLM's layer names; `page` is their format (`layouts`)."""
        names = sorted(kv_caches, key=layer_index)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"{len(names)} KV cache layers registered, the model has {self.layout.num_layers}")
        self._views = [block_view(kv_caches[name], page, self.layout) for name in names]
        self._copies = DeviceCopies(self._views[0].device, len(names))  # CUDA: side stream, pinned buffers
        self._layer_of = {name: i for i, name in enumerate(names)}
        dtype = str(self._views[0].dtype).removeprefix("torch.")
        if dtype != self.layout.dtype:
            raise ValueError(f"KV cache dtype {dtype} is not the model's {self.layout.dtype}")

    # -- loads -----------------------------------------------------------------------------------
    def start_loads(self, loads: list[LoadSpec]) -> None:
        """Async mode: each request's whole load on the thread; reported by `take_finished_loads`."""
        for spec in loads:
            self._loader.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        start = time.perf_counter()
        tiers: list[str] = []
        try:
            tiers = self.mover.restore(self._located(spec), _BlockWrites(self._views, self._copies, spec.block_ids)).tiers
        except Exception:  # noqa: BLE001 - a load never fails a request: what did not load is recomputed
            log.exception("kvtier: load of %d blocks for %s failed; recomputing", len(spec.keys), spec.req_id)
        failed = self._account(spec, tiers, time.perf_counter() - start)
        with self._lock:
            self._done_loads.append((spec.req_id, failed))

    def _located(self, spec: LoadSpec):
        """Where the scheduler's lookup found the blocks (this worker's DRAM asked first): no re-match."""
        return self.manager.locate(spec.keys, spec.tiers)

    def _account(self, spec: LoadSpec, tiers: list[str], seconds: float) -> list[int]:
        """Count a finished load (`tiers`: one per loaded block); the block ids that did not load."""
        failed = spec.block_ids[len(tiers):]
        with self._lock:
            self._loaded_tiers[spec.req_id] = tiers
            for tier in tiers:
                self._stats[f"hit_tokens_{tier}"] += self.layout.block_tokens
            self._stats["loaded_blocks"] += len(tiers)
            self._stats["failed_blocks"] += len(failed)
            self._stats["load_seconds"] += seconds
        return failed

    def start_layerwise(self, loads: list[LoadSpec]) -> None:
        """Layerwise mode: this step's loads start now; `wait_layer` holds each layer's attention until
        that layer is in the cache; `finish_layerwise` (step end) reports what failed."""
        if not loads:
            return
        state = _LayerwiseLoad([threading.Event() for _ in self._views])
        state.future = self._loader.submit(self._load_layers, loads, state)
        self._layerwise = state

    def _load_layers(self, loads: list[LoadSpec], state: _LayerwiseLoad) -> None:
        start = time.perf_counter()
        tiers: list[list[str]] = [[] for _ in loads]
        try:
            matches = [self._located(spec) for spec in loads]
            with restoring_layers(self.manager, self.codec, self.layout, matches) as restore:
                for step in restore:  # layer l of each load's prefix, every slice proven
                    self._write_layer(loads, step)
                    state.ready[step.layer].set()
                tiers = [restored.tiers for restored in restore.restored]
        except Exception:  # noqa: BLE001 - recomputed, as any failed load
            log.exception("kvtier: layerwise load of %d blocks failed; recomputing", sum(len(s.keys) for s in loads))
            tiers = [[] for _ in loads]
        finally:
            for ready in state.ready:
                ready.set()  # never leave the forward waiting
        seconds = time.perf_counter() - start
        for spec, spec_tiers in zip(loads, tiers):
            failed = self._account(spec, spec_tiers, seconds / len(loads))
            if failed:
                with self._lock:
                    self._invalid_block_ids.update(failed)
                    self._failed_req_ids.add(spec.req_id)

    def _write_layer(self, loads: list[LoadSpec], step) -> None:
        """Layer `step.layer` of every load's prefix into its device blocks: one index_put (CUDA: side stream)."""
        block_ids = [spec.block_ids[j] for spec, blocks in zip(loads, step.blocks) for j in range(len(blocks))]
        if block_ids:
            index = torch.tensor(block_ids, dtype=torch.long)
            self._copies.copy_in(self._views[step.layer], index, [kv for blocks in step.blocks for kv in blocks],
                                 step.layer)

    def wait_layer(self, layer_name: str) -> None:
        state, layer = self._layerwise, self._layer_of.get(layer_name)
        if state is not None and layer is not None:
            state.ready[layer].wait()
            self._copies.wait_layer(layer)

    def finish_layerwise(self) -> None:
        """Step end: the step's layerwise loads are over (the forward may have skipped some layers)."""
        state, self._layerwise = self._layerwise, None
        if state is None or state.future is None:
            return
        try:
            state.future.result()
        except Exception:  # noqa: BLE001 - bookkeeping only: the copies and the error report are done
            log.exception("kvtier: layerwise load bookkeeping failed")

    def take_finished_loads(self) -> set[str]:
        """Requests whose async load ended (fully or not); their failed block ids move to the error set."""
        with self._lock:
            done, self._done_loads = self._done_loads, []
            for _, failed in done:
                self._invalid_block_ids.update(failed)
        return {req_id for req_id, _ in done}

    def take_loaded_tiers(self) -> dict[str, list[str]]:
        """Per finished load, where each block really came from (the scheduler only saw its lookup)."""
        with self._lock:
            tiers, self._loaded_tiers = self._loaded_tiers, {}
        return tiers

    def take_invalid_block_ids(self) -> set[int]:
        with self._lock:
            invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # -- the scheduler's evictions ----------------------------------------------------------------
    def delete(self, deletes: dict[str, list[bytes]]) -> None:
        """Remove the files the scheduler's index evicted (tier name -> keys), called with the step's metadata
        (before the step's saves are queued): on the process's writes lane (`DiskStore.delete_behind_writes`),
        behind every write queued up to the last step (a late save of an evicted key lands, then goes) and
        ahead of this step's (a key admitted again is written after its old file's delete: it stays); never
        dropped, off the forward. Never a file a load reads (the scheduler pinned those: a pinned file stays),
        nor one another process pinned. Without a writes thread (saves written in the step) it runs here, now."""
        for name, keys in deletes.items():
            store = self._stores.get(name)
            if store is None or not keys:
                continue
            if not self.manager.has_writer_thread:
                self._deleted(name, keys, lambda: store.delete_many(keys))
                continue
            future = store.delete_behind_writes(keys)
            future.add_done_callback(lambda done, name=name, keys=keys: self._deleted(name, keys, done.result))

    def _deleted(self, name: str, keys: list[bytes], result) -> None:
        try:
            num_deleted = result()
        except Exception:  # noqa: BLE001 - a file left behind is space, never a wrong block
            log.exception("kvtier: deleting %d evicted blocks from %s failed", len(keys), name)
            return
        with self._lock:
            self._stats["deleted_blocks"] += num_deleted

    # -- saves -----------------------------------------------------------------------------------
    def begin_step(self, saves: list[SaveSpec]) -> None:
        """The step's metadata arrived: make room for the blocks it saves (filled by `save_layer`)."""
        self._step_save = None
        block_ids = [b for spec in saves for b in spec.block_ids]
        if not block_ids or not self._views:
            return
        view = self._views[0]
        kv = self._copies.host_slab((len(self._views), len(block_ids), *view.shape[1:]), view.dtype)
        self._step_save = _StepSave(saves, torch.tensor(block_ids, dtype=torch.long), kv,
                                    [False] * len(self._views))

    def save_layer(self, layer_name: str) -> None:
        """The forward is done with this layer: copy its slots of the step's saved blocks out now."""
        step, layer = self._step_save, self._layer_of.get(layer_name)
        if step is not None and layer is not None and not step.layers_done[layer]:
            self._copy_out(step, layer)

    def _copy_out(self, step: _StepSave, layer: int) -> None:
        start = time.perf_counter()
        self._copies.copy_out(self._views[layer], step.index, step.kv[layer], layer)
        step.layers_done[layer] = True
        with self._lock:
            self._stats["save_copy_seconds"] += time.perf_counter() - start

    def finish_save(self) -> None:
        """Step end: copy any layer the forward did not pass (none in a normal step), drop the blocks of
        requests whose layerwise load failed, and hand the rest to the writer thread."""
        step, self._step_save = self._step_save, None
        with self._lock:
            failed_req_ids, self._failed_req_ids = self._failed_req_ids, set()
        if step is None:
            return
        for layer, done in enumerate(step.layers_done):
            if not done:
                self._copy_out(step, layer)
        self._copies.finish_saves()
        keys, positions, chains, offset = [], [], [], 0
        for spec in step.specs:
            if spec.req_id not in failed_req_ids:
                keys += spec.keys
                positions += range(offset, offset + len(spec.keys))
                chains.append(spec.held_keys + spec.keys)  # the chain the save extends: refreshed with it
            offset += len(spec.keys)
        if not keys:
            return
        # step.kv: [L, n, 2, H, T, D]; each saved block a view [L, 2, H, T, D] of it (the save owns it)
        self.mover.save(keys, [step.kv[:, i] for i in positions], chains=chains)

    def wait_saves(self) -> None:
        self.mover.wait_saves()

    # -- stats and shutdown ----------------------------------------------------------------------
    def take_stats(self) -> dict[str, int | float]:
        saves = self.mover.stats
        seen, self._saves_seen = self._saves_seen, MoverStats(num_blocks_saved=saves.num_blocks_saved,
                                                              num_blocks_dropped=saves.num_blocks_dropped,
                                                              save_seconds=saves.save_seconds)
        with self._lock:
            stats, self._stats = self._stats, Counter()
        stats["saved_blocks"] += saves.num_blocks_saved - seen.num_blocks_saved
        stats["dropped_blocks"] += saves.num_blocks_dropped - seen.num_blocks_dropped
        stats["save_write_seconds"] += saves.save_seconds - seen.save_seconds
        return {name: value for name, value in stats.items() if value}

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self.mover.close()
