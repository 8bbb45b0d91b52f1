"""Perplexity of a lossy KV cache over long windows of text.

Protocol (the same for every method, the full-precision `DynamicCache` being the reference):
1. The text is tokenized once; `num_windows` non-overlapping windows of `context_tokens` tokens are
   taken evenly spaced over it.
2. The first half of each window (P = context_tokens // 2 tokens; with `--score-tokens N`, all but the last
   N) is prefilled once in full
   precision; its KV (and, for the eviction scores, its query states) are then written into the
   method's cache exactly as a prefill through that cache would write them (quantized / evicted).
3. The rest of the window is scored teacher-forced in chunks of `chunk_tokens`: chunk tokens
   [a, b) are fed with the lossy cache, their logits score tokens [a+1, b+1), and the cache then
   absorbs the chunk (quantizing it, or evicting down to the budget). The targets are the tokens
   P+1 .. context_tokens-1, so every scored token attends to the lossy KV of everything before its
   chunk. Sparse offload scores one token per chunk: each is a decode step of the engine. (The token P, predicted by the prefill's own last logit, is not scored: it never sees
   the lossy cache.)
4. ppl = exp(total NLL / total scored tokens) over all windows; Δppl% is against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class NLL:
    """A running sum of negative log-likelihoods."""

    total: float = 0.0
    num_tokens: int = 0

    def add(self, other: "NLL") -> None:
        self.total += other.total
        self.num_tokens += other.num_tokens

    @property
    def ppl(self) -> float:
        return float(torch.tensor(self.total / self.num_tokens).exp()) if self.num_tokens else float("nan")


def text_windows(token_ids: torch.Tensor, context_tokens: int, num_windows: int) -> list[torch.Tensor]:
    """`num_windows` non-overlapping [1, context_tokens] windows spread evenly over token_ids [N]."""
    n = token_ids.shape[0]
    if n < context_tokens * num_windows:
        raise ValueError(f"{n} tokens cannot hold {num_windows} windows of {context_tokens}")
    stride = (n - context_tokens) // max(num_windows - 1, 1) if num_windows > 1 else 0
    stride = max(stride, context_tokens)
    return [token_ids[i * stride:i * stride + context_tokens].unsqueeze(0) for i in range(num_windows)]


def prefill_tokens(context_tokens: int) -> int:
    return context_tokens // 2


@torch.inference_mode()
def score_continuation(model: torch.nn.Module, cache, token_ids: torch.Tensor, chunk_tokens: int) -> NLL:
    """Teacher-forced NLL of token_ids[:, 1:] given `cache` (holding everything before token_ids[:, 0]).

    token_ids: [1, T]; fed in chunks of `chunk_tokens` through `cache`.
    """
    nll = NLL()
    inputs, targets = token_ids[:, :-1], token_ids[:, 1:]
    for start in range(0, inputs.shape[1], chunk_tokens):
        chunk = inputs[:, start:start + chunk_tokens]
        logits = model(chunk, past_key_values=cache, use_cache=True).logits
        target = targets[:, start:start + chunk.shape[1]]
        loss = F.cross_entropy(logits[0].float(), target[0], reduction="sum")
        nll.add(NLL(float(loss), target.shape[1]))
    return nll
