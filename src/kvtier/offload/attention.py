"""Attention of an offloaded sequence: its device window and its host blocks (see `kvtier.offload`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtier.offload.attend import attend, merge
from kvtier.offload.config import OffloadMode
from kvtier.offload.fetch import FetchArea
from kvtier.offload.in_place import InPlaceDecode
from kvtier.offload.pages import pick_pages
from kvtier.offload.stats import OffloadStats


@dataclass(slots=True)
class HostBlocks:
    """A sequence's blocks in host memory: logical blocks sink_blocks .. sink_blocks + len - 1."""

    mode: OffloadMode
    reserved_blocks: int                  # host slots set aside for it at admission (its longest need)
    slots: list[int] = field(default_factory=list)    # the DRAM slot of each (pinned)
    keys: list[bytes] = field(default_factory=list)
    summaries: torch.Tensor | None = None  # [capacity, L, pages, H, 3, D] key min / max / mean per page (sparse)
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __len__(self) -> int:
        return len(self.slots)


@dataclass(slots=True)
class SeqOffload:
    """What the attention needs of one offloaded sequence in this step (built by the runner)."""

    mode: OffloadMode
    slots: torch.Tensor            # [n] long: the host slots of its middle blocks, in order
    summaries: torch.Tensor | None  # [n, L, pages, H, 3, D]
    q_positions: torch.Tensor      # [num queries] positions of this step's tokens
    key_positions: torch.Tensor    # [device context] positions of the keys `arena.gather` returns
    decode: bool                   # one query: sparse applies (prefill chunks are exact)
    stats: OffloadStats
    host_offsets: torch.Tensor | None = None  # exact, read in place: its blocks' offsets (`InPlaceDecode`), once a step


def window_positions(block_ids: list[int], block_tokens: int, end: int) -> list[int]:
    """Positions (< end) of the tokens in device blocks (block id >= 0) of a block table."""
    positions: list[int] = []
    for i, block_id in enumerate(block_ids):
        if block_id >= 0 and i * block_tokens < end:
            positions += range(i * block_tokens, min((i + 1) * block_tokens, end))
    return positions



