"""KV eviction: StreamingLLM, H2O and SnapKV, each bounding a sequence's resident KV to a budget.

    policy = EvictionPolicy("snapkv", keep=0.5)          # or budget_tokens=1024
    cache = EvictionCache.for_model(loaded, policy)       # installs the attention hooks once
    model.generate(input_ids, past_key_values=cache, ...)

How it works (the way NVIDIA kvpress does it): a forward hook on every attention module runs after
the attention of each forward pass, recomputes the post-RoPE query states of that pass from the
hooked `hidden_states` and `position_embeddings` (`q_proj`, optional `q_norm`, RoPE), scores the
resident keys with softmax(q·kᵀ·scale) under the causal mask, and evicts down to the budget.
Eviction after attention means the pass that wrote a token still saw all tokens; every later pass
sees only the survivors.

- StreamingLLM: keep the first `num_sink_tokens` tokens (attention sinks) and the most recent rest.
- H2O: accumulate each resident token's attention mass over every query that has seen it; keep the
  most recent `recent_fraction` of the budget plus the heaviest hitters among the older tokens.
- SnapKV: score the keys by the attention of the last `window_tokens` queries of the pass (the
  observation window at the end of the prompt), average-pool over `kernel_tokens` neighbours, keep
  the window plus the top-scored rest. Decode steps are scored by their own (single) query.
Scores are averaged over the query heads of each KV head (GQA) and tokens are selected per KV head.

Positions: keys are cached post-RoPE, so dropping a token shifts nothing. `get_seq_length()` keeps
counting every token seen (position ids continue from the true length), and `get_mask_sizes`
reports the resident count as the key length with an offset of (seen - resident), so the causal
mask lets new queries see every survivor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from kvtier.errors import UserError

POLICIES = ("streamingllm", "h2o", "snapkv")
_QUERY_CHUNK_TOKENS = 256  # bounds the [B, H, q, N] score tensor
DEFAULT_SNAPKV_WINDOW_TOKENS = 32


@dataclass(slots=True)
class EvictionPolicy:
    """Which tokens to keep, and how many: `keep` (a fraction of the tokens seen) or `budget_tokens`."""

    name: str
    keep: float | None = None
    budget_tokens: int | None = None
    num_sink_tokens: int = 4          # StreamingLLM
    recent_fraction: float = 0.5      # H2O: share of the budget for the most recent tokens
    window_tokens: int = DEFAULT_SNAPKV_WINDOW_TOKENS  # SnapKV observation window
    kernel_tokens: int = 7            # SnapKV pooling

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise UserError(f"unknown eviction policy {self.name!r}: use {', '.join(POLICIES)}")
        if (self.keep is None) == (self.budget_tokens is None):
            raise UserError("an eviction policy needs exactly one of keep (a fraction) or budget_tokens")
        if self.keep is not None and not 0.0 < self.keep <= 1.0:
            raise UserError(f"keep must be in (0, 1], got {self.keep}")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise UserError(f"budget_tokens must be at least 1, got {self.budget_tokens}")

    def budget(self, num_seen_tokens: int) -> int:
        """The most tokens a layer may hold after seeing `num_seen_tokens`."""
        if self.budget_tokens is not None:
            return self.budget_tokens
        return max(1, math.ceil(self.keep * num_seen_tokens - 1e-9))

    @property
    def needs_queries(self) -> bool:
        return self.name != "streamingllm"


# -- selection: pure functions over indices and scores ------------------------------------------

def streaming_keep_indices(num_tokens: int, budget: int, num_sinks: int) -> torch.Tensor:
    """Indices (into the resident order) of the sinks [0, s) and the last budget - s tokens."""
    if num_tokens <= budget:
        return torch.arange(num_tokens)
    num_sinks = min(num_sinks, budget)
    recent = torch.arange(num_tokens - (budget - num_sinks), num_tokens)
    return torch.cat([torch.arange(num_sinks), recent])


def topk_keep_indices(scores: torch.Tensor, budget: int, num_protected_recent: int) -> torch.Tensor:
    """scores: [B, H, N] -> [B, H, budget] ascending indices of the top scores; the last
    `num_protected_recent` tokens are always kept."""
    n = scores.shape[-1]
    if n <= budget:
        return torch.arange(n, device=scores.device).expand(*scores.shape[:-1], n)
    ranked = scores.float().clone()
    protected = min(num_protected_recent, budget)
    if protected:
        ranked[..., n - protected:] = float("inf")
    return ranked.topk(budget, dim=-1).indices.sort(dim=-1).values


def attention_probs_sum(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax(q·kᵀ·scaling) summed over queries and averaged over each KV head's query heads.

    queries: [B, Hq, q, D] — the last q tokens of `keys`, in order; keys: [B, Hkv, N, D].
    Returns [B, Hkv, N] (float32).
    """
    b, hq, q, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group = hq // hkv
    q_grouped = queries.float().reshape(b, hkv, group, q, d)
    k_t = keys.float().unsqueeze(2).transpose(-1, -2)            # [B, Hkv, 1, D, N]
    total = torch.zeros(b, hkv, n, dtype=torch.float32, device=keys.device)
    for start in range(0, q, _QUERY_CHUNK_TOKENS):
        stop = min(start + _QUERY_CHUNK_TOKENS, q)
        logits = q_grouped[..., start:stop, :] @ k_t * scaling   # [B, Hkv, G, c, N]
        query_index = torch.arange(n - q + start, n - q + stop, device=keys.device)
        future = torch.arange(n, device=keys.device)[None, :] > query_index[:, None]
        probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        total += probs.sum(dim=3).mean(dim=2)
    return total


