"""Batched sampling: one op for the whole step (nano-vllm's sampler), with top_p and per-request seeds.

Before it, `process_logits` applies the logits processors as tensors over the batch (vLLM's
order): a dense bias (logit_bias, allowed_token_ids, the EOS mask of min_tokens), then the
repetition / presence / frequency penalties from token counts; `top_k` and `min_p` filter inside
`sample`. `logprobs_of` reads the raw distribution (log_softmax of the model's logits), batched too.

A row samples token i with probability p_i by `argmax(p / q)` with q ~ Exp(1) (the exponential form
of the Gumbel-max trick): no `multinomial`, no per-row loop. Greedy rows take `argmax(logits)`, the
same op as a greedy-only step, so greedy output is bit-identical whatever else is in the batch.
A seeded row draws its noise from its own `torch.Generator`: its tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.sequence import TokenLogprob

# Temperatures below this are greedy: their limit as T -> 0, and float32 logits / T overflow to
# inf (softmax: NaN) long before T reaches the smallest doubles a client can send.
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class Penalties:
    """The batch's penalties. output_ids / seen_ids: [S, L] token ids padded with `vocab` (the padding
    column is dropped): the generated tokens, and the prompt + generated ones."""

    repetition: torch.Tensor  # [S] float32, 1: none
    presence: torch.Tensor    # [S] float32, 0: none
    frequency: torch.Tensor   # [S] float32, 0: none
    output_ids: torch.Tensor  # [S, L] long
    seen_ids: torch.Tensor    # [S, L'] long


def process_logits(logits: torch.Tensor, bias: torch.Tensor | None, penalties: Penalties | None) -> torch.Tensor:
    """logits [S, vocab] float32 -> the logits the sampler draws from (a new tensor; rows without a
    bias or penalty are unchanged bit for bit). bias: [S, vocab] added (-inf masks a token)."""
    if bias is not None:
        logits = logits + bias
    if penalties is not None:
        logits = _penalize(logits, penalties)
    return logits


def _token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :vocab]


def _penalize(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    vocab = logits.shape[-1]
    seen = _token_counts(p.seen_ids, vocab) > 0
    repetition = torch.where(seen, p.repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    counts = _token_counts(p.output_ids, vocab)
    return logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * (counts > 0).float()


def sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
           generators: list[torch.Generator | None], *, top_ks: torch.Tensor | None = None,
           min_ps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [S] and a bool mask [S] of the rows that could not be sampled (NaN logits, or no
    finite probabilities). logits: [S, vocab] float32; temperatures, top_ps, min_ps: [S] float32;
    top_ks: [S] long (0: all tokens). Greedy rows ignore top_p / top_k / min_p (argmax survives them)."""
    greedy = temperatures < MIN_TEMPERATURE
    token_ids = logits.argmax(dim=-1)
    bad = torch.isnan(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1)
    if bool(greedy.all()):
        return token_ids, bad
    if top_ks is not None and bool((top_ks > 0).any()):
        logits = _top_k(logits, top_ks)
    temperatures = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)
    if min_ps is not None and bool((min_ps > 0).any()):
        probs = probs.masked_fill(probs < min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0)
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


def _top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """-inf below each row's k-th largest logit (ties at the k-th stay); k 0 keeps the row."""
    vocab = logits.shape[-1]
    ks = torch.where(top_ks > 0, top_ks.clamp(max=vocab), torch.full_like(top_ks, vocab))
    kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))  # [S, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """The raw log-probabilities of `token_ids` [S] under `logits` [S, vocab] (their rank: 1 + the
    tokens strictly more likely), and each row's `num_top` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))            # [S, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in range(len(token_ids))]
    top_lps = top.values.tolist() if top is not None else top_ids
    return [TokenLogprob(t, lp, r, list(zip(ids, lps)))
            for t, lp, r, ids, lps in zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids, top_lps)]
