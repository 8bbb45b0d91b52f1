"""Offload's settings, parsed once: the mode (`OffloadMode`, from the `kv_offload` string) and the window's
layout (`OffloadConfig`): what the engine, `TieredCache` (`hf_offload`) and the sparse eval share.

Light on purpose (no torch): `kvtier.config` imports it for `EngineConfig`'s settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from kvtier.blocks import DEFAULT_BLOCK_TOKENS

OffloadKind = Literal["exact", "sparse"]
DEFAULT_OFFLOAD_PAGE_TOKENS = 32  # sparse offload's page (at most a block): docs/benchmarks/quality.md, issue 18
# sparse offload's summary of a page, per layer and KV head: its keys' per-channel min, max (Quest) and mean,
# head_dim values each (`offload.pages.page_summary`; the mean since the 3-window measurement,
# docs/benchmarks/quality.md)
PAGE_SUMMARY_VECTORS = 3


@dataclass(frozen=True, slots=True)
class OffloadMode:
    """How a long sequence attends to its host blocks: all of them (`exact`), or a budget (`sparse`):
    `budget` < 1 is a fraction of its host pages, >= 1 a number of pages (per layer and KV head; a page is
    `offload_page_tokens` tokens of a block, the whole block when that is the block size)."""

    kind: OffloadKind
    budget: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("exact", "sparse"):
            raise ValueError(f"kv_offload must be 'off', 'exact' or 'sparse:BUDGET', got {self.kind!r}")
        if self.kind == "sparse" and not (self.budget > 0 and math.isfinite(self.budget)
                                          and (self.budget < 1 or self.budget == int(self.budget))):
            raise ValueError("a sparse budget is a fraction in (0, 1) or a whole number of pages, "
                             f"got {self.budget}")

    def num_fetched(self, num_host_pages: int) -> int:
        """Host pages attended to per layer and KV head. A fraction is a cap (rounded down, at least
        one page): `sparse:1/8` never moves more than 1/8 of what exact moves."""
        if self.kind == "exact" or num_host_pages == 0:
            return num_host_pages
        wanted = math.floor(self.budget * num_host_pages) if self.budget < 1 else int(self.budget)
        return max(1, min(num_host_pages, wanted))

    def __str__(self) -> str:
        if self.kind == "exact":
            return "exact"
        budget = self.budget if self.budget >= 1 else Fraction(self.budget).limit_denominator(1024)
        return f"sparse:{int(budget) if self.budget >= 1 else budget}"


def parse_offload(text: str | None) -> OffloadMode | None:
    """`off` (None), `exact`, `sparse:0.125`, `sparse:1/8` or `sparse:16` (pages). ValueError otherwise."""
    text = (text or "off").strip().lower()
    if text in ("off", "none", ""):
        return None
    if text == "exact":
        return OffloadMode("exact")
    kind, _, budget = text.partition(":")
    if kind != "sparse" or not budget:
        raise ValueError(f"kv_offload must be 'off', 'exact' or 'sparse:BUDGET' (0.125, 1/8 or a number of "
                         f"pages), got {text!r}")
    try:
        value = float(Fraction(budget))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"kv_offload: bad sparse budget {budget!r} (0.125, 1/8 or a number of pages)") from None
    return OffloadMode("sparse", value)


def sparse_page_tokens(page_tokens: int, block_tokens: int) -> int:
    """The unit sparse offload scores and fetches: pages of `page_tokens` tokens (Quest's pages), at most a
    block; a page must divide the block. ValueError otherwise."""
    page = min(page_tokens, block_tokens)
    if page <= 0 or block_tokens % page:
        works = max(n for n in range(1, max(page, 1) + 1) if block_tokens % n == 0)
        raise ValueError(f"offload_page_tokens ({page_tokens}) must divide block_tokens ({block_tokens}): a "
                         f"block is a whole number of pages; offload_page_tokens {works} works")
    return page


DEFAULT_SINK_BLOCKS = 1    # blocks an offloaded sequence keeps at its start (attention sinks)
DEFAULT_RECENT_BLOCKS = 2  # ... and at its end (the open block and the one before it)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """An offloaded sequence's layout: the default `mode` (None: off), its blocks of `block_tokens`, the
    first `sink_blocks` and the last `recent_blocks` kept on the device (the *window*), every full block in
    between in host memory; sparse's pages of `page_tokens` (at most a block, dividing it: normalized here; a
    page that does not divide the block is a ValueError for sparse, the block otherwise);
    `fetch_blocks` layer-blocks per half of the fetch area (0: the engine's default share of the budget).
    Built once (`EngineConfig.offload_config`, `TieredCache`, the eval's `SparseWindow`)."""

    mode: OffloadMode | None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    sink_blocks: int = DEFAULT_SINK_BLOCKS
    recent_blocks: int = DEFAULT_RECENT_BLOCKS
    page_tokens: int = DEFAULT_OFFLOAD_PAGE_TOKENS
    fetch_blocks: int = 0

    def __post_init__(self) -> None:  # a page divides the block; a larger one is the block
        if self.recent_blocks < 1 or self.sink_blocks < 0:
            raise ValueError(f"kv_offload keeps at least the open block: recent_blocks >= 1 and sink_blocks >= 0, "
                             f"got {self.recent_blocks} and {self.sink_blocks}")
        try:
            page = sparse_page_tokens(self.page_tokens, self.block_tokens)
        except ValueError:
            if self.mode is not None and self.mode.kind == "sparse":
                raise
            page = self.block_tokens  # exact fetches whole blocks: no page to check
        object.__setattr__(self, "page_tokens", page)

    @property
    def window_blocks(self) -> int:
        return self.sink_blocks + self.recent_blocks

    @property
    def window_tokens(self) -> int:
        return self.window_blocks * self.block_tokens

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    def host_end(self, num_tokens: int) -> int:
        """The logical block after the last host block when the context holds `num_tokens` (the open
        block and the `recent_blocks - 1` before it stay on the device)."""
        return max(self.sink_blocks, -(-num_tokens // self.block_tokens) - self.recent_blocks)

    def host_blocks(self, num_tokens: int) -> tuple[int, int]:
        """Logical blocks [first, end) in host memory while the token at position num_tokens - 1 decodes."""
        return self.sink_blocks, self.host_end(num_tokens)

    def host_blocks_needed(self, num_tokens: int) -> int:
        """Host slots a sequence of `num_tokens` reserves (every block outside its window at its longest)."""
        return max(0, -(-num_tokens // self.block_tokens) - self.window_blocks)
