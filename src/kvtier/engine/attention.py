"""Attention over the paged device arena, plugged into transformers' `AttentionInterface`.

The engine runs one flat batch per step: the new tokens of every scheduled sequence concatenated
into `[1, N]`. The runner builds one `AttentionMetadata` per step (slot mapping, query ranges,
sequence lengths, block tables — as lists and as the tensors a kernel reads, vLLM's attention
metadata); each attention layer calls `paged_attention`, which hands it to the step's
`AttentionBackend`. Both backends first write the new K/V into their slots of the arena
(`kvtier.engine.arena`: raw or quantized).

- `PagedBackend` (a raw arena on the CPU, when `paged_kernel` could be built): one call per layer of
  `paged_kernel.paged_attention` over the step's decodes and prefill chunks together, reading keys and
  values where they sit in the arena (block tables, no gather). An offloaded sequence goes its own way
  (`OffloadAttention`). Long prefill chunks went through SDPA over their gathered context until the kernel's
  vectorized softmax made it faster for them too (`GATHER_MIN_QUERIES`, docs/benchmarks/engine-attention.md).
- `SDPABackend` — correct on any device and for every arena — gathers each sequence's context at full
  precision and runs SDPA per sequence (a causal mask offset by the tokens already computed).

A paged CUDA kernel would be another backend reading the same metadata, with no change to the
scheduler. The model module tree used here is a copy that shares the weights (`paged_model`), so the
caller's model keeps its own attention implementation.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvtier.engine import paged_kernel
from kvtier.offload.attention import OffloadAttention, SeqOffload

ATTN_IMPLEMENTATION = "kvtier_paged"

# a prefill chunk of this many queries or more attends through SDPA over its gathered context; None: none does.
# Measured 2026-12-07 (docs/benchmarks/engine-attention.md): the kernel is 1.1-1.8x (fp32) and 1.9-3.4x (bf16) faster
# than gather + SDPA for chunks of 64-512 queries at 0.5k-8k tokens, an 8k prompt's TTFT 23.3 vs 27.0 s. A knob
# for tests and for a backend whose kernel is slower on long chunks.
GATHER_MIN_QUERIES: int | None = None

PAGED_CODECS = ("raw", "fp8", "int8")  # arenas the paged kernel reads (`arena.paged_kv`)


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention inputs, built once by the runner; backends read nothing else."""

    slot_block_ids: torch.Tensor   # [N] block of each new token; with slot_offsets, the slot mapping
    slot_offsets: torch.Tensor     # [N] its offset inside the block
    query_start_loc: list[int]     # [S + 1] sequence s owns rows query_start_loc[s]:query_start_loc[s + 1]
    seq_lens: list[int]            # [S] tokens each sequence attends to after this step (its context)
    block_tables: list[torch.Tensor]  # [S] its block ids, as many as its context needs (-1: in host memory)
    offloads: list[SeqOffload | None] = field(default_factory=list)  # [S] offloaded sequences' host blocks
    # the same as tensors, for a kernel (int64): [S, max blocks] padded with 0 (never read), [S], [S + 1]
    block_table: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None
    query_start_loc_tensor: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(Protocol):
    def begin_step(self, meta: AttentionMetadata) -> None: ...
    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float | None) -> torch.Tensor: ...
    def end_step(self) -> None: ...   # also after a failed forward


@dataclass(slots=True)
class SeqSlice:
    q_start: int               # rows of this sequence in the flat batch
    q_end: int
    index: torch.Tensor        # the arena's `context_index` of this sequence's block table
    context_tokens: int        # tokens attended to on the device: already computed + this step's
    offload: SeqOffload | None = None  # an offloaded sequence: the rest of its context is in host memory


class SDPABackend:
    """Write the step's K/V into the arena, gather each sequence's context at full precision, SDPA."""

    def __init__(self, arena, offload: OffloadAttention | None = None) -> None:
        self.arena = arena
        self.offload = offload
        self._seqs: list[SeqSlice] = []

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._begin(meta, range(meta.num_seqs))

    def _begin(self, meta: AttentionMetadata, seq_ids, planned_ids=()) -> None:
        """Plan the gathers of the sequences `seq_ids`; a quantized arena also plans (dequantizes) the
        blocks of `planned_ids` (sequences a kernel reads from the arena's `paged_kv`)."""
        self._seqs = [self._slice(meta, i) for i in seq_ids]
        self.arena.begin_step(self._seqs + [self._slice(meta, i) for i in planned_ids])
        if self.offload is not None:
            self.offload.plan(meta.offloads or [None] * meta.num_seqs)

    def _slice(self, meta: AttentionMetadata, i: int) -> SeqSlice:
        loc, table, n = meta.query_start_loc, meta.block_tables[i], meta.seq_lens[i]
        off = meta.offloads[i] if meta.offloads else None
        if off is None:
            return SeqSlice(loc[i], loc[i + 1], self.arena.context_index(table, n), n)
        # the device window only; the host blocks come through the fetch area
        index = self.arena.context_index(table, off.key_positions.numel(), off.key_positions)
        return SeqSlice(loc[i], loc[i + 1], index, off.key_positions.numel(), off)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float | None) -> torch.Tensor:
        # query: [1, Hq, N, D]; key/value: [1, H, N, D]
        self._write(layer, key, value, meta)
        out = torch.empty_like(query)
        self._attend_gathered(layer, query, out, key.shape[1], scaling)
        return out

    def _write(self, layer: int, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata) -> None:
        self.arena.write(layer, meta.slot_block_ids, meta.slot_offsets, key[0].transpose(0, 1),  # [N, H, D]
                         value[0].transpose(0, 1))

    def _attend_gathered(self, layer: int, query: torch.Tensor, out: torch.Tensor, num_heads: int,
                         scaling: float | None) -> None:
        """out[0, :, rows of s] for each planned sequence s; out: [1, Hq, N, D] (any strides)."""
        for s in self._seqs:
            if s.offload is not None:
                (_, _, k, v), = self.arena.gather(layer, s)
                q = query[0, :, s.q_start:s.q_end]  # [Hq, n, D]
                scale = scaling if scaling is not None else q.shape[-1] ** -0.5
                out[0, :, s.q_start:s.q_end] = self.offload.forward(layer, q, k, v, s.offload, scale)
                continue
            for lo, hi, k, v in self.arena.gather(layer, s):  # k, v: [H, context of the group's last query, D]
                q = query[:, :, s.q_start + lo:s.q_start + hi]
                num_q, context = hi - lo, k.shape[1]
                mask = None
                if num_q > 1:  # query i sits at position context - num_q + i
                    q_pos = torch.arange(context - num_q, context, device=q.device)
                    mask = torch.arange(context, device=q.device)[None, :] <= q_pos[:, None]
                out[:, :, s.q_start + lo:s.q_start + hi] = F.scaled_dot_product_attention(
                    q, k[None], v[None], attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != num_heads)

    def end_step(self) -> None:
        self._seqs = []
        self.arena.end_step()
        if self.offload is not None:
            self.offload.fetch.end()


