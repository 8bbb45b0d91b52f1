"""One cache layer's host blocks, for an offloaded context outside the engine (`TieredCache`, `kvtier.hf_offload`).

The engine keeps an offloaded sequence's middle blocks in DRAM tier slots (`HostBlockPool`); a transformers cache
has no tier stack beside each layer, so each of its layers keeps them here: K and V block-major,
`[B, capacity, H, T, D]` each, in host memory (pinned when CUDA is present), grown by doubling, so a run of
blocks is one contiguous host -> device copy and one block one contiguous write. What moves to the device is
what the engine's offload moves: every host block (exact; `stage` starts the copy ahead, on the caller's
prefetch stream) or each KV head's pages picked and gathered as the engine's fetch area does
(`offload.pages.pick_pages`, `gather_pages`) over the summaries kept here (sparse: per-page key min / max / mean on
the device, `page_summary`).

Why a store of its own, not the engine's slots (`[S, L, 2, H, T, D]`, one encoded block per slot): a slot is a
whole block of every layer under a checksummed, key-bound header, what the DRAM tier stores and writes through;
transformers hands a cache one layer at a time, so a block leaves layer l's window L times before it is whole and
could be encoded, and a slot holds one sequence (exact takes a batch and beam search reorders it). And in the
slots' layout one layer of n blocks is n strided pieces: the exact path's one contiguous copy per layer (staged on
a side stream while the previous layer computes) would become a host-side pack first. So the layouts differ by
what each path reads in one go; what both do with their blocks is the same code (`offload.pages`: summaries,
the pick, the gather).
"""

from __future__ import annotations

import torch

from kvtier.offload.config import PAGE_SUMMARY_VECTORS
from kvtier.offload.pages import gather_pages, page_summary, pick_pages


class HostKV:
    """Host blocks [0, num_blocks) of one layer; `summaries` [capacity, T / P, H, 3, D] on `device` (sparse)."""

    def __init__(self, block_tokens: int, page_tokens: int, sparse: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.block_tokens, self.page_tokens, self.sparse = block_tokens, page_tokens, sparse
        self.pages_per_block = block_tokens // page_tokens
        self.device, self.dtype = device, dtype
        self.num_blocks = 0
        self.k: torch.Tensor | None = None  # [B, capacity, H, T, D]
        self.v: torch.Tensor | None = None
        self.summaries: torch.Tensor | None = None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def clear(self) -> None:
        """Empty, keeping the buffers for the next request."""
        self.num_blocks = 0
        self._staged = None

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k[:, :self.num_blocks].nbytes

    def summary_bytes(self) -> int:
        return self.summaries[:self.num_blocks].nbytes if self.summaries is not None else 0

    # -- writing ----------------------------------------------------------------------------------
    def reserve(self, num_blocks: int, batch: int, num_kv_heads: int, head_dim: int) -> None:
        """Room for `num_blocks` blocks (and their summaries) without reallocating later."""
        if num_blocks <= self.capacity:
            return
        shape = (batch, num_blocks, num_kv_heads, self.block_tokens, head_dim)
        pin = torch.cuda.is_available()
        k, v = (torch.empty(shape, dtype=self.dtype, pin_memory=pin) for _ in range(2))
        n = self.num_blocks
        if n:
            k[:, :n].copy_(self.k[:, :n])
            v[:, :n].copy_(self.v[:, :n])
        self.k, self.v = k, v
        if self.sparse:
            summaries = torch.empty((num_blocks, self.pages_per_block, num_kv_heads, PAGE_SUMMARY_VECTORS, head_dim),
                                    dtype=self.dtype, device=self.device)
            if n:
                summaries[:n] = self.summaries[:n]
            self.summaries = summaries

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H, j T, D] (full blocks, on the device) -> host blocks num_blocks .. num_blocks + j - 1."""
        b, h, num_tokens, d = k.shape
        j, first = num_tokens // self.block_tokens, self.num_blocks
        if first + j > self.capacity:
            self.reserve(max(first + j, 2 * self.capacity), b, h, d)
        blocks_k = k.unflatten(2, (j, self.block_tokens)).transpose(1, 2)  # [B, j, H, T, D]
        self.k[:, first:first + j].copy_(blocks_k)
        self.v[:, first:first + j].copy_(v.unflatten(2, (j, self.block_tokens)).transpose(1, 2))
        if self.summaries is not None:
            self.summaries[first:first + j] = page_summary(blocks_k[0], self.page_tokens)
        self.num_blocks += j

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Host block `index` of batch row 0 from k, v [H, T, D] (a restored block; after `reserve`)."""
        self.k[0, index].copy_(k)
        self.v[0, index].copy_(v)

    def restored(self, num_blocks: int) -> None:
        """The first `num_blocks` blocks were written (`write`): they count, their pages get their summaries."""
        self.num_blocks, self._staged = num_blocks, None
        if self.summaries is not None and num_blocks:
            self.summaries[:num_blocks] = page_summary(self.k[0, :num_blocks].to(self.device), self.page_tokens)

    def block(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host block `index` of batch row 0: K, V [H, T, D] (host memory)."""
        return self.k[0, index], self.v[0, index]

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: the host blocks follow their beams."""
        if self.k is None:
            return
        self.k, self.v = (host.index_select(0, beam_idx.cpu()) for host in (self.k, self.v))
        if torch.cuda.is_available():
            self.k, self.v = self.k.pin_memory(), self.v.pin_memory()
        self._staged = None

    # -- reading ----------------------------------------------------------------------------------
    def stage(self, device: torch.device) -> None:
        """Start copying every host block to `device` (exact; on the caller's prefetch stream)."""
        if self.num_blocks:
            n = self.num_blocks
            self._staged = (self.k[:, :n].to(device, non_blocking=True), self.v[:, :n].to(device, non_blocking=True))

    def fetch(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host blocks [0, num_blocks) on the device, [B, n, H, T, D] each: the staged copy when it has them."""
        staged, self._staged = self._staged, None
        if staged is not None and staged[0].shape[1] == num_blocks:
            if self.device.type == "cuda":  # made on the prefetch stream, read and freed on this one
                for tensor in staged:
                    tensor.record_stream(torch.cuda.current_stream(self.device))
            return staged
        return (self.k[:, :num_blocks].to(self.device, non_blocking=True),
                self.v[:, :num_blocks].to(self.device, non_blocking=True))

    def pick(self, query: torch.Tensor, num_fetched: int, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Sparse, batch row 0: each KV head's `num_fetched` best pages for `query` [H, group, D] (after RoPE), in
        context order, into out_k, out_v [H, num_fetched P, D] (on the device): the engine's pick and gather
        (`pages.pick_pages`, `pages.gather_pages`) over this layer's blocks."""
        blocks, pages = pick_pages(self.summaries[:self.num_blocks], query, num_fetched, self.pages_per_block)
        for host, out in ((self.k, out_k), (self.v, out_v)):
            gather_pages(host[0], blocks, pages, self.page_tokens, out)
