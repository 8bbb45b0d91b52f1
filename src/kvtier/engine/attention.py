"""Attention over the paged device arena, plugged into transformers' `AttentionInterface`.

The engine runs one flat batch per step: the new tokens of every scheduled sequence concatenated
into `[1, N]`. Each attention layer calls `paged_attention`, which writes the new K/V into their
slots of the arena (`kvtier.engine.arena`: raw or quantized) and runs SDPA per sequence over that
sequence's gathered context at full precision (a causal mask offset by the tokens already computed).
The model module tree used here is a copy that shares the weights (`paged_model`), so the caller's
model keeps its own attention implementation.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "kvtier_paged"


@dataclass(slots=True)
class SeqSlice:
    q_start: int               # rows of this sequence in the flat batch
    q_end: int
    index: torch.Tensor        # the arena's `context_index` of this sequence's block table
    context_tokens: int        # tokens attended to: already computed + this step's


@dataclass(slots=True)
class PagedBatch:
    arena: object              # a `kvtier.engine.arena` arena
    slot_block_ids: torch.Tensor  # [N] block of each new token
    slot_offsets: torch.Tensor    # [N] offset inside its block
    seqs: list[SeqSlice]


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, kvtier_batch: PagedBatch | None = None,
                    **kwargs):
    # query: [1, Hq, N, D]; key/value: [1, H, N, D]
    assert kvtier_batch is not None, "paged_attention runs only inside the kvtier engine"
    batch, layer = kvtier_batch, module.layer_idx
    batch.arena.write(layer, batch.slot_block_ids, batch.slot_offsets, key[0].transpose(0, 1),  # [N, H, D]
                      value[0].transpose(0, 1))
    num_heads = key.shape[1]
    out = torch.empty_like(query)
    for s in batch.seqs:
        for lo, hi, k, v in batch.arena.gather(layer, s):  # k, v: [H, context of the group's last query, D]
            q = query[:, :, s.q_start + lo:s.q_start + hi]
            num_q, context = hi - lo, k.shape[1]
            mask = None
            if num_q > 1:  # query i sits at position context - num_q + i
                q_pos = torch.arange(context - num_q, context, device=q.device)
                mask = torch.arange(context, device=q.device)[None, :] <= q_pos[:, None]
            out[:, :, s.q_start + lo:s.q_start + hi] = F.scaled_dot_product_attention(
                q, k[None], v[None], attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != num_heads)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def paged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree (and config) sharing its weights, using `paged_attention`."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    clone.config._attn_implementation = ATTN_IMPLEMENTATION
    return clone.eval()
