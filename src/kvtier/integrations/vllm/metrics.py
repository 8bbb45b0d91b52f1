"""Per-tier hit attribution in vLLM's connector stats (logged) and Prometheus metrics (`/metrics`).

The worker counts what it really loaded, per tier (`hit_tokens_dram`, `hit_tokens_ssd`,
`hit_tokens_mooncake`, `hit_tokens_redis`), and `loaded_blocks`, `failed_blocks` (recomputed),
`saved_blocks`, `dropped_blocks` (a save queue full or a tier error: a future miss), and the time spent:
`load_seconds`, `save_copy_seconds` (on the step), `save_write_seconds` (the writer thread); the scheduler
side adds `scheduler_seconds` (its hooks, on the engine core's thread).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

HIT_PREFIX = "hit_tokens_"
_COUNTS = {
    "loaded_blocks": "Blocks loaded from kvtier's tiers into vLLM's KV cache.",
    "failed_blocks": "Blocks that failed to load (missing, corrupt or foreign) and were recomputed.",
    "saved_blocks": "Blocks written down kvtier's tiers.",
    "dropped_blocks": "Blocks not saved (queue full or tier error): a future miss, never a failed request.",
    "load_seconds": "The worker's time loading blocks (read, verify, write into the cache).",
    "save_copy_seconds": "The worker's time copying saved blocks out of the cache, on the step.",
    "save_write_seconds": "The writer thread's time encoding and writing saved blocks down the tiers.",
    "scheduler_seconds": "The scheduler side's time in kvtier's hooks (lookups, load and save plans, events).",
}


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """`data`: counter name -> count since the last interval (a plain dict: it crosses processes)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        total = Counter(self.data)
        total.update(other.data)
        self.data = dict(total)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._hits = self._counter_cls(name="kvtier:hit_tokens",
                                       documentation="Prompt tokens whose KV kvtier loaded, by the tier that held it.",
                                       labelnames=labelnames + ["tier"])
        self._counts = {name: self._counter_cls(name=f"kvtier:{name}", documentation=doc, labelnames=labelnames)
                        for name, doc in _COUNTS.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if not value:
                continue
            if name.startswith(HIT_PREFIX):
                self._hits.labels(*labels, name.removeprefix(HIT_PREFIX)).inc(value)
            elif name in self._counts:
                self._counts[name].labels(*labels).inc(value)


__all__ = ["KvtierConnectorStats", "KvtierPromMetrics"]
