"""Prometheus metrics for one server, in its own `CollectorRegistry` (never the global one).

Two kinds: latency histograms and request counters that the request handlers observe, and the
engine's and tier manager's statistics, read when scraped by a custom collector (so /metrics is
never stale and nothing has to mirror the counters). `/dashboard/data` reads the same `snapshot()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# TierStats field -> (metric name, help). Counters get `_total` appended on exposition.
_TIER_COUNTERS = {
    "hits": ("kvtier_tier_hits", "Block reads served by the tier"),
    "misses": ("kvtier_tier_misses", "Block reads the tier could not serve"),
    "puts": ("kvtier_tier_puts", "Blocks written to the tier"),
    "evictions": ("kvtier_tier_evictions", "Blocks the tier evicted"),
    "corrupt": ("kvtier_tier_corrupt_blocks", "Blocks that failed verification and were dropped"),
    "errors": ("kvtier_tier_errors", "I/O failures of the tier"),
    "bytes_read": ("kvtier_tier_read_bytes", "Bytes transferred out of the tier"),
    "bytes_written": ("kvtier_tier_written_bytes", "Bytes transferred into the tier"),
    "read_seconds": ("kvtier_tier_read_seconds", "Seconds spent reading from the tier"),
    "write_seconds": ("kvtier_tier_write_seconds", "Seconds spent writing to the tier"),
}


@dataclass(slots=True)
class TierView:
    """One tier as the dashboard shows it."""

    name: str
    used_bytes: int
    capacity_bytes: int | None
    readable: bool
    writable: bool
    backoff_s: float = 0.0          # the wait before the next probe while (partly) down
    num_transitions: int = 0        # health state changes: a flapping tier shows here
    stats: dict[str, float] = field(default_factory=dict)  # TierStats as a dict

    @property
    def healthy(self) -> bool:
        return self.readable and self.writable

    @property
    def hit_rate(self) -> float:
        total = self.stats["hits"] + self.stats["misses"]
        return self.stats["hits"] / total if total else 0.0


@dataclass(slots=True)
class EngineView:
    """The engine numbers the server exports (a subset of EngineStats, under stable names)."""

    num_running: int = 0
    num_waiting: int = 0
    num_device_blocks_used: int = 0
    num_device_blocks_cached: int = 0
    num_device_blocks_total: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    kv_codec: str = "raw"
    device_block_bytes: int = 0
    num_waiting_for_kv: int = 0
    step_tier_io_seconds: float = 0.0
    transfer_load_seconds: float = 0.0
    transfer_store_seconds: float = 0.0
    kv_offload: str = "off"             # contexts larger than the device (kvtier/offload/)
    device_kv_bytes: int = 0            # arena + fetch area, within the budget
    num_offloaded_running: int = 0
    host_kv_bytes: int = 0
    host_blocks_reserved: int = 0
    offload_fetched_bytes: int = 0
    offload_fetch_seconds: float = 0.0


def tier_views(manager) -> list[TierView]:
    if manager is None:
        return []
    occupancy = manager.occupancy()
    return [TierView(tier.name, *occupancy[tier.name], readable=tier.health.readable, writable=tier.health.writable,
                     backoff_s=tier.health.backoff_s, num_transitions=tier.health.num_transitions,
                     stats=asdict(tier.stats))
            for tier in manager.tiers]


@dataclass(slots=True)
class RequestTotals:
    """Counts over finished requests; exported by the collector and shown by the dashboard."""

    num_finished_by_reason: dict[str, int] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generation_tokens: int = 0
    num_errors_by_status: dict[str, int] = field(default_factory=dict)
    ttft_seconds_sum: float = 0.0
    num_first_tokens: int = 0
    itl_seconds_sum: float = 0.0
    num_later_tokens: int = 0


class ServerMetrics:
    def __init__(self, engine_view: Callable[[], EngineView], manager=None,
                 kv_event_counts: Callable[[], tuple[int, int]] | None = None) -> None:
        self.engine_view = engine_view
        self.manager = manager
        self.kv_event_counts = kv_event_counts  # --kv-events-config: (batches published, device events dropped)
        self.totals = RequestTotals()
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("kvtier_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvtier_inter_token_latency_seconds", "Time between consecutive generated tokens",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.registry.register(_StatsCollector(self))

    # -- observed by the handlers ----------------------------------------------------------------
    def observe_tokens(self, started_at: float, last_token_at: float | None, now: float, num_tokens: int) -> None:
        """`num_tokens` tokens arrived at `now`; the first of a request counts as TTFT."""
        if num_tokens <= 0:
            return
        if last_token_at is None:
            self.ttft.observe(now - started_at)
            self.totals.ttft_seconds_sum += now - started_at
            self.totals.num_first_tokens += 1
            num_tokens -= 1
            last_token_at = now
        for _ in range(num_tokens):  # tokens that arrive together share the gap
            self.itl.observe((now - last_token_at) / num_tokens)
        self.totals.itl_seconds_sum += (now - last_token_at) if num_tokens else 0.0
        self.totals.num_later_tokens += num_tokens

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, num_cached_tokens: int,
                         num_generation_tokens: int) -> None:
        totals = self.totals
        totals.num_finished_by_reason[finish_reason] = totals.num_finished_by_reason.get(finish_reason, 0) + 1
        totals.num_prompt_tokens += num_prompt_tokens
        totals.num_cached_tokens += num_cached_tokens
        totals.num_generation_tokens += num_generation_tokens

    def observe_error(self, status: int) -> None:
        errors = self.totals.num_errors_by_status
        errors[str(status)] = errors.get(str(status), 0) + 1

    # -- read by /metrics and /dashboard/data ----------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        t = self.totals
        return {
            "tiers": [{"name": v.name, "used_bytes": v.used_bytes, "capacity_bytes": v.capacity_bytes,
                       "healthy": v.healthy, "readable": v.readable, "writable": v.writable, "backoff_s": v.backoff_s,
                       "hit_rate": v.hit_rate, **v.stats} for v in tier_views(self.manager)],
            "engine": asdict(self.engine_view()),
            "requests": {
                "finished": sum(t.num_finished_by_reason.values()), "errors": sum(t.num_errors_by_status.values()),
                "prompt_tokens": t.num_prompt_tokens, "cached_tokens": t.num_cached_tokens,
                "generation_tokens": t.num_generation_tokens,
                "prefix_hit_rate": t.num_cached_tokens / t.num_prompt_tokens if t.num_prompt_tokens else 0.0,
                "ttft_mean_seconds": t.ttft_seconds_sum / t.num_first_tokens if t.num_first_tokens else 0.0,
                "itl_mean_seconds": t.itl_seconds_sum / t.num_later_tokens if t.num_later_tokens else 0.0,
            },
        }


class _StatsCollector:
    """Engine and tier statistics, read at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from _request_families(self.metrics.totals)
        yield from _engine_families(self.metrics.engine_view())
        yield from _tier_families(tier_views(self.metrics.manager))
        if self.metrics.kv_event_counts is not None:
            yield from _kv_event_families(*self.metrics.kv_event_counts())


