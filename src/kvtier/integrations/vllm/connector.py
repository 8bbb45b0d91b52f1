"""`KvtierConnector`: vLLM v1's KV connector API (`KVConnectorBase_V1`) on kvtier's tier stack.

vLLM makes one instance per role: the scheduler's (`SchedulerSide`: lookups, load and save plans)
and the worker's (`WorkerSide`: the copies, through the whole stack). They live in different
processes (vLLM's CPU platform always runs its worker in a process of its own), so the scheduler
looks up the tiers both processes see — SSD and pools; blocks are written through to them — and
the worker reads each block from the highest tier holding it (its DRAM first).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.codecs import get_codec
from kvtier.integrations.vllm.config import ConnectorConfig, check_supported, key_space
from kvtier.integrations.vllm.cpus import threads_started_off_forward
from kvtier.integrations.vllm.kv_events import SchedulerEvents, WorkerEvents
from kvtier.integrations.vllm.layouts import engine_page, page_format
from kvtier.integrations.vllm.metrics import KvtierConnectorStats, KvtierPromMetrics
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec, for_rank
from kvtier.integrations.vllm.scheduler import SchedulerSide, deletes_for_rank
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers import make_tier
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.manager import TierManager, build_manager

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: printed with its own lines

# vLLM's own names for where cached tokens came from (`vllm:prompt_tokens_cached_by_source`).
# A pool's blocks were written by other servers and fetched over the network: "p2p" is the nearest.
_HIT_SOURCE = {"dram": CacheHitSource.HOST, "shm": CacheHitSource.HOST, "ssd": CacheHitSource.DISK,
               "mooncake": CacheHitSource.P2P, "redis": CacheHitSource.P2P}


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: ids and keys only."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # the scheduler owns the shared directories' index: the files it evicted (tier name -> keys, every
    # rank's), for the workers to delete (each rank its own shards', behind its own queued writes), and whose
    # shard each is (tier name -> ranks; none: one worker)
    deletes: dict[str, list[bytes]] = field(default_factory=dict)
    delete_ranks: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the tier each block of a finished load came from."""

    loaded_tiers: dict[str, list[str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata({**self.loaded_tiers, **other.loaded_tiers})


def _scheduler_hook(method):
    """A scheduler-side hook, timed: vLLM calls it on the engine core's thread, between (or, scheduling
    asynchronously, beside) the forwards, so its time is the connector's cost there (`scheduler_seconds`)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._scheduler_seconds += time.perf_counter() - start
    return timed


class KvtierConnector(KVConnectorBase_V1):
    """`--kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path":
    "kvtier.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"tiers": ["dram:4GiB", "ssd:/path:100GiB"], "codec": "raw"}}'`"""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_supported(vllm_config)
        config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self._space = key_space(vllm_config, config, engine_page(vllm_config))
        codec = get_codec(config.codec)
        slot_bytes = codec.max_encoded_bytes(self._space.layout) + 4096
        self._layerwise = config.load == "layerwise"
        # tensor parallel: each rank keeps its shard (its KV heads) under keys naming rank and world size
        self._world_size = vllm_config.parallel_config.tensor_parallel_size
        self._rank = vllm_config.parallel_config.rank
        # disaggregation: a producer (prefill) writes its blocks down before its reply leaves; a consumer
        # (decode) loads and writes nothing
        self._producer = self._kv_transfer_config.kv_role == "kv_producer"
        self._consumer = self._kv_transfer_config.kv_role == "kv_consumer"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._scheduler_seconds = 0.0  # in the scheduler-side hooks since the last stats (`_scheduler_hook`)
        if role == KVConnectorRole.SCHEDULER:
            # Lookups only (no writes): the worker's DRAM is in another process; what it holds is
            # written through to the shared tiers, which the scheduler asks.
            # It owns the shared directories' index and eviction (SSD, shm: `scheduler.py`).
            self._manager = build_manager(list(config.shared_tiers), slot_bytes=slot_bytes, async_writes=False)
            top = config.tiers[0]  # the worker promotes loaded blocks into it: a directory's index counts them
            self._scheduler = SchedulerSide(self._space, self._manager, self._world_size,
                                            block_bytes=codec.max_encoded_bytes(self._space.layout),
                                            saves=not self._consumer,
                                            promote_into=self._manager.tiers[0].name if top.kind in ("ssd", "shm")
                                            else None)
        else:
            with threads_started_off_forward() as cpus:  # every tier, save and load thread: off the forward's core
                # its directories are plain file stores: the scheduler's index decides what they keep
                self._manager = TierManager([make_tier(spec, slot_bytes=slot_bytes, owner=False)
                                             for spec in config.tiers], max_pending_writes=config.max_pending_saves)
                stores = {tier.name: tier for tier in self._manager.tiers if isinstance(tier, DiskStore)}
                self._worker = WorkerSide(self._space.layout, codec, self._manager, stores=stores, transfer_cpus=cpus)
        # --kv-events-config: the tiers' blocks announced with vLLM's own (`kv_events.py`), from both sides
        self._scheduler_events: SchedulerEvents | None = None
        self._worker_events: WorkerEvents | None = None
        if self._announces_tiers(vllm_config):
            if self._scheduler is not None:
                self._scheduler_events = SchedulerEvents(self._manager, self._space.layout.block_tokens,
                                                         self._world_size)
                self._scheduler.on_blocks = self._scheduler_events.describe
            else:
                self._worker_events = WorkerEvents(self._manager)
        log.info("kvtier connector (%s, rank %d of %d): tiers %s, codec %s, %s loads, layout %s", role.name.lower(),
                 self._rank, self._world_size, [tier.name for tier in self._manager.tiers], codec.name, config.load,
                 self._space.layout.encode().decode())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def _announces_tiers(self, vllm_config) -> bool:
        events_config = vllm_config.kv_events_config
        if events_config is None or not events_config.enable_kv_cache_events:
            return False
        return True  # with TP, a block is announced once every rank's shard is in (`SchedulerEvents`)

    # -- scheduler side --------------------------------------------------------------------------
    @_scheduler_hook
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        num_tokens = self._scheduler.num_matched_tokens(request, num_computed_tokens)
        return num_tokens, num_tokens > 0 and not self._layerwise

    @_scheduler_hook
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    @_scheduler_hook
    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """As looked up at admission (SSD or pool; the worker may then read a block from its DRAM:
        `kvtier:hit_tokens` and the reply's `kv_transfer_params` count where blocks really came from)."""
        sources: dict[CacheHitSource, int] = {}
        for tier, tokens in self._scheduler.hit_tokens_by_tier(request.request_id).items():
            source = _HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + tokens
        return sources

    @_scheduler_hook
    def build_connector_meta(self, scheduler_output) -> KvtierMetadata:
        records = self._scheduler.build_records(scheduler_output.num_scheduled_tokens,
                                                lambda req_id: self._kv_cache_manager.get_block_ids(req_id)[0])
        return KvtierMetadata(records.loads, [] if self._consumer else records.saves, records.deletes,
                              records.delete_ranks)

    @_scheduler_hook
    def update_connector_output(self, connector_output) -> None:
        if self._scheduler_events is not None:
            self._scheduler_events.from_worker(connector_output.kv_cache_events)
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KvtierWorkerMetadata):
            self._scheduler.loaded_from(worker_meta.loaded_tiers)
        if connector_output.invalid_block_ids:
            self._scheduler.load_errors(set(connector_output.invalid_block_ids))

    @_scheduler_hook
    def take_events(self):
        """The tiers' `BlockStored` / `BlockRemoved` since the last step, under vLLM's block hashes."""
        return self._scheduler_events.take() if self._scheduler_events is not None else ()

    @_scheduler_hook
    def has_pending_push_work(self) -> bool:
        """Blocks sent down are still landing in the tiers: step on (empty steps) until they are announced."""
        return self._scheduler_events is not None and self._scheduler_events.lingering()

    @_scheduler_hook
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves were copied out during the steps: the blocks are free now. The reply's
        `kv_transfer_params` tells which tier served how many of the prompt's tokens."""
        hits = self._scheduler.hit_tokens_by_tier(request.request_id)
        self._scheduler.finished(request.request_id)
        return False, ({"kvtier_hit_tokens": hits} if hits else None)

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        backends = {layers[name].attn_backend.get_name() for name in kv_caches}
        if len(backends) != 1:
            raise ValueError(f"KvtierConnector needs one attention backend for every layer, got {sorted(backends)}")
        page = page_format(backends.pop(), self._space.layout)
        self._worker.register(kv_caches, extract_layer_index, page)
        log.info("kvtier worker: %d layers of %s pages, %s", len(kv_caches), page,
                 [tuple(t.shape) for t in list(kv_caches.values())[:1]])

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None:
            assert isinstance(connector_metadata, KvtierMetadata)
            # the scheduler's chain keys -> this rank's shard keys (the same keys with one worker); of the files
            # to delete, this rank's shards: deleted behind this rank's writes (`DiskStore.delete_behind_writes`)
            deletes = deletes_for_rank(connector_metadata.deletes, connector_metadata.delete_ranks, self._rank)
            connector_metadata = KvtierMetadata(for_rank(connector_metadata.loads, self._rank, self._world_size),
                                                for_rank(connector_metadata.saves, self._rank, self._world_size),
                                                deletes)
            self._worker.delete(deletes)
            self._worker.begin_step(connector_metadata.saves)
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Async: after the forward (vLLM starts async loads then), the requests wait for them.
        Layerwise: before the forward, which waits per layer in `wait_for_layer_load`."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        if self._layerwise:
            self._worker.start_layerwise(meta.loads)
        else:
            self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)  # returns at once without a layerwise load in this step

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)  # this layer's slots of the step's saved blocks, copied out now

    def wait_for_save(self) -> None:
        self._worker.finish_layerwise()
        self._worker.finish_save()
        if self._producer:  # in the shared tiers before the reply: the consumer looks them up next
            self._worker.wait_saves()
            self._manager.flush()  # the write-through below a dram: tier

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.take_finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid_block_ids()

    def get_kv_connector_kv_cache_events(self):
        """What the worker's tiers announced since the last step (kvtier keys: the scheduler names the blocks)."""
        return self._worker_events.take() if self._worker_events is not None else None

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        tiers = self._worker.take_loaded_tiers()
        return KvtierWorkerMetadata(tiers) if tiers else None

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        if self._scheduler is not None:  # vLLM adds the scheduler's to the worker's, each step
            seconds, self._scheduler_seconds = self._scheduler_seconds, 0.0
            return KvtierConnectorStats(data={"scheduler_seconds": seconds}) if seconds else None
        stats = self._worker.take_stats()
        if self._rank != 0:  # vLLM sums the ranks' stats: a prompt's tokens are counted once, by rank 0
            stats = {k: v for k, v in stats.items() if not k.startswith("hit_tokens_")}
        return KvtierConnectorStats(data=stats) if stats else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        self._manager.close()
