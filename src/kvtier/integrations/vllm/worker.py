"""Worker side: copies blocks between vLLM's paged KV cache and the tier stack.

Loads run on one thread, in one of two modes:
- async: while the engine keeps stepping (the request waits in vLLM's WAITING_FOR_REMOTE_KVS state, so
  nothing reads its blocks until the load is reported finished);
- layerwise: with the step that first runs the request; the thread reads and verifies every block,
  then writes layer after layer, and the forward waits for each layer just before its attention.
Every block is verified and decoded before any of its KV is written; a missing, corrupt or foreign block
ends the load there and its block ids (and those after it) are reported back, so vLLM recomputes
them (a layerwise load's request then saves nothing this step: its new blocks attended to the holes).
Saves copy the step's newly full blocks out layer by layer as the forward leaves each layer (the blocks
may be freed after the step), into one buffer the step end hands to another thread, which encodes and
writes them; a full queue drops the save (a future miss) rather than stall a step. No tier error ever
reaches vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import Codec, CorruptBlockError, Header
from kvtier.integrations.vllm.cuda_mover import BlockMover
from kvtier.integrations.vllm.layouts import block_view
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.tiers.manager import TierManager

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: printed with its own lines


@dataclass(slots=True)
class _StepSave:
    """This step's blocks to save, copied out one layer at a time as the forward leaves each layer."""

    specs: list[SaveSpec]
    index: torch.Tensor        # their device block ids, the specs' in order
    kv: torch.Tensor           # [L, n, 2, H, T, D] (MLA: [L, n, 1, 1, T, D]): one contiguous slab per layer
    layers_done: list[bool]


@dataclass(slots=True)
class _LayerwiseLoad:
    """This step's loads: `ready[l]` is set once layer l of every verified block is in the cache."""

    ready: list[threading.Event]
    future: Future | None = None


