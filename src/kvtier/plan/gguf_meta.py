"""A ModelSpec from a GGUF file's metadata (`{arch}.block_count`, `{arch}.attention.head_count_kv`, ...).

The keys are llama.cpp's; they are mapped onto config.json names and read by `hf_config`, so a
GGUF and its config.json give the same spec. Parameters are counted from the tensor shapes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvtier.errors import UserError
from kvtier.plan.hf_config import spec_from_config
from kvtier.plan.specs import ModelSpec

# config.json field <- GGUF key suffix (after "{arch}.")
_FIELDS = {
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "max_position_embeddings": "context_length",
    "head_dim": "attention.key_length",
    "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window",
    "sliding_window_pattern": "attention.sliding_window_pattern",
    "kv_lora_rank": "attention.kv_lora_rank",
    "num_local_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
}
# llama.cpp architecture name -> transformers model_type, where the sliding rule depends on it
_MODEL_TYPES = {"gemma2": "gemma2", "gemma3": "gemma3", "cohere2": "cohere2", "gpt-oss": "gpt_oss",
                "qwen2": "qwen2", "qwen3": "qwen3"}


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    if field.types[0].name == "STRING":
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]].tolist()[0]  # arrays (per-layer head_count_kv): the first


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, struct/numpy errors on foreign files
        raise UserError(f"{path} is not a readable GGUF file: {exc}") from None


def spec_from_gguf(path: Path) -> ModelSpec:
    reader = _open(path)
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise UserError(f"{path} has no general.architecture metadata")
    config = {name: _field(reader, f"{arch}.{key}") for name, key in _FIELDS.items()}
    config["model_type"] = _MODEL_TYPES.get(arch, arch)
    if config["vocab_size"] is None and "tokenizer.ggml.tokens" in reader.fields:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    if config["kv_lora_rank"]:
        config["qk_rope_head_dim"] = _field(reader, f"{arch}.rope.dimension_count")
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    spec = spec_from_config(config, str(_field(reader, "general.name") or path.stem))
    params = float(sum(int(t.n_elements) for t in reader.tensors))
    active = params if spec.params_total == spec.params_active else params * spec.params_active / spec.params_total
    return replace(spec, params_total=params, params_active=active)
