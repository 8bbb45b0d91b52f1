"""Serving KV larger than the device from memory outside it (issue 18): what `exact` and `sparse` offload need.

Per request the device keeps a window of whole blocks: the attention sinks (their first block) and the recent
window (the open block included). Every other block lives off the device (host DRAM, a CXL expander, a pool).
- exact: every off-device block crosses the link at every decode step, layer by layer (layer l+1's copy
  overlapping layer l's compute): a step moves all off-device KV of every request on the GPU.
- sparse (Quest): a block is pages of `page_tokens` (the engine's `offload_page_tokens`; the block when that is
  the block size); a per-page key summary on the device, per-channel min, max and mean (3 x d_head 16-bit values
  per page, layer and KV head), picks floor(fraction x off-device pages) (at least one) pages per layer and KV head;
  only those cross the link. The summaries never cross it: they are read from HBM at every step.
Fetch area: one layer of what a step fetches for all requests of the GPU, double-buffered.
Decode: a step yields one token per request and lasts at least max(link bytes / link bandwidth,
HBM bytes / HBM bandwidth), copy and compute overlapping; both are nominal peaks, so these are upper bounds.
Only full-attention layers offload: a sliding-window layer keeps its (bounded) window on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from kvtier.blocks import DEFAULT_BLOCK_TOKENS
from kvtier.config import DEFAULT_OFFLOAD_PAGE_TOKENS, PAGE_SUMMARY_VECTORS, sparse_page_tokens
from kvtier.errors import UserError
from kvtier.plan.catalog_links import LINKS
from kvtier.plan.result import OffloadMode, OffloadPlan, PlanResult
from kvtier.plan.specs import GPUSpec, ModelSpec

SINK_TOKENS = 4            # StreamingLLM's attention sinks (as levers.eviction): they take the first block
RECENT_TOKENS = 768        # with 256-token blocks: 1 sink + 3 recent blocks = 1,024 tokens on the device
SUMMARY_ELEMENT_BYTES = 2  # the summaries in fp16 (as Quest's min/max)
DEFAULT_SPARSE_FRACTION = 1 / 8


@dataclass(frozen=True, slots=True)
class OffloadOptions:
    """The device window and the sparse budget. `window_tokens` None: the sink block + RECENT_TOKENS.
    `page_tokens`: sparse's unit (divides the block; more than the block: the block)."""

    window_tokens: int | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sparse_fraction: float = DEFAULT_SPARSE_FRACTION
    page_tokens: int = DEFAULT_OFFLOAD_PAGE_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
            raise UserError(f"--block-tokens must be a positive integer, got {self.block_tokens!r}")
        if self.window_tokens is not None and self.window_tokens < 2 * self.block_tokens:
            raise UserError(f"--offload-window-tokens must hold at least 2 blocks (the sink block and the open "
                            f"block): {2 * self.block_tokens} tokens, got {self.window_tokens}")
        if not 0 < self.sparse_fraction <= 1:
            raise UserError(f"--sparse-fraction must be in (0, 1], got {self.sparse_fraction}")
        if not isinstance(self.page_tokens, int) or self.page_tokens <= 0:
            raise UserError(f"--page-tokens must be a positive integer, got {self.page_tokens!r}")
        if self.block_tokens % min(self.page_tokens, self.block_tokens):
            raise UserError(f"--page-tokens ({self.page_tokens}) must divide --block-tokens ({self.block_tokens}): "
                            "a block is a whole number of pages")

    @property
    def page(self) -> int:
        """Tokens per page sparse fetches (at most a block)."""
        return sparse_page_tokens(self.page_tokens, self.block_tokens)

    @property
    def window_blocks(self) -> int:
        if self.window_tokens is None:
            return math.ceil(SINK_TOKENS / self.block_tokens) + math.ceil(RECENT_TOKENS / self.block_tokens)
        return math.ceil(self.window_tokens / self.block_tokens)


def parse_fraction(text: str) -> float:
    """`1/8` or `0.125` -> 0.125."""
    try:
        return float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise UserError(f"cannot parse fraction {text!r} (expected e.g. 1/8 or 0.125)") from None


def _full_layers(model: ModelSpec) -> ModelSpec:
    """The layers that offload: full attention only."""
    return replace(model, num_layers=model.num_layers - model.num_sliding_layers, num_sliding_layers=0,
                   sliding_window=None)


def _summary_bytes(model: ModelSpec, tp: int, num_pages: int) -> float:
    """Per-channel min, max (Quest) and mean of each page's keys = 3 x d_head values per page, layer and KV head
    (MLA: of the latent and the rope key, one 'head')."""
    keys_per_token = (model.mla_kv_lora_rank + model.mla_rope_dim if model.is_mla
                      else model.kv_heads_per_rank(tp) * model.head_dim)
    return num_pages * _full_layers(model).num_layers * PAGE_SUMMARY_VECTORS * keys_per_token * SUMMARY_ELEMENT_BYTES


