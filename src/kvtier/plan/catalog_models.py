"""The built-in model catalog, and `model_spec`: a catalog name, a config.json or a .gguf file.

Values are those of the models' published config.json files (layers, heads, KV heads, head_dim,
hidden, intermediate, vocab, max_position_embeddings, sliding window and its layer pattern, MLA
ranks). Parameter counts are the model cards' (MoE: all experts in `params_total`).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.errors import UserError
from kvtier.plan.specs import ModelSpec

MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    #          name              layers heads kv  hd  hidden inter  vocab   total    active   max_ctx
    ModelSpec("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256, 8.03e9, 8.03e9, 131072),
    ModelSpec("llama-3.1-70b", 80, 64, 8, 128, 8192, 28672, 128256, 70.6e9, 70.6e9, 131072),
    ModelSpec("llama-3.1-405b", 126, 128, 8, 128, 16384, 53248, 128256, 405.9e9, 405.9e9, 131072),
    # Qwen2.5 configs carry sliding_window=131072 with use_sliding_window=false: not windowed.
    ModelSpec("qwen2.5-7b", 28, 28, 4, 128, 3584, 18944, 152064, 7.62e9, 7.62e9, 32768),
    ModelSpec("qwen2.5-72b", 80, 64, 8, 128, 8192, 29568, 152064, 72.7e9, 72.7e9, 32768),
    # Mistral-7B v0.3 and Mixtral-8x7B v0.1: sliding_window null (full attention).
    ModelSpec("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32768, 7.25e9, 7.25e9, 32768),
    ModelSpec("mixtral-8x7b", 32, 32, 8, 128, 4096, 14336, 32000, 46.7e9, 12.9e9, 32768),
    # Gemma-2: head_dim 256 (9b) / 128 (27b) != hidden / heads; local (4096-window) and global
    # layers alternate, local first: half the layers are sliding.
    ModelSpec("gemma-2-9b", 42, 16, 8, 256, 3584, 14336, 256000, 9.24e9, 9.24e9, 8192, 4096, 21),
    ModelSpec("gemma-2-27b", 46, 32, 16, 128, 4608, 36864, 256000, 27.2e9, 27.2e9, 8192, 4096, 23),
    # DeepSeek-V3: MLA, one 512-dim latent + one 64-dim rope key per token per layer.
    ModelSpec("deepseek-v3", 61, 128, 128, 128, 7168, 18432, 129280, 671e9, 37e9, 163840,
              mla_kv_lora_rank=512, mla_rope_dim=64),
    # gpt-oss-120b: a 128-token sliding window on half of its 36 layers (alternating).
    ModelSpec("gpt-oss-120b", 36, 64, 8, 64, 2880, 2880, 201088, 116.8e9, 5.1e9, 131072, 128, 18),
    ModelSpec("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, 134.5e6, 134.5e6, 8192),
]}
_ALIASES = {"smollm2": "smollm2-135m", "llama-3-8b": "llama-3.1-8b", "deepseek-r1": "deepseek-v3",
            "gpt-oss": "gpt-oss-120b", "mixtral": "mixtral-8x7b", "mistral": "mistral-7b"}


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-").removeprefix("meta-")


def _looks_like_path(text: str) -> bool:
    return "/" in text or text.endswith((".json", ".gguf")) or text.startswith(".")


def model_spec(name_or_path: str) -> ModelSpec:
    """A catalog name, a Hugging Face config.json (or its directory), or a .gguf file."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json")
        path = path / "config.json"
    if path.is_file() and path.suffix == ".gguf":
        from kvtier.plan.gguf_meta import spec_from_gguf

        return spec_from_gguf(path)
    if path.is_file():
        from kvtier.plan.hf_config import spec_from_config

        return spec_from_config(_read_json(path), path.parent.name or path.stem)
    if _looks_like_path(name_or_path):
        raise UserError(f"no such model file {name_or_path!r}")
    key = _ALIASES.get(normalize_name(name_or_path), normalize_name(name_or_path))
    if key not in MODELS:
        raise UserError(f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)}, a config.json or a .gguf")
    return MODELS[key]


def _read_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not a JSON config: {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object")
    return config
