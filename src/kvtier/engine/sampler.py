"""Batched sampling: one op for the whole step (nano-vllm's sampler), with top_p and per-request seeds.

A row samples token i with probability p_i by `argmax(p / q)` with q ~ Exp(1) (the exponential form
of the Gumbel-max trick): no `multinomial`, no per-row loop. Greedy rows take `argmax(logits)`, the
same op as a greedy-only step, so greedy output is bit-identical whatever else is in the batch.
A seeded row draws its noise from its own `torch.Generator`: its tokens do not depend on the batch.
"""

from __future__ import annotations

import torch

# Temperatures below this are greedy: their limit as T -> 0, and float32 logits / T overflow to
# inf (softmax: NaN) long before T reaches the smallest doubles a client can send.
MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
           generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [S] and a bool mask [S] of the rows that could not be sampled (NaN logits, or no
    finite probabilities). logits: [S, vocab] float32; temperatures, top_ps: [S] float32."""
    greedy = temperatures < MIN_TEMPERATURE
    token_ids = logits.argmax(dim=-1)
    bad = torch.isnan(logits).any(dim=-1)
    if bool(greedy.all()):
        return token_ids, bad
    temperatures = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    if bool((top_ps < 1).any()):
        probs = _top_p(probs, top_ps)
    noise = torch.empty_like(probs).exponential_(1)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(1, generator=gen)
    bad |= ~greedy & ~torch.isfinite(probs).all(dim=-1)
    sampled = probs.div_(noise.clamp_min_(1e-10)).argmax(dim=-1)
    return torch.where(greedy, token_ids, sampled), bad


def _top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p (not renormalized:
    argmax(p / q) does not care). The most likely token always stays, so a top_p that is tiny (or 0
    once in float32) means top-1."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_ps.unsqueeze(1)
    keep[:, 0] = True
    keep |= (top_ps >= 1).unsqueeze(1)  # float32 sums can pass 1 before the tail: top_p 1 keeps all
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill_(~keep, 0))
