"""Sparse offload's page selection (Quest): a summary of each page's keys, each page's score for a decode
query, the top pages of each KV head. The engine, `TieredCache` (`hf_offload`) and the sparse eval pick with these."""

from __future__ import annotations

import torch

# a page's score: this much of Quest's bound, the rest the query against the page's mean key
# (docs/benchmarks/quality.md, issue 18: over 3 windows at sparse:1/8, Quest's bound alone +2.44% ppl at 4k /
# +2.29% at 8k, the mean alone +2.77 / +2.30%, half and half +1.93 / +0.91% — an oracle ranking pages by
# attention mass +1.51 / +0.98%)
BOUND_WEIGHT = 0.5


def page_summary(k_block: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """k_block [L, H, T, D] -> [L, T / P, H, 3, D]: per-channel min, max (Quest's box) and mean over each page
    of P tokens (`config.PAGE_SUMMARY_VECTORS` vectors)."""
    l, h, t, d = k_block.shape
    pages = k_block.reshape(l, h, t // page_tokens, page_tokens, d).transpose(1, 2)  # [L, pages, H, P, D]
    return torch.stack([pages.amin(dim=3), pages.amax(dim=3), pages.mean(dim=3)], dim=3)


def quest_scores(summary: torch.Tensor, q: torch.Tensor, bound_weight: float = BOUND_WEIGHT) -> torch.Tensor:
    """Each page's score: summary [n, H, 3, D] (key min, max, mean), q [H, G, D] (a KV head's group of query
    heads, one query) -> [n, H], for each KV head the largest in its group of
    `bound_weight` x Quest's bound of q.k over the page (the most any of its keys can score)
    + (1 - bound_weight) x q . its mean key (what its keys score on average)."""
    bound = torch.maximum(q[None] * summary[:, :, None, 0], q[None] * summary[:, :, None, 1]).sum(-1)  # [n, H, G]
    if bound_weight != 1.0:
        mean = (q[None] * summary[:, :, None, 2]).sum(-1)
        bound = bound_weight * bound + (1.0 - bound_weight) * mean
    return bound.amax(-1)


def select_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best of each KV head, scores [n, H] -> indices [k, H] in context order."""
    return scores.topk(k, dim=0).indices.sort(dim=0).values


def select_pages(summaries: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """The pick over n blocks' pages: summaries [n, pages, H, 3, D] (`page_summary` of each block),
    q [H, G, D] -> the k best pages of each KV head [k, H] in context order, as block * pages + page."""
    n, pages = summaries.shape[:2]
    return select_blocks(quest_scores(summaries.reshape(n * pages, *summaries.shape[2:]), q), k)


def pick_pages(summaries: torch.Tensor, q: torch.Tensor, k: int, pages_per_block: int) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """A sparse decode's pick as host metadata, for whoever reads the pages (the engine's fetch area and its reads
    in place, `HostKV`): `select_pages` over the n blocks' summaries [n, pages, H, 3, D], split into each KV head's
    blocks [k, H] (indices into the n blocks) and the page in each block [k, H], CPU tensors in context order (on
    CUDA the read-back is the one sync a sparse layer pays: the host addresses the pages)."""
    top = select_pages(summaries, q, k).cpu()
    return top // pages_per_block, top % pages_per_block


def gather_pages(src: torch.Tensor, blocks: torch.Tensor, pages: torch.Tensor, page_tokens: int,
                 out: torch.Tensor) -> torch.Tensor:
    """The gather of a pick, on the host: src [S, H, T, D] (K or V of one layer's host blocks; each head's T x D
    rows contiguous, any stride between blocks), blocks, pages [k, H] (CPU: head h's j-th page is page
    `pages[j, h]` of block `blocks[j, h]`) -> out [H, k P, D] (any device; each head's pages in order), returned.
    One indexing op and one copy: the same pages whichever store holds the blocks (`FetchArea`'s DRAM slots,
    `HostKV`'s layer buffers)."""
    heads = torch.arange(src.shape[1])[:, None]
    picked = src.unflatten(2, (-1, page_tokens))[blocks.T, heads, pages.T]  # [H, k, P, D]
    out.unflatten(1, (blocks.shape[0], page_tokens)).copy_(picked)
    return out
