"""Attention over the paged device arena, plugged into transformers' `AttentionInterface`.

The engine runs one flat batch per step: the new tokens of every scheduled sequence concatenated
into `[1, N]`. Each attention layer calls `paged_attention`, which writes the new K/V into their
slots of the arena and runs SDPA per sequence over that sequence's gathered blocks (a causal mask
offset by the tokens already computed). The model module tree used here is a copy that shares the
weights (`paged_model`), so the caller's model keeps its own attention implementation.
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
    kv_index: torch.Tensor     # [H * context] rows of a layer's cache viewed as [num_blocks * H * T, D]
    context_tokens: int        # tokens attended to: already computed + this step's


@dataclass(slots=True)
class PagedBatch:
    k_cache: torch.Tensor      # [L, num_blocks, H, T, D]
    v_cache: torch.Tensor
    slot_block_ids: torch.Tensor  # [N] block of each new token
    slot_offsets: torch.Tensor    # [N] offset inside its block
    seqs: list[SeqSlice]


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, kvtier_batch: PagedBatch | None = None,
                    **kwargs):
    # query: [1, Hq, N, D]; key/value: [1, H, N, D]
    assert kvtier_batch is not None, "paged_attention runs only inside the kvtier engine"
    batch = kvtier_batch
    k_cache, v_cache = batch.k_cache[module.layer_idx], batch.v_cache[module.layer_idx]  # [B, H, T, D]
    k_cache[batch.slot_block_ids, :, batch.slot_offsets] = key[0].transpose(0, 1)  # [N, H, D]
    v_cache[batch.slot_block_ids, :, batch.slot_offsets] = value[0].transpose(0, 1)
    num_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    k_rows, v_rows = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    out = torch.empty_like(query)
    for s in batch.seqs:
        # one gather straight into [H, context, D] (no block-then-transpose double copy)
        k = k_rows.index_select(0, s.kv_index).view(num_heads, s.context_tokens, head_dim)
        v = v_rows.index_select(0, s.kv_index).view(num_heads, s.context_tokens, head_dim)
        q = query[:, :, s.q_start:s.q_end]
        num_q = s.q_end - s.q_start
        mask = None
        if num_q > 1:  # query i sits at position context - num_q + i
            q_pos = torch.arange(s.context_tokens - num_q, s.context_tokens, device=q.device)
            mask = torch.arange(s.context_tokens, device=q.device)[None, :] <= q_pos[:, None]
        out[:, :, s.q_start:s.q_end] = F.scaled_dot_product_attention(
            q, k[None], v[None], attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != num_heads)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def kv_index(block_table: torch.Tensor, context_tokens: int, num_heads: int, block_tokens: int) -> torch.Tensor:
    """Row (h, p) of the flat `[num_blocks * H * T, D]` view for every head h and position p < context."""
    pos = torch.arange(context_tokens, device=block_table.device)
    blocks = block_table[pos // block_tokens]                                  # [context]
    heads = torch.arange(num_heads, device=block_table.device)[:, None]
    return ((blocks[None, :] * num_heads + heads) * block_tokens + pos % block_tokens).reshape(-1)


def paged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s module tree (and config) sharing its weights, using `paged_attention`."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    clone.config._attn_implementation = ATTN_IMPLEMENTATION
    return clone.eval()
