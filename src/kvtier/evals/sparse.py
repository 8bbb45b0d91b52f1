"""Sparse offload in `kvtier eval`: the engine's decode-step block selection, over a full cache.

The engine (`kvtier/offload/`) keeps an offloaded sequence's first `sink_blocks` blocks and its last
`recent_blocks` (the open block and the one before it) on the device, every full block in between in
host memory; a block is pages of `page_tokens` (`EngineConfig.offload_page_tokens`, at most the block). At a
decode step, for each layer and KV head, it scores the host pages (`quest_scores` of the post-RoPE query
against each page's per-channel key min/max/mean, `page_summary`: half Quest's bound, half the mean key's
score) and attends to the sinks, the
recent window and the top `OffloadMode.num_fetched(n)` of its n host pages (`select_pages`). Prefill chunks
are exact, and so is a step whose budget covers every host page.

Here the same selection runs in an attention function registered in transformers' `AttentionInterface`
over a normal `DynamicCache` that holds every token: a single-query pass masks out the host pages that
were not selected, which is the attention over sinks + recent + the fetched pages — the engine's output
up to float rounding (the engine merges its pieces by log-sum-exp). Passes of several tokens (a prefill,
the passkey cue) are exact, as in the engine. The functions are imported from the engine, not copied,
so the quality measured here is the engine's.

    window = SparseWindow(parse_offload("sparse:1/8"))   # the engine's default layout (its pages too)
    model_s = sparse_model(model, window)            # shares the weights; stats in model_s.config
    model_s(ids, past_key_values=DynamicCache(...))  # decode steps one token at a time
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvtier.blocks import DEFAULT_BLOCK_TOKENS  # noqa: F401 — the eval's defaults
from kvtier.offload.config import (DEFAULT_OFFLOAD_PAGE_TOKENS, DEFAULT_RECENT_BLOCKS,  # noqa: F401
                                   DEFAULT_SINK_BLOCKS, OffloadConfig)
from kvtier.offload.pages import page_summary, select_pages

ATTN_IMPLEMENTATION = "kvtier_sparse_eval"
DEFAULT_BUDGETS = "1/32,1/16,1/8,1/4"


# the layout the engine runs by default (`OffloadConfig`'s defaults): what the eval measures unless told otherwise
# (DEFAULT_BLOCK_TOKENS, DEFAULT_SINK_BLOCKS and DEFAULT_RECENT_BLOCKS, imported above)
DEFAULT_PAGE_TOKENS = DEFAULT_OFFLOAD_PAGE_TOKENS

# the engine's offload layout (mode, block_tokens, sink_blocks, recent_blocks, page_tokens): its own settings type
SparseWindow = OffloadConfig


@dataclass(slots=True)
class SparseStats:
    """What the decode steps attended to, summed over steps (pages: over layers and KV heads too)."""

    num_decode_steps: int = 0
    num_host_pages: int = 0       # layer-head-pages in host memory (what `exact` would fetch)
    num_fetched_pages: int = 0    # layer-head-pages attended to from host memory (fetched)
    num_context_tokens: int = 0   # per step: the context
    num_attended_tokens: int = 0  # per step: sinks + recent + the fetched pages' tokens (one head)


@dataclass(slots=True)
class SparseDecode:
    """What a sparse model's config carries to the attention function."""

    window: SparseWindow
    stats: SparseStats = field(default_factory=SparseStats)


def decode_mask(window: SparseWindow, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor | None, int, int]:
    """One decode step: query [1, Hq, 1, D] (post-RoPE), key [1, H, S, D] (the whole context, this token
    last) -> (mask [1, Hq, 1, S], True where the step attends, or None: everything; host pages n; fetched k)."""
    first, end = window.host_blocks(key.shape[2])
    t, p, (_, h, s, d) = window.block_tokens, window.page_tokens, key.shape
    n = (end - first) * (t // p)
    k = window.mode.num_fetched(n)
    if k >= n:  # the engine attends to every host page (exact)
        return None, n, n
    host_keys = key[0, :, first * t:end * t].reshape(h, end - first, t, d).transpose(0, 1)  # [blocks, H, T, D]
    q = query[0, :, 0].reshape(h, -1, d)                                                     # [H, G, D]
    top = select_pages(page_summary(host_keys, p), q, k)                                     # [k, H]
    pages = torch.ones(h, -(-s // p), dtype=torch.bool, device=key.device)                 # [H, pages]
    pages[:, first * t // p:end * t // p] = False
    pages.scatter_(1, (top + first * t // p).T, True)
    mask = pages.repeat_interleave(p, dim=1)[:, :s]                                        # [H, S]
    return mask.repeat_interleave(query.shape[1] // h, dim=0)[None, :, None], n, k


def sparse_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention: query [B, Hq, q, D], key/value [B, H, S, D] -> ([B, q, Hq, D], None)."""
    decode: SparseDecode = module.config.kvtier_sparse
    if query.shape[2] != 1:  # a prefill (or the cue): exact, as in the engine
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    assert query.shape[0] == 1, "sparse eval attention runs one sequence"
    mask, n, k = decode_mask(decode.window, query, key)
    _count(decode, module.layer_idx, key, n, k)
    if mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _count(decode: SparseDecode, layer: int, key: torch.Tensor, n: int, k: int) -> None:
    stats, h, s = decode.stats, key.shape[1], key.shape[2]
    stats.num_host_pages += n * h
    stats.num_fetched_pages += k * h
    if layer == 0:
        stats.num_decode_steps += 1
        stats.num_context_tokens += s
        stats.num_attended_tokens += s - (n - k) * decode.window.page_tokens


AttentionInterface.register(ATTN_IMPLEMENTATION, sparse_attention)
# the exact passes need SDPA's causal mask: without a registered mask function transformers passes none, and
# SDPA's is_causal aligns a multi-token pass over a filled cache (the passkey cue) to the first keys
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def sparse_model(model: torch.nn.Module, window: SparseWindow) -> torch.nn.Module:
    """A copy of `model`'s module tree (and config) sharing its weights, attending as the engine's sparse
    offload does; its `config.kvtier_sparse` (a `SparseDecode`) counts what the decode steps attended to."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, memo)
    clone.config._attn_implementation = ATTN_IMPLEMENTATION
    clone.config.kvtier_sparse = SparseDecode(window)
    return clone.eval()