class OffloadAttention:
    """Attention of an offloaded sequence: its device window (sinks + recent, from the arena) and
    its host blocks (through the fetch area; sparse: each head's pages of `page_tokens`). When what it
    reads fits one half of the fetch area (the usual case), the window is appended after it and one SDPA
    call (the kernel the rest of the engine uses) covers the whole context; otherwise the pieces are
    merged by their log-sum-exp."""

    def __init__(self, fetch: FetchArea, num_layers: int, page_tokens: int | None = None,
                 num_heads: int | None = None, num_kv_heads: int | None = None) -> None:
        self.fetch = fetch
        self.num_layers = num_layers
        self.page_tokens = page_tokens or fetch.block_tokens  # None: a page is the block
        self.pages_per_block = fetch.block_tokens // self.page_tokens
        assert self.pages_per_block * self.page_tokens == fetch.block_tokens, (self.page_tokens, fetch.block_tokens)
        # decodes on the CPU: host blocks read in place, one kernel call a layer (`InPlaceDecode`)
        self.in_place = None
        if (fetch.host is not None and num_heads and num_kv_heads
                and InPlaceDecode.usable(fetch.device, num_heads, num_kv_heads)):
            self.in_place = InPlaceDecode(fetch.host, self.page_tokens)
        self.in_place_bytes = 0  # host KV read in place (the rest of what sequences fetched went through the area)

    def plan(self, offloads: list[SeqOffload | None]) -> None:
        """Before the forward: every exact piece of the step in attention order (layer, then sequence)."""
        plan = []
        half = self.fetch.half_blocks
        for layer in range(self.num_layers):
            for off in offloads:
                if off is None or not off.slots.numel() or self._sparse(off) or self._reads_in_place(off):
                    continue
                plan += [(layer, off.slots[i:i + half]) for i in range(0, off.slots.numel(), half)]
        self.fetch.begin(plan)

    def _reads_in_place(self, off: SeqOffload) -> bool:
        return self.in_place is not None and off.decode and off.slots.numel() > 0

    def _sparse(self, off: SeqOffload) -> bool:
        num_pages = off.slots.numel() * self.pages_per_block
        return off.mode.kind == "sparse" and off.decode and off.mode.num_fetched(num_pages) < num_pages

    def forward(self, layer: int, q: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor, off: SeqOffload,
                scale: float) -> torch.Tensor:
        """q [Hq, N, D]; k_dev, v_dev [H, M, D] (the device window) -> out [Hq, N, D]."""
        h = k_dev.shape[0]
        hq, n, d = q.shape
        if self._reads_in_place(off):
            return self._in_place(layer, q, k_dev, v_dev, off, scale)
        dev_mask = off.key_positions[None, :] <= off.q_positions[:, None]  # [N, M]
        num_host = off.slots.numel()
        if self._sparse(off):  # each head's top pages: slots [k, H], pages [k, H]
            slots, pages, t = *self._sparse_pages(layer, q.view(h, hq // h, n, d), off), self.page_tokens
        else:
            slots, pages, t = off.slots[:, None].expand(-1, h), None, self.fetch.block_tokens
        if slots.shape[0] * t <= self.fetch.half_tokens:  # one call over [host tokens, window]
            if num_host == 0:
                return F.scaled_dot_product_attention(q[None], k_dev[None], v_dev[None], attn_mask=dev_mask,
                                                      scale=scale, enable_gqa=hq != h)[0]
            half, num_tokens = self._fetch_one(layer, slots, pages, t, off)
            kv = self.fetch.append_window(half, num_tokens, k_dev, v_dev)
            mask = None
            if n > 1:  # every host token precedes every query; the window is causal by position
                mask = torch.cat([torch.ones((n, num_tokens), dtype=torch.bool, device=q.device), dev_mask], dim=1)
            return F.scaled_dot_product_attention(q[None], kv[0][None], kv[1][None], attn_mask=mask, scale=scale,
                                                  enable_gqa=hq != h)[0]
        q4 = q.reshape(h, hq // h, n, d).contiguous()  # once: every piece reads its KV heads' query rows
        out, lse = attend(q4, k_dev, v_dev, dev_mask, scale)
        for k_host, v_host in self._pieces(layer, slots, pages, t, off):
            out, lse = merge(out, lse, *attend(q4, k_host, v_host, None, scale))
        return out.view(hq, n, d)

    def _in_place(self, layer: int, q: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor, off: SeqOffload,
                  scale: float) -> torch.Tensor:
        """A decode over its host blocks (sparse: each head's picked pages) read in place, and its window."""
        h, (hq, _, d) = k_dev.shape[0], q.shape
        if self._sparse(off):
            blocks, pages = self._pick(layer, q[:, -1].reshape(h, hq // h, d), off)
            offsets, unit = self.in_place.page_offsets(off.slots, blocks, pages), self.page_tokens
        else:
            if off.host_offsets is None:
                off.host_offsets = self.in_place.exact_offsets(off.slots)
            offsets, unit = off.host_offsets, self.fetch.block_tokens
        num_bytes = self._count(off, offsets.shape[-1] * unit, 0.0)
        self.in_place_bytes += num_bytes
        return self.in_place.forward(layer, q, k_dev, v_dev, offsets, unit, scale)

    def _fetch_one(self, layer: int, slots: torch.Tensor, pages: torch.Tensor | None, t: int,
                   off: SeqOffload) -> tuple[int, int]:
        """The sequence's host blocks (sparse: pages of t tokens) of this layer in one half: (half, tokens)."""
        if self._sparse(off):
            start = time.perf_counter()
            half = self.fetch.spare_half()
            num_tokens = self.fetch.gather(layer, slots, half, pages, t)
            self._count(off, num_tokens, time.perf_counter() - start)
            return half, num_tokens
        half, num_tokens, waited = self.fetch.take()
        self._count(off, num_tokens, waited)
        return half, num_tokens

    def _pieces(self, layer: int, slots: torch.Tensor, pages: torch.Tensor | None, t: int, off: SeqOffload):
        """More than a half holds: one half-full piece at a time, as K, V [H, tokens, D]."""
        per_piece = self.fetch.half_tokens // t  # exact: half_blocks blocks, as planned
        for i in range(0, slots.shape[0], per_piece):
            if self._sparse(off):
                start = time.perf_counter()
                half = self.fetch.spare_half()
                num_tokens = self.fetch.gather(layer, slots[i:i + per_piece], half, pages[i:i + per_piece], t)
                waited = time.perf_counter() - start
            else:
                half, num_tokens, waited = self.fetch.take()
            self._count(off, num_tokens, waited)
            kv = self.fetch.kv(half, num_tokens)
            yield kv[0], kv[1]

    def _sparse_pages(self, layer: int, q4: torch.Tensor, off: SeqOffload) -> tuple[torch.Tensor, torch.Tensor]:
        """The pick for each KV head, in context order: the host slots [k, H] of its top pages and each one's page
        in its block [k, H]."""
        blocks, pages = self._pick(layer, q4[:, :, -1], off)
        return off.slots[blocks], pages

    def _pick(self, layer: int, q: torch.Tensor, off: SeqOffload) -> tuple[torch.Tensor, torch.Tensor]:
        """`pages.pick_pages` over the sequence's host blocks for q [H, G, D]: (blocks [k, H], pages [k, H]), CPU.
        The host addresses the pages, so on CUDA this read-back waits for the layer."""
        k = off.mode.num_fetched(off.slots.numel() * self.pages_per_block)
        return pick_pages(off.summaries[:, layer], q, k, self.pages_per_block)

    def _count(self, off: SeqOffload, num_tokens: int, seconds: float) -> int:
        buffer = self.fetch.buffer
        num_bytes = 2 * buffer.shape[2] * num_tokens * buffer.shape[-1] * buffer.element_size()
        off.stats.fetched_bytes += num_bytes
        off.stats.fetch_seconds += seconds
        if off.decode:
            off.stats.decode_fetched_bytes += num_bytes
        return num_bytes