class WorkerSide:
    def __init__(self, layout: KVLayout, codec: Codec, manager: TierManager, *, max_pending_saves: int) -> None:
        self.layout = layout
        self.codec = codec
        self.manager = manager
        self._views: list[torch.Tensor] = []  # per layer: [num_blocks, 2, H, T, D] (layouts.block_view)
        self._layer_of: dict[str, int] = {}   # vLLM layer name -> index into _views
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._lock = threading.Lock()
        self._done_loads: list[tuple[str, list[int]]] = []  # (req_id, block ids that failed)
        self._loaded_tiers: dict[str, list[str]] = {}      # req_id -> the tier each loaded block came from
        self._invalid_block_ids: set[int] = set()
        self._failed_req_ids: set[str] = set()   # layerwise loads that failed this step: save nothing of them
        self._stats: Counter = Counter()
        self._step_save: _StepSave | None = None
        self._layerwise: _LayerwiseLoad | None = None
        self._saves: queue.Queue = queue.Queue(max_pending_saves)
        self._saver = threading.Thread(target=self._drain_saves, name="kvtier-save", daemon=True)
        self._saver.start()

    def register(self, kv_caches: dict[str, torch.Tensor], layer_index, page: str = "planes") -> None:
        """`layer_index(name) -> int` orders vLLM's layer names; `page` is their format (`layouts`)."""
        names = sorted(kv_caches, key=layer_index)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"{len(names)} KV cache layers registered, the model has {self.layout.num_layers}")
        self._views = [block_view(kv_caches[name], page, self.layout) for name in names]
        self._mover = BlockMover(self._views[0].device, len(names))  # CUDA: side stream, pinned buffers
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
        blocks, tiers, release = self._read_verified(spec)
        try:
            if blocks:
                index = torch.tensor(spec.block_ids[:len(blocks)], dtype=torch.long)
                for layer in range(len(self._views)):
                    self._write_layer(blocks, index, layer)
        except Exception:  # noqa: BLE001 - a load never fails a request: what did not load is recomputed
            log.exception("kvtier: writing %d blocks for %s failed; recomputing", len(blocks), spec.req_id)
            blocks = []
        finally:
            release()
        failed = self._account(spec, tiers[:len(blocks)], time.perf_counter() - start)
        with self._lock:
            self._done_loads.append((spec.req_id, failed))

    def _read_verified(self, spec: LoadSpec) -> tuple[list[torch.Tensor], list[str], Callable[[], None]]:
        """The blocks of `spec` up to the first one missing or not proven to be the one its key names,
        each [L, 2, H, T, D], the tier each came from, and `release`: the blocks are leased (views of a
        DRAM slot, a pooled SSD or Mooncake buffer: no copy on the way in) until it is called, once
        they are written into the cache."""
        prefix = None
        try:
            # One batched contains + get per tier; each block proven to be the one its key names.
            prefix = self.manager.read(self.manager.match(spec.keys), lease=True)
            blocks = []
            for key, hdr, data in zip(spec.keys, prefix.headers, prefix.payloads):
                kv = self._decode(key, hdr, data)
                if kv is None:
                    break
                blocks.append(kv)
            return blocks, prefix.tiers[:len(blocks)], prefix.release
        except Exception:  # noqa: BLE001 - a load never fails a request: what did not load is recomputed
            log.exception("kvtier: load of %d blocks for %s failed; recomputing", len(spec.keys), spec.req_id)
            if prefix is not None:
                prefix.release()
            return [], [], lambda: None

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

    def _decode(self, key: bytes, hdr: Header, data: bytes) -> torch.Tensor | None:
        try:
            kv = self.codec.decode_verified(hdr, data)
        except CorruptBlockError as exc:
            log.warning("kvtier: block %s rejected (%s); recomputing from it", key.hex()[:12], exc)
            return None
        if tuple(kv.shape) != self.layout.block_shape or kv.dtype != self._views[0].dtype:
            log.warning("kvtier: block %s has shape %s %s, expected %s; recomputing from it", key.hex()[:12],
                        tuple(kv.shape), kv.dtype, self.layout.block_shape)
            return None
        return kv

    def _write_layer(self, blocks: list[torch.Tensor], index: torch.Tensor, layer: int) -> None:
        # blocks: n x [L, 2, H, T, D], every one already verified; one layer gathered, then one index_put
        self._mover.copy_in(self._views[layer], index, [block[layer] for block in blocks], layer)

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
        read = [self._read_verified(spec) for spec in loads]  # every block verified before any is written
        kv = [block for blocks, _, _ in read for block in blocks]
        index = torch.tensor([b for spec, (blocks, _, _) in zip(loads, read) for b in spec.block_ids[:len(blocks)]],
                             dtype=torch.long)
        try:
            for layer, ready in enumerate(state.ready):  # layer 0 is ready after 1/L of the copy
                if kv:
                    self._write_layer(kv, index, layer)
                ready.set()
        except Exception:  # noqa: BLE001 - recomputed, as any failed load
            log.exception("kvtier: layerwise load of %d blocks failed; recomputing", len(kv))
            read = [([], [], release) for _, _, release in read]
        finally:
            for ready in state.ready:
                ready.set()  # never leave the forward waiting
            for _, _, release in read:
                release()
        seconds = time.perf_counter() - start
        for spec, (blocks, tiers, _) in zip(loads, read):
            failed = self._account(spec, tiers, seconds / len(loads))
            if failed:
                with self._lock:
                    self._invalid_block_ids.update(failed)
                    self._failed_req_ids.add(spec.req_id)

    def wait_layer(self, layer_name: str) -> None:
        state, layer = self._layerwise, self._layer_of.get(layer_name)
        if state is not None and layer is not None:
            state.ready[layer].wait()
            self._mover.wait_layer(layer)

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

    # -- saves -----------------------------------------------------------------------------------
    def begin_step(self, saves: list[SaveSpec]) -> None:
        """The step's metadata arrived: make room for the blocks it saves (filled by `save_layer`)."""
        self._step_save = None
        block_ids = [b for spec in saves for b in spec.block_ids]
        if not block_ids or not self._views:
            return
        view = self._views[0]
        kv = self._mover.host_slab((len(self._views), len(block_ids), *view.shape[1:]), view.dtype)
        self._step_save = _StepSave(saves, torch.tensor(block_ids, dtype=torch.long), kv,
                                    [False] * len(self._views))

    def save_layer(self, layer_name: str) -> None:
        """The forward is done with this layer: copy its slots of the step's saved blocks out now."""
        step, layer = self._step_save, self._layer_of.get(layer_name)
        if step is not None and layer is not None and not step.layers_done[layer]:
            self._copy_out(step, layer)

    def _copy_out(self, step: _StepSave, layer: int) -> None:
        start = time.perf_counter()
        self._mover.copy_out(self._views[layer], step.index, step.kv[layer], layer)
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
        self._mover.finish_saves()
        keys, positions, offset = [], [], 0
        for spec in step.specs:
            if spec.req_id not in failed_req_ids:
                keys += spec.keys
                positions += range(offset, offset + len(spec.keys))
            offset += len(spec.keys)
        if not keys:
            return
        kv = step.kv if len(positions) == offset else step.kv[:, positions]
        try:
            self._saves.put_nowait((keys, kv))
        except queue.Full:
            with self._lock:
                self._stats["dropped_blocks"] += len(keys)

    def _drain_saves(self) -> None:
        while (item := self._saves.get()) is not None:
            keys, kv = item  # kv: [L, n, 2, H, T, D]
            start = time.perf_counter()
            try:
                self.manager.put_many([(key, self.codec.encode(kv[:, i], key)) for i, key in enumerate(keys)])
                with self._lock:
                    self._stats["saved_blocks"] += len(keys)
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
                log.exception("kvtier: saving %d blocks failed", len(keys))
                with self._lock:
                    self._stats["dropped_blocks"] += len(keys)
            finally:
                with self._lock:
                    self._stats["save_write_seconds"] += time.perf_counter() - start
                self._saves.task_done()

    def wait_saves(self) -> None:
        self._saves.join()

    # -- stats and shutdown ----------------------------------------------------------------------
    def take_stats(self) -> dict[str, int | float]:
        with self._lock:
            stats, self._stats = dict(self._stats), Counter()
        return stats

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._saves.put(None)
        self._saver.join(timeout=30)
