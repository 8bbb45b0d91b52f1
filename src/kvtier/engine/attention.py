"""Attention over the paged device arena, plugged into transformers' `AttentionInterface`.

The engine runs one flat batch per step: the new tokens of every scheduled sequence concatenated
into `[1, N]`. The runner builds one `AttentionMetadata` per step (slot mapping, query ranges,
sequence lengths, block tables, as vLLM's attention metadata); each attention layer calls
`paged_attention`, which hands it to the step's `AttentionBackend`. `SDPABackend` — the CPU path,
correct on any device — writes the new K/V into their slots of the arena (`kvtier.engine.arena`:
raw or quantized) and runs SDPA per sequence over that sequence's gathered context at full
precision (a causal mask offset by the tokens already computed). A paged CUDA kernel would be
another backend reading the same metadata, with no gather and no change to the scheduler.
The model module tree used here is a copy that shares the weights (`paged_model`), so the caller's
model keeps its own attention implementation.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvtier.engine.offload import OffloadAttention, SeqOffload

ATTN_IMPLEMENTATION = "kvtier_paged"


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention inputs, built once by the runner; backends read nothing else."""

    slot_block_ids: torch.Tensor   # [N] block of each new token; with slot_offsets, the slot mapping
    slot_offsets: torch.Tensor     # [N] its offset inside the block
    query_start_loc: list[int]     # [S + 1] sequence s owns rows query_start_loc[s]:query_start_loc[s + 1]
    seq_lens: list[int]            # [S] tokens each sequence attends to after this step (its context)
    block_tables: list[torch.Tensor]  # [S] its block ids, as many as its context needs (-1: in host memory)
    offloads: list[SeqOffload | None] = field(default_factory=list)  # [S] offloaded sequences' host blocks

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
        loc = meta.query_start_loc
        offloads = meta.offloads or [None] * meta.num_seqs
        self._seqs = []
        for i, (table, n, off) in enumerate(zip(meta.block_tables, meta.seq_lens, offloads)):
            if off is None:
                self._seqs.append(SeqSlice(loc[i], loc[i + 1], self.arena.context_index(table, n), n))
            else:  # the device window only; the host blocks come through the fetch area
                index = self.arena.context_index(table, off.key_positions.numel(), off.key_positions)
                self._seqs.append(SeqSlice(loc[i], loc[i + 1], index, off.key_positions.numel(), off))
        self.arena.begin_step(self._seqs)
        if self.offload is not None:
            self.offload.plan(offloads)

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float | None) -> torch.Tensor:
        # query: [1, Hq, N, D]; key/value: [1, H, N, D]
        self.arena.write(layer, meta.slot_block_ids, meta.slot_offsets, key[0].transpose(0, 1),  # [N, H, D]
                         value[0].transpose(0, 1))
        num_heads = key.shape[1]
        out = torch.empty_like(query)
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
        return out

    def end_step(self) -> None:
        self._seqs = []
        self.arena.end_step()
        if self.offload is not None:
            self.offload.fetch.end()


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
