"""A ModelSpec from a Hugging Face config.json.

Which layers slide follows transformers 5.x's own config classes, so that plan agrees with what
`DynamicCache(config=...)` allocates:
- `layer_types` when the file lists them (gpt-oss, newer Gemma/Qwen exports);
- `use_sliding_window: false` (Qwen2/Qwen3) means no sliding layer, whatever `sliding_window` says;
  with it true, layers `i >= max_window_layers` slide;
- Gemma-2 and gpt-oss alternate local/global, local first; Gemma-3 and Cohere2 use
  `sliding_window_pattern` (every p-th layer global; defaults 6 and 4);
- any other config with a `sliding_window` (Mistral v0.1) slides on every layer.

Parameter counts are estimated from the shapes (attention, MLP or experts, embeddings; norms and
biases left out), within ~1% of the model cards for the catalog families.
"""

from __future__ import annotations

from kvtier.errors import UserError
from kvtier.plan.specs import ModelSpec

_ALTERNATING = {"gemma2", "gpt_oss"}
_PATTERN_DEFAULT = {"gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_MAX_WINDOW_LAYERS = {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}


def _int(config: dict, *names: str, default: int | None = None, positive: bool = True) -> int:
    """The first of `names` present in config, as an int; UserError when missing or malformed."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise UserError(f"config.json field {name!r} must be an integer, got {value!r}")
        if positive and value <= 0:
            raise UserError(f"config.json field {name!r} must be positive, got {value!r}")
        return int(value)
    if default is None:
        raise UserError(f"config.json lacks {names[0]!r}, needed to size the KV cache")
    return default


def sliding_layer_flags(config: dict, num_layers: int) -> list[bool]:
    """For each layer, whether its KV is capped at the sliding window (transformers' rules)."""
    model_type = str(config.get("model_type", ""))
    if not config.get("sliding_window") or config.get("use_sliding_window", True) is False:
        return [False] * num_layers
    types = config.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise UserError(f"config.json has {len(types)} layer_types for {num_layers} layers")
        return [t == "sliding_attention" for t in types]
    if model_type in _MAX_WINDOW_LAYERS:
        first = _int(config, "max_window_layers", default=28, positive=False)
        return [i >= first for i in range(num_layers)]
    if model_type in _ALTERNATING:
        return [(i + 1) % 2 == 1 for i in range(num_layers)]
    pattern = config.get("sliding_window_pattern") or _PATTERN_DEFAULT.get(model_type)
    if pattern:
        return [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    return [True] * num_layers


def _attention_params(config: dict, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    if config.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
        rope, nope = _int(config, "qk_rope_head_dim"), _int(config, "qk_nope_head_dim", default=128)
        v_dim, rank = _int(config, "v_head_dim", default=128), _int(config, "kv_lora_rank")
        q_rank = config.get("q_lora_rank")
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        return q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden
    return hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v


def _mlp_params(config: dict, hidden: int, inter: int, num_layers: int) -> tuple[int, int]:
    """(all, active) MLP parameters over all layers; gated MLPs have 3 matrices."""
    experts = _int(config, "num_local_experts", "n_routed_experts", "num_experts", default=1)
    if experts == 1:
        return (3 * hidden * inter * num_layers,) * 2
    top_k = _int(config, "num_experts_per_tok", "experts_per_token", default=2)
    expert = 3 * hidden * _int(config, "moe_intermediate_size", default=inter)
    shared = _int(config, "n_shared_experts", default=0, positive=False) * expert
    shared += 3 * hidden * _int(config, "shared_expert_intermediate_size", default=0, positive=False)
    num_dense = _int(config, "first_k_dense_replace", default=0, positive=False)
    dense = 3 * hidden * inter * num_dense
    num_moe = num_layers - num_dense
    router = hidden * experts
    return (dense + num_moe * (experts * expert + shared + router),
            dense + num_moe * (top_k * expert + shared + router))


def spec_from_config(config: dict, name: str = "config") -> ModelSpec:
    """Read the sizing fields of a config.json dict (multimodal configs: its `text_config`)."""
    config = config.get("text_config") or config
    num_layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(config, "num_attention_heads", "n_head")
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    kv_heads = _int(config, "num_key_value_heads", default=heads)
    head_dim = _int(config, "head_dim", default=hidden // heads)
    if head_dim == 0:
        raise UserError(f"config.json: head_dim is 0 (hidden_size {hidden} < num_attention_heads {heads})")
    inter = _int(config, "intermediate_size", "n_inner", default=4 * hidden)
    vocab = _int(config, "vocab_size", default=32000)  # weights and logits only, not the KV
    flags = sliding_layer_flags(config, num_layers)
    window = _int(config, "sliding_window") if any(flags) else None
    attn = _attention_params(config, hidden, heads, kv_heads, head_dim) * num_layers
    mlp_total, mlp_active = _mlp_params(config, hidden, inter, num_layers)
    embed = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return ModelSpec(
        name, num_layers, heads, kv_heads, head_dim, hidden, inter, vocab,
        params_total=float(attn + mlp_total + embed), params_active=float(attn + mlp_active + embed),
        max_context=_int(config, "max_position_embeddings", "n_positions", default=4096),
        sliding_window=window, num_sliding_layers=sum(flags),
        mla_kv_lora_rank=_int(config, "kv_lora_rank", default=0, positive=False),
        mla_rope_dim=_int(config, "qk_rope_head_dim", default=0, positive=False) if config.get("kv_lora_rank") else 0)
