"""Partial attentions and their merge by log-sum-exp (FlashAttention's): attention over disjoint pieces of
a context, combined exactly."""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [H, G, N, D] (G query heads per KV head) over k, v [H, M, D], with its
    log-sum-exp: (out [H, G, N, D], lse [H, G, N]). `mask` [N, M]: True where a key may be seen.
    On the CPU the fused flash kernel SDPA itself runs, which also returns the log-sum-exp: 3.5x the
    speed of the two GEMMs around a materialized softmax for a 128-token prefill chunk over a 960-token
    piece, 1.5x for one decode token (docs/benchmarks/long-context.md, "The offloaded prefill on the CPU flash
    kernel")."""
    if q.device.type == "cpu":
        return _attend_flash_cpu(q, k, v, mask, scale)
    h, g, n, d = q.shape
    # one batched GEMM per KV head over its whole query group: K is read once, never expanded G times
    scores = torch.bmm(q.reshape(h, g * n, d), k.transpose(1, 2)).view(h, g, n, -1)  # [H, G, N, M]
    scores *= scale
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    scores -= lse.unsqueeze(-1)
    probs = scores.exp_()
    return torch.bmm(probs.view(h, g * n, -1), v).view(h, g, n, d), lse


def _attend_flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` by the CPU flash kernel: each KV head a batch of one head, its G x N queries rows, so K
    and V are read once per KV head and never expanded; the mask additive, in q's dtype (the kernel's
    rule), repeated for each query head of the group."""
    h, g, n, d = q.shape
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")).repeat(g, 1)  # [G*N, M]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(h, 1, g * n, d), k[:, None], v[:, None], 0.0, False, attn_mask=bias, scale=scale)[:2]
    return out.reshape(h, g, n, d), lse.reshape(h, g, n)


def merge(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys -> the attention over both (by log-sum-exp). Updates
    `out` and `out2` in place (each a fresh attention output) where they have the log-sum-exp's dtype."""
    total = torch.logaddexp(lse, lse2)
    if out.dtype != total.dtype:  # fp16/bf16 outputs: accumulated at the log-sum-exp's fp32
        out, out2 = out.to(total.dtype), out2.to(total.dtype)
    out.mul_(torch.exp_(lse - total).unsqueeze(-1))
    return out.add_(out2.mul_(torch.exp_(lse2 - total).unsqueeze(-1))), total