@dataclass(slots=True)
class PagedSeqs:
    """The sequences of a step that the paged kernel serves: its metadata tensors, rows of the step's."""

    block_table: torch.Tensor  # [S', max blocks]
    seq_lens: torch.Tensor     # [S']
    query_start: torch.Tensor  # [S'] first row of each in the flat batch
    query_lens: torch.Tensor   # [S']


class PagedBackend(SDPABackend):
    """The arena read in place: the step's decodes and prefill chunks in one `paged_kernel` call per layer;
    offloaded sequences (and prefill chunks of at least `gather_min_queries`, if set) as `SDPABackend` does. A raw
    arena is read where it is; fp8/int8 arenas from the step's blocks dequantized once per layer (as the
    gathers read them)."""

    def __init__(self, arena, offload: OffloadAttention | None = None,
                 gather_min_queries: int | None = GATHER_MIN_QUERIES) -> None:
        super().__init__(arena, offload)
        assert arena.codec in PAGED_CODECS and arena.device.type == "cpu", "the paged kernel reads CPU arenas"
        self.gather_min_queries = gather_min_queries
        self._paged: PagedSeqs | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        loc, n = meta.query_start_loc, meta.num_seqs
        offloads = meta.offloads or [None] * n
        long = self.gather_min_queries
        gathered = [i for i in range(n)
                    if offloads[i] is not None or (long is not None and loc[i + 1] - loc[i] >= long)]
        paged_ids = sorted(set(range(n)) - set(gathered))
        self._begin(meta, gathered, paged_ids if self.arena.codec != "raw" else ())
        self._paged = None
        if paged_ids:
            starts, ends = meta.query_start_loc_tensor[:-1], meta.query_start_loc_tensor[1:]
            paged = PagedSeqs(meta.block_table, meta.seq_lens_tensor, starts, ends - starts)
            if gathered:  # the kernel's rows only
                keep = torch.tensor(paged_ids, dtype=torch.long)
                paged = PagedSeqs(*(t.index_select(0, keep).contiguous() for t in
                                    (paged.block_table, paged.seq_lens, paged.query_start, paged.query_lens)))
            paged.block_table = self.arena.paged_table(paged.block_table)
            self._paged = paged

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float | None) -> torch.Tensor:
        # query: [1, Hq, N, D]; key/value: [1, H, N, D]
        self._write(layer, key, value, meta)
        # out as [1, N, Hq, D] in memory, returned as the [1, Hq, N, D] view paged_attention expects:
        # its transpose back is then free
        out = torch.empty((1, query.shape[2], query.shape[1], query.shape[3]), dtype=torch.float32,
                          device=query.device).transpose(1, 2)
        q = query if query.dtype == torch.float32 else query.float()
        if self._paged is not None:
            p = self._paged
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            k, v = self.arena.paged_kv(layer)
            paged_kernel.paged_attention(out[0].transpose(0, 1), q[0].transpose(0, 1), k, v, p.block_table,
                                         p.seq_lens, p.query_start, p.query_lens, scale)
        self._attend_gathered(layer, query, out, key.shape[1], scaling)
        return out if query.dtype == torch.float32 else out.to(query.dtype)

    def end_step(self) -> None:
        self._paged = None
        super().end_step()


def make_backend(arena, offload: OffloadAttention | None = None) -> AttentionBackend:
    """The paged kernel where it reads this arena (raw, fp8, int8 on the CPU) and could be built; else the
    gather path (KIVI's open blocks are read exact per query group: `KiviArena._groups`)."""
    if arena.codec in PAGED_CODECS and arena.device.type == "cpu" and paged_kernel.available():
        return PagedBackend(arena, offload)
    return SDPABackend(arena, offload)


@dataclass(slots=True)
class PagedStep:
    """What rides through the model's forward kwargs to every attention layer."""

    backend: AttentionBackend
    meta: AttentionMetadata


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, kvtier_step: PagedStep | None = None,
                    **kwargs):
    assert kvtier_step is not None, "paged_attention runs only inside the kvtier engine"
    out = kvtier_step.backend.forward(module.layer_idx, query, key, value, kvtier_step.meta, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def paged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree (and config) sharing its weights, using `paged_attention`."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    clone.config._attn_implementation = ATTN_IMPLEMENTATION
    return clone.eval()