def snapkv_scores(window_queries: torch.Tensor, keys: torch.Tensor, scaling: float, kernel_tokens: int) -> torch.Tensor:
    """Mean attention of the observation window over the keys, average-pooled along tokens. [B, Hkv, N]"""
    scores = attention_probs_sum(window_queries, keys, scaling) / window_queries.shape[2]
    if kernel_tokens > 1:
        b, h, n = scores.shape
        pooled = F.avg_pool1d(scores.reshape(b * h, 1, n), kernel_tokens, stride=1,
                              padding=kernel_tokens // 2, count_include_pad=False)
        scores = pooled.reshape(b, h, n)
    return scores


def policy_scores(policy: EvictionPolicy, queries: torch.Tensor | None, keys: torch.Tensor,
                  scaling: float) -> torch.Tensor | None:
    """This pass's token scores [B, Hkv, N] for `policy` (None for StreamingLLM, which needs none).

    H2O: the attention mass every query of the pass gives each key (the layer accumulates it);
    SnapKV: the pooled mean attention of the last `window_tokens` queries.
    """
    if policy.name == "h2o":
        return attention_probs_sum(queries, keys, scaling)
    if policy.name == "snapkv":
        return snapkv_scores(queries[:, :, -policy.window_tokens:], keys, scaling, policy.kernel_tokens)
    return None


def query_states(module: torch.nn.Module, hidden_states: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Recompute a Llama-style attention module's post-RoPE queries: [B, Hq, T, D]."""
    from transformers.models.llama.modeling_llama import rotate_half

    b, t, _ = hidden_states.shape
    q = module.q_proj(hidden_states).view(b, t, -1, module.head_dim).transpose(1, 2)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    cos, sin = position_embeddings
    cos, sin = cos[:, -t:].unsqueeze(1), sin[:, -t:].unsqueeze(1)
    return q * cos + rotate_half(q) * sin


# -- the cache ----------------------------------------------------------------------------------

class EvictionLayer(DynamicLayer):
    """A layer that holds at most the policy's budget of tokens after each forward pass.

    keys/values: [B, Hkv, n_resident, D]; positions: [B, Hkv, n_resident] original token indices;
    scores: [B, Hkv, n_resident] accumulated attention (H2O).
    """

    is_croppable = False

    def __init__(self, policy: EvictionPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.num_seen_tokens = 0
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        b, h = key_states.shape[:2]
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=self.device)
        self.scores = torch.empty(b, h, 0, dtype=torch.float32, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, t, _ = key_states.shape
        new_positions = torch.arange(self.num_seen_tokens, self.num_seen_tokens + t, device=self.device)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new_positions.expand(b, h, t)], dim=-1)
        self.scores = torch.cat([self.scores, self.scores.new_zeros(b, h, t)], dim=-1)
        self.num_seen_tokens += t
        return self.keys, self.values

    @property
    def num_resident_tokens(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.num_seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        resident = self.num_resident_tokens
        return resident + query_length, self.num_seen_tokens - resident

    def reset(self) -> None:
        super().reset()
        self.num_seen_tokens = 0
        self.positions = self.scores = None

    def compress(self, queries: torch.Tensor | None, scaling: float) -> None:
        """Score with this pass's queries [B, Hq, q, D] (the last q resident tokens), then evict."""
        self.apply_scores(policy_scores(self.policy, queries, self.keys, scaling))

    def apply_scores(self, scores: torch.Tensor | None) -> None:
        """Evict down to the budget given this pass's `policy_scores` ([B, Hkv, n_resident] or None)."""
        policy, n = self.policy, self.num_resident_tokens
        budget = policy.budget(self.num_seen_tokens)
        if policy.name == "h2o":
            self.scores += scores
            scores = self.scores
        if n <= budget:
            return
        if policy.name == "streamingllm":
            self._keep_shared(streaming_keep_indices(n, budget, policy.num_sink_tokens).to(self.device))
            return
        protected = int(budget * policy.recent_fraction) if policy.name == "h2o" else policy.window_tokens
        self._keep_per_head(topk_keep_indices(scores, budget, protected))

    def _keep_shared(self, idx: torch.Tensor) -> None:
        self.keys, self.values = self.keys[..., idx, :], self.values[..., idx, :]
        self.positions, self.scores = self.positions[..., idx], self.scores[..., idx]

    def _keep_per_head(self, idx: torch.Tensor) -> None:
        # idx: [B, Hkv, budget]
        d = self.keys.shape[-1]
        gather_kv = idx.unsqueeze(-1).expand(*idx.shape, d)
        self.keys = self.keys.gather(2, gather_kv)
        self.values = self.values.gather(2, gather_kv)
        self.positions = self.positions.gather(2, idx)
        self.scores = self.scores.gather(2, idx)


class EvictionCache(Cache):
    """A transformers Cache whose layers evict down to `policy`'s budget after every forward pass.

    Needs the attention hooks (`install_hooks(model)`; `for_model` does it). Full-attention
    Llama-style models only.
    """

    def __init__(self, config, policy: EvictionPolicy) -> None:
        text_config = config.get_text_config(decoder=True)
        self.policy = policy
        super().__init__(layers=[EvictionLayer(policy) for _ in range(text_config.num_hidden_layers)])

    @classmethod
    def for_model(cls, loaded_or_model, policy: EvictionPolicy) -> "EvictionCache":
        model = loaded_or_model if isinstance(loaded_or_model, torch.nn.Module) else loaded_or_model.model
        install_hooks(model)
        return cls(model.config, policy)

    def after_attention(self, module: torch.nn.Module, hidden_states: torch.Tensor,
                        position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> None:
        layer = self.layers[module.layer_idx]
        queries = None
        if self.policy.needs_queries:
            if self.policy.name == "snapkv":
                hidden_states = hidden_states[:, -self.policy.window_tokens:]
            queries = query_states(module, hidden_states, position_embeddings)
        layer.compress(queries, module.scaling)

    @property
    def num_resident_tokens(self) -> int:
        return self.layers[0].num_resident_tokens


def _after_attention_hook(module, args, kwargs, output):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, EvictionCache):
        cache.after_attention(module, kwargs["hidden_states"], kwargs["position_embeddings"])
    return output


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a Llama-style causal LM, in layer order."""
    base = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in base.layers]


def install_hooks(model: torch.nn.Module) -> None:
    """Register the after-attention hook on every attention module, once per model.

    The hook acts only when the forward pass's `past_key_values` is an `EvictionCache`.
    """
    for module in attention_modules(model):
        if not getattr(module, "_kvtier_eviction_hooked", False):
            module.register_forward_hook(_after_attention_hook, with_kwargs=True)
            module._kvtier_eviction_hooked = True
