"""Worker side: copies blocks between vLLM's paged KV cache and the tier stack.

Loads run on one thread while the engine keeps stepping (the request waits in vLLM's
WAITING_FOR_REMOTE_KVS state, so nothing reads its blocks until the load is reported finished).
Every block is verified and decoded before its KV is written; a missing, corrupt or foreign block
ends the load there and its block ids (and those after it) are reported back, so vLLM recomputes
them. Saves copy the step's newly full blocks out of the cache at once (the blocks may be freed
after the step) and encode + write them on another thread; a full queue drops the save (a future
miss) rather than stall a step. No tier error ever reaches vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import Codec, CorruptBlockError, Header
from kvtier.integrations.vllm.plan import LoadSpec, SaveSpec
from kvtier.tiers.manager import TierManager

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: printed with its own lines


def block_view(kv_cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A view [num_blocks, 2, H, T, D] of one layer of vLLM's CPU cache.

    The CPU attention backend holds a layer as [num_blocks, H, T, 2 * D] and reads it as
    [num_blocks, H, 2 * T, D]: per block and head, T key rows then T value rows."""
    num_blocks, num_heads, block_tokens, width = kv_cache.shape
    if (num_heads, block_tokens, width) != (layout.num_kv_heads, layout.block_tokens, 2 * layout.head_dim):
        raise ValueError(f"KV cache layer shape {tuple(kv_cache.shape)} is not the CPU backend's "
                         f"[blocks, {layout.num_kv_heads}, {layout.block_tokens}, {2 * layout.head_dim}]")
    view = kv_cache.view(num_blocks, num_heads, 2, block_tokens, layout.head_dim)
    return view.transpose(1, 2)


class WorkerSide:
    def __init__(self, layout: KVLayout, codec: Codec, manager: TierManager, *, max_pending_saves: int) -> None:
        self.layout = layout
        self.codec = codec
        self.manager = manager
        self._views: list[torch.Tensor] = []  # per layer: [num_blocks, 2, H, T, D]
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._lock = threading.Lock()
        self._done_loads: list[tuple[str, list[int]]] = []  # (req_id, block ids that failed)
        self._loaded_tiers: dict[str, list[str]] = {}      # req_id -> the tier each loaded block came from
        self._invalid_block_ids: set[int] = set()
        self._stats: Counter = Counter()
        self._saves: queue.Queue = queue.Queue(max_pending_saves)
        self._saver = threading.Thread(target=self._drain_saves, name="kvtier-save", daemon=True)
        self._saver.start()

    def register(self, kv_caches: dict[str, torch.Tensor], layer_index) -> None:
        """`layer_index(name) -> int` orders vLLM's layer names."""
        names = sorted(kv_caches, key=layer_index)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"{len(names)} KV cache layers registered, the model has {self.layout.num_layers}")
        self._views = [block_view(kv_caches[name], self.layout) for name in names]
        dtype = str(self._views[0].dtype).removeprefix("torch.")
        if dtype != self.layout.dtype:
            raise ValueError(f"KV cache dtype {dtype} is not the model's {self.layout.dtype}")

    # -- loads -----------------------------------------------------------------------------------
    def start_loads(self, loads: list[LoadSpec]) -> None:
        for spec in loads:
            self._loader.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        num_ok, tiers = 0, []
        try:
            # One batched contains + get per tier; each block proven to be the one its key names.
            prefix = self.manager.read(self.manager.match(spec.keys))
            tiers = prefix.tiers
            blocks = []
            for key, hdr, data in zip(spec.keys, prefix.headers, prefix.payloads):
                kv = self._decode(key, hdr, data)
                if kv is None:
                    break
                blocks.append(kv)
            num_ok = len(blocks)
            if blocks:
                self._write(torch.stack(blocks), spec.block_ids[:num_ok])
        except Exception:  # noqa: BLE001 - a load never fails a request: what did not load is recomputed
            log.exception("kvtier: load of %d blocks for %s failed; recomputing", len(spec.keys), spec.req_id)
            num_ok = 0
        failed = spec.block_ids[num_ok:]
        with self._lock:
            self._done_loads.append((spec.req_id, failed))
            self._loaded_tiers[spec.req_id] = tiers[:num_ok]
            for tier in tiers[:num_ok]:
                self._stats[f"hit_tokens_{tier}"] += self.layout.block_tokens
            self._stats["loaded_blocks"] += num_ok
            self._stats["failed_blocks"] += len(failed)

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

    def _write(self, kv: torch.Tensor, block_ids: list[int]) -> None:
        # kv: [n, L, 2, H, T, D]
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer, view in enumerate(self._views):
            view[index] = kv[:, layer]

    def take_finished_loads(self) -> set[str]:
        """Requests whose load ended (fully or not); their failed block ids move to the error set."""
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
    def save(self, saves: list[SaveSpec]) -> None:
        """Copy the blocks out now (vLLM may free them after this step); encode and write later."""
        keys = [key for spec in saves for key in spec.keys]
        if not keys or not self._views:
            return
        index = torch.tensor([b for spec in saves for b in spec.block_ids], dtype=torch.long)
        kv = torch.stack([view.index_select(0, index) for view in self._views], dim=1)  # [n, L, 2, H, T, D]
        try:
            self._saves.put_nowait((keys, kv))
        except queue.Full:
            with self._lock:
                self._stats["dropped_blocks"] += len(keys)

    def _drain_saves(self) -> None:
        while (item := self._saves.get()) is not None:
            keys, kv = item
            try:
                self.manager.put_many([(key, self.codec.encode(kv[i], key)) for i, key in enumerate(keys)])
                with self._lock:
                    self._stats["saved_blocks"] += len(keys)
            except Exception:  # noqa: BLE001 - a failed save is a future miss, never a failed request
                log.exception("kvtier: saving %d blocks failed", len(keys))
                with self._lock:
                    self._stats["dropped_blocks"] += len(keys)
            finally:
                self._saves.task_done()

    def wait_saves(self) -> None:
        self._saves.join()

    # -- stats and shutdown ----------------------------------------------------------------------
    def take_stats(self) -> dict[str, int]:
        with self._lock:
            stats, self._stats = dict(self._stats), Counter()
        return stats

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._saves.put(None)
        self._saver.join(timeout=30)