def _request_families(totals: RequestTotals) -> Iterator[Metric]:
    finished = CounterMetricFamily("kvtier_requests_finished", "Requests finished, by finish reason",
                                   labels=["finish_reason"])
    for reason, num in sorted(totals.num_finished_by_reason.items()):
        finished.add_metric([reason], num)
    errors = CounterMetricFamily("kvtier_request_errors",
                                 "API requests (/v1/...) answered with an error, by HTTP status", labels=["status"])
    for status, num in sorted(totals.num_errors_by_status.items()):
        errors.add_metric([status], num)
    yield from (finished, errors)
    yield CounterMetricFamily("kvtier_prompt_tokens", "Prompt tokens of finished requests",
                              value=totals.num_prompt_tokens)
    yield CounterMetricFamily("kvtier_cached_prompt_tokens", "Prompt tokens served from the prefix cache (any tier)",
                              value=totals.num_cached_tokens)
    yield CounterMetricFamily("kvtier_generation_tokens", "Tokens generated", value=totals.num_generation_tokens)


def _kv_event_families(num_batches: int, num_dropped: int) -> Iterator[Metric]:
    yield CounterMetricFamily("kvtier_kv_events_batches", "KV event batches published (--kv-events-config)",
                              value=num_batches)
    yield CounterMetricFamily("kvtier_kv_events_dropped", "Device block events dropped: the publisher fell "
                              "max_queue_size behind the engine", value=num_dropped)