def _mode(name: str, result: PlanResult, model: ModelSpec, gpu: GPUSpec, *, window_rank: float,
          fetched_tokens: int, unit_tokens: int, fetched_rank: float, summary_rank: float) -> OffloadMode:
    """Costs of a mode that fetches `fetched_rank` bytes (one request, one rank) at every step."""
    n, layers = result.concurrency, _full_layers(model).num_layers
    fetch_area = 2 * n * fetched_rank / layers if layers else 0.0
    device_kv = n * (window_rank + summary_rank) + fetch_area
    device = result.weights_bytes_per_gpu + result.activations_bytes + result.overhead_bytes + device_kv
    link_bytes = n * fetched_rank
    active_weights = result.weights_bytes_per_gpu * model.params_active / model.params_total
    hbm_bytes = active_weights + n * (window_rank + summary_rank + 2 * fetched_rank)
    hbm_tps = gpu.hbm_bandwidth_bytes_s / hbm_bytes
    by_link = {link.name: min(hbm_tps, link.bytes_s / link_bytes) if link_bytes else hbm_tps
               for link in LINKS.values()}
    return OffloadMode(name=name, fetched_tokens_per_request=fetched_tokens, fetch_unit_tokens=unit_tokens,
                       link_bytes_per_step=link_bytes,
                       summary_bytes_per_gpu=n * summary_rank, fetch_area_bytes_per_gpu=fetch_area,
                       device_bytes_per_gpu=device, fits_device=device <= result.usable_bytes,
                       hbm_bytes_per_step=hbm_bytes, hbm_tokens_per_s=hbm_tps, tokens_per_s_by_link=by_link)


def _all_on_device_tokens_per_s(result: PlanResult, model: ModelSpec, gpu: GPUSpec, kv_rank: float) -> float:
    """Per request, HBM bound, when the requests are spread over the replicas the sizing asks for."""
    if not result.replicas:
        return 0.0
    per_replica = math.ceil(result.concurrency / result.replicas)
    active_weights = result.weights_bytes_per_gpu * model.params_active / model.params_total
    return gpu.hbm_bandwidth_bytes_s / (active_weights + per_replica * kv_rank)


def plan_offload(result: PlanResult, model: ModelSpec, gpu: GPUSpec, options: OffloadOptions,
                 host_kv_capacity_bytes: float) -> OffloadPlan:
    """What exact and sparse offload need to serve `result`'s requests on its one replica of tp GPUs."""
    t, tp, kv_dtype = options.block_tokens, result.tp, result.kv_dtype
    num_blocks = math.ceil(result.context / t)
    off_blocks = max(0, num_blocks - options.window_blocks)
    off_tokens = off_blocks * t  # the open block is in the window: every off-device block is full
    full = _full_layers(model)
    host_rank = full.kv_bytes(off_tokens, kv_dtype, tp)
    kv_rank = model.kv_bytes(result.context, kv_dtype, tp)
    window_rank = kv_rank - host_rank
    page = options.page
    off_pages = off_blocks * (t // page)
    # 0.1 x 30 is 3.0000000000000004 in floats: count in the fraction the user meant
    # a cap, as the engine's `OffloadMode.num_fetched`: rounded down, at least one page
    sparse_pages = max(1, math.floor(Fraction(options.sparse_fraction).limit_denominator(1 << 20) * off_pages))
    exact = _mode("exact", result, model, gpu, window_rank=window_rank, fetched_tokens=off_tokens, unit_tokens=t,
                  fetched_rank=host_rank, summary_rank=0.0)
    sparse = _mode(f"sparse {_fraction_label(options.sparse_fraction)}", result, model, gpu,
                   window_rank=window_rank, fetched_tokens=sparse_pages * page, unit_tokens=page,
                   fetched_rank=full.kv_bytes(sparse_pages * page, kv_dtype, tp),
                   summary_rank=_summary_bytes(model, tp, off_pages))
    host_total = host_rank * tp * result.concurrency
    return OffloadPlan(
        block_tokens=t, page_tokens=page, window_blocks=options.window_blocks, device_tokens_per_request=result.context - off_tokens,
        off_device_tokens_per_request=off_tokens, off_device_blocks_per_request=off_blocks,
        sparse_fraction=options.sparse_fraction, host_bytes_per_request=host_rank * tp, host_bytes_total=host_total,
        window_bytes_per_gpu=result.concurrency * window_rank, host_kv_capacity_bytes=host_kv_capacity_bytes,
        fits_host=host_total <= host_kv_capacity_bytes,
        exact=exact, sparse=sparse, link_bytes_s={link.name: link.bytes_s for link in LINKS.values()},
        all_on_device_gpus=result.gpus, gpus_to_buy=max(0, result.gpus - tp),
        all_on_device_tokens_per_s=_all_on_device_tokens_per_s(result, model, gpu, kv_rank),
        notes=_notes(model, off_blocks))


def _fraction_label(fraction: float) -> str:
    f = Fraction(fraction).limit_denominator(1024)
    return f"{f.numerator}/{f.denominator}" if float(f) == fraction else f"{fraction:g}"


def _notes(model: ModelSpec, off_blocks: int) -> list[str]:
    notes = []
    if off_blocks == 0:
        notes.append("offload: each request fits its device window, nothing leaves the device "
                     "(a smaller --offload-window-tokens moves more off it)")
    if model.num_sliding_layers:
        notes.append(f"offload: the {model.num_sliding_layers} sliding-window layers keep their window on the device; "
                     f"only the {model.num_layers - model.num_sliding_layers} full-attention layers offload")
    if model.is_mla:
        notes.append("offload: MLA's sparse summary is the min/max/mean of the latent and rope key (one 'head')")
    return notes
