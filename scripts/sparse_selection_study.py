"""Which page selection should sparse offload use? (issue 18; docs/benchmarks/quality.md, "Scoring pages").

`kvtier eval`'s perplexity protocol (3 windows of tinyshakespeare, the last 128 tokens of each scored one per
decode step; the engine's layout: 256-token blocks, 1 sink block, 2 recent) with the selection swapped per
policy at an equal budget (1/8 of the host pages per layer and KV head), so the policies differ only in how
they rank pages. One prefill per window is shared by every policy. `oracle` ranks pages by the attention mass
the step's queries actually give them (the most a ranking could know; not buildable without reading every key).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/sparse_selection_study.py quest,mean,questmean,oracle 4096,8192 out.json
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvtier import models
from kvtier.data import shared_data_file
from kvtier.offload.pages import select_blocks
from kvtier.evals.perplexity import score_continuation, text_windows
from kvtier.evals.runner import fill, prefill

BLOCK, SINK, SCORED, WINDOWS = 256, 1, 128, 3
POLICIES = {  # score: how pages are ranked; page: tokens; recent: recent blocks on the device; w: bound's weight
    "quest": dict(score="blend", w=1.0, page=32, recent=2),        # Quest's bound (the selection until now)
    "quest-sum": dict(score="quest-sum", page=32, recent=2),       # ... summed over the group, not its max
    "mean": dict(score="blend", w=0.0, page=32, recent=2),         # q . the page's mean key
    "questmean": dict(score="blend", w=0.5, page=32, recent=2),    # half and half (the engine's now)
    "questmean-w0.25": dict(score="blend", w=0.25, page=32, recent=2),
    "questmean-w0.75": dict(score="blend", w=0.75, page=32, recent=2),
    "center-a0.5": dict(score="center", alpha=0.5, page=32, recent=2),  # box center + half Quest's slack
    "center-a0.25": dict(score="center", alpha=0.25, page=32, recent=2),
    "center-a0": dict(score="center", alpha=0.0, page=32, recent=2),
    "oracle": dict(score="oracle", page=32, recent=2),
    "quest-r3": dict(score="blend", w=1.0, page=32, recent=3),
    "quest-p16": dict(score="blend", w=1.0, page=16, recent=2),
    "quest-dense2": dict(score="blend", w=1.0, page=32, recent=2, dense_layers=2),  # layers 0-1 whole, the rest less
}
STATE: dict = {"policy": None, "fetched": 0, "host": 0}


def page_scores(policy: dict, q: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """q [H, G, D], pages [H, n, P, D] -> [n, H]."""
    lo, hi = pages.amin(2), pages.amax(2)  # [H, n, D]
    kind = policy["score"]
    if kind == "oracle":
        h, n, p, d = pages.shape
        probs = torch.softmax(torch.einsum("hgd,htd->hgt", q, pages.reshape(h, n * p, d)) / math.sqrt(d), -1)
        return probs.reshape(h, -1, n, p).sum(-1).amax(1).T
    if kind == "center":
        s = (torch.einsum("hgd,hnd->nhg", q, (lo + hi) / 2)
             + policy["alpha"] * torch.einsum("hgd,hnd->nhg", q.abs(), (hi - lo) / 2))
        return s.amax(-1)
    bound = torch.maximum(torch.einsum("hgd,hnd->nhgd", q, lo), torch.einsum("hgd,hnd->nhgd", q, hi)).sum(-1)
    if kind == "quest-sum":
        return bound.sum(-1)
    mean = torch.einsum("hgd,hnd->nhg", q, pages.mean(2))
    return (policy["w"] * bound + (1 - policy["w"]) * mean).amax(-1)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    policy = STATE["policy"]
    h, s, d = key.shape[1], key.shape[2], key.shape[3]
    first, end = SINK, max(SINK, -(-s // BLOCK) - (policy or {}).get("recent", 0))
    if query.shape[2] != 1 or policy is None or end <= first:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    p = policy["page"]
    n = (end - first) * BLOCK // p
    k = max(1, n // 8)  # 1/8, floored, at least one: the engine's cap
    if module.layer_idx < policy.get("dense_layers", 0):
        k = n
    elif policy.get("dense_layers"):  # the same bytes in all: the other layers share what is left
        layers = module.config.num_hidden_layers
        k = max(1, math.floor((n * layers / 8 - n * policy["dense_layers"]) / (layers - policy["dense_layers"])))
    STATE["host"] += n * h
    STATE["fetched"] += min(k, n) * h
    if k >= n:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    pages = key[0, :, first * BLOCK:end * BLOCK].reshape(h, n, p, d)
    top = select_blocks(page_scores(policy, query[0, :, 0].reshape(h, -1, d), pages), k)  # [k, H]
    keep = torch.ones(h, -(-s // p), dtype=torch.bool)
    keep[:, first * BLOCK // p:end * BLOCK // p] = False
    keep.scatter_(1, (top + first * BLOCK // p).T, True)
    mask = keep.repeat_interleave(p, dim=1)[:, :s].repeat_interleave(query.shape[1] // h, dim=0)[None, :, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("kvtier_selection_study", attention)
AttentionMaskInterface.register("kvtier_selection_study", sdpa_mask)


def main() -> None:
    names = sys.argv[1].split(",")
    contexts = [int(c) for c in sys.argv[2].split(",")]
    out_path = sys.argv[3] if len(sys.argv) > 3 else None
    loaded = models.load()
    model = loaded.model
    model.config._attn_implementation = "kvtier_selection_study"
    ids = loaded.tokenizer(shared_data_file("tinyshakespeare.txt").read_text(), return_tensors="pt").input_ids[0]
    results: dict = {}
    for ctx in contexts:
        for w, window in enumerate(text_windows(ids, ctx, WINDOWS)):
            num_prefill = ctx - SCORED
            STATE["policy"] = None
            pre = prefill(model, window[:, :num_prefill], record_queries=False)
            for name in ["full"] + names:
                start = time.time()
                STATE.update(policy=POLICIES.get(name), fetched=0, host=0)
                cache = DynamicCache(config=model.config)
                fill(cache, pre)
                nll = score_continuation(model, cache, window[:, num_prefill:], 1)
                r = results.setdefault(f"{ctx}/{name}", {"nll": 0.0, "n": 0, "fetched": 0, "host": 0, "windows": []})
                r["nll"] += nll.total
                r["n"] += nll.num_tokens
                r["fetched"] += STATE["fetched"]
                r["host"] += STATE["host"]
                r["windows"].append(nll.total / nll.num_tokens)
                print(f"ctx {ctx} window {w + 1}/{WINDOWS} {name}: ppl {math.exp(nll.total / nll.num_tokens):.3f} "
                      f"({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    for ctx in contexts:
        full = results[f"{ctx}/full"]
        for name in names:
            r = results[f"{ctx}/{name}"]
            r["dppl_pct"] = 100 * (math.exp(r["nll"] / r["n"] - full["nll"] / full["n"]) - 1)
            r["dppl_pct_by_window"] = [100 * (math.exp(a - b) - 1) for a, b in zip(r["windows"], full["windows"])]
            r["fetched_share"] = r["fetched"] / max(r["host"], 1)
            print(f"{ctx} {name:18s} dppl {r['dppl_pct']:+.2f}%  windows "
                  + " ".join(f"{x:+.2f}" for x in r["dppl_pct_by_window"]) + f"  fetched {r['fetched_share']:.3f}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