def _engine_families(engine: EngineView) -> Iterator[Metric]:
    for name, help_, value in (
        ("kvtier_requests_running", "Requests in the running batch", engine.num_running),
        ("kvtier_requests_waiting", "Requests waiting for admission", engine.num_waiting),
        ("kvtier_requests_waiting_for_kv", "Requests admitted whose cached prefix is being loaded from the tiers",
         engine.num_waiting_for_kv),
        ("kvtier_device_blocks_used", "Device KV blocks held by sequences", engine.num_device_blocks_used),
        ("kvtier_device_blocks_cached", "Free device KV blocks still holding a cached prefix block",
         engine.num_device_blocks_cached),
        ("kvtier_device_blocks_total", "Device KV blocks in the budget", engine.num_device_blocks_total),
        ("kvtier_device_block_bytes", "Bytes of one device KV block slot in the resident format",
         engine.device_block_bytes),
        ("kvtier_device_kv_bytes", "Device KV memory: the arena and the offload fetch area (within the budget)",
         engine.device_kv_bytes),
        ("kvtier_offload_requests_running", "Running requests longer than the device, their middle blocks in "
         "host memory", engine.num_offloaded_running),
        ("kvtier_offload_host_kv_bytes", "KV of running offloaded requests pinned in host memory",
         engine.host_kv_bytes),
        ("kvtier_offload_host_blocks_reserved", "Host blocks set aside for the offloaded requests admitted",
         engine.host_blocks_reserved),
    ):
        yield GaugeMetricFamily(name, help_, value=value)
    codec = GaugeMetricFamily("kvtier_device_kv_codec", "The device KV arena's resident format (1 for the one in use)",
                              labels=["kv_codec"])
    codec.add_metric([engine.kv_codec], 1.0)
    yield codec
    yield CounterMetricFamily("kvtier_preemptions", "Sequences preempted", value=engine.num_preemptions)
    yield CounterMetricFamily("kvtier_step_tier_io_seconds", "Time the engine's step thread spent in tier calls "
                              "(prefix matches; reads and writes run on the transfer worker)",
                              value=engine.step_tier_io_seconds)
    transfer = CounterMetricFamily("kvtier_transfer_seconds", "Time the transfer worker spent moving KV between "
                                   "the device and the tiers", labels=["direction"])
    transfer.add_metric(["load"], engine.transfer_load_seconds)
    transfer.add_metric(["store"], engine.transfer_store_seconds)
    yield transfer
    mode = GaugeMetricFamily("kvtier_kv_offload", "The engine's default offload mode (1 for the one in use)",
                             labels=["mode"])
    mode.add_metric([engine.kv_offload], 1.0)
    yield mode
    yield CounterMetricFamily("kvtier_offload_fetched_bytes", "KV bytes fetched from host memory into the device "
                              "for offloaded requests' attention", value=engine.offload_fetched_bytes)
    yield CounterMetricFamily("kvtier_offload_fetch_seconds", "Time the step waited for offload fetches (not hidden "
                              "behind compute)", value=engine.offload_fetch_seconds)
    hits = CounterMetricFamily("kvtier_prefix_hit_tokens", "Prompt tokens found cached, by where they were found",
                               labels=["tier"])
    for tier, num_tokens in sorted(engine.prefix_hit_tokens_by_tier.items()):
        hits.add_metric([tier], num_tokens)
    yield hits


def _tier_families(tiers: list[TierView]) -> Iterator[Metric]:
    for stat, (name, help_) in _TIER_COUNTERS.items():
        family = CounterMetricFamily(name, help_, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier.name], tier.stats[stat])
        yield family
    used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes held by the tier", labels=["tier"])
    capacity = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity of the tier (pools: absent)", labels=["tier"])
    healthy = GaugeMetricFamily("kvtier_tier_healthy", "1 while the tier is readable and writable", labels=["tier"])
    readable = GaugeMetricFamily("kvtier_tier_readable", "1 while reads use the tier (a full or read-only disk "
                                 "still reads)", labels=["tier"])
    writable = GaugeMetricFamily("kvtier_tier_writable", "1 while writes use the tier", labels=["tier"])
    backoff = GaugeMetricFamily("kvtier_tier_backoff_seconds", "Wait before the next probe of a tier that is down "
                                "(0 while up); grows while probes fail and across quick relapses", labels=["tier"])
    transitions = CounterMetricFamily("kvtier_tier_health_transitions", "Changes of the tier's readable/writable "
                                      "state (a flapping tier counts up fast)", labels=["tier"])
    for tier in tiers:
        used.add_metric([tier.name], tier.used_bytes)
        if tier.capacity_bytes is not None:
            capacity.add_metric([tier.name], tier.capacity_bytes)
        healthy.add_metric([tier.name], float(tier.healthy))
        readable.add_metric([tier.name], float(tier.readable))
        writable.add_metric([tier.name], float(tier.writable))
        backoff.add_metric([tier.name], tier.backoff_s)
        transitions.add_metric([tier.name], tier.num_transitions)
    yield from (used, capacity, healthy, readable, writable, backoff, transitions)
