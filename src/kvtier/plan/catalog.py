"""Built-in model and accelerator catalogs, and specs read from config.json or GGUF metadata.

Model values are those of the models' published config.json files. GPU memory is what the
driver reports (nvidia-smi / rocm-smi), which is why an "80GB" H100 holds 79.6 GiB.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.errors import UserError
from kvtier.plan.specs import GPUSpec, ModelSpec

_MiB = 2**20

MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("llama-3.1-8b", 32, 32, 8, 128, 4096, 14336, 128256, 8.03e9, 8.03e9, 131072),
    ModelSpec("llama-3.1-70b", 80, 64, 8, 128, 8192, 28672, 128256, 70.6e9, 70.6e9, 131072),
    ModelSpec("llama-3.1-405b", 126, 128, 8, 128, 16384, 53248, 128256, 405.9e9, 405.9e9, 131072),
    # Qwen2.5 configs carry sliding_window=131072 with use_sliding_window=false: not windowed.
    ModelSpec("qwen2.5-7b", 28, 28, 4, 128, 3584, 18944, 152064, 7.62e9, 7.62e9, 32768),
    ModelSpec("qwen2.5-72b", 80, 64, 8, 128, 8192, 29568, 152064, 72.7e9, 72.7e9, 32768),
    ModelSpec("mistral-7b", 32, 32, 8, 128, 4096, 14336, 32768, 7.25e9, 7.25e9, 32768),
    ModelSpec("mixtral-8x7b", 32, 32, 8, 128, 4096, 14336, 32000, 46.7e9, 12.9e9, 32768),
    # Gemma-2: head_dim 256 (9b) / 128 (27b) != hidden / heads; local (4096-window) and global layers alternate.
    ModelSpec("gemma-2-9b", 42, 16, 8, 256, 3584, 14336, 256000, 9.24e9, 9.24e9, 8192, 4096, 21),
    ModelSpec("gemma-2-27b", 46, 32, 16, 128, 4608, 36864, 256000, 27.2e9, 27.2e9, 8192, 4096, 23),
    # DeepSeek-V3: MLA, one 512-dim latent + 64-dim rope key per token per layer.
    ModelSpec("deepseek-v3", 61, 128, 128, 128, 7168, 18432, 129280, 671e9, 37e9, 163840,
              mla_kv_lora_rank=512, mla_rope_dim=64),
    # gpt-oss-120b: 128-token sliding window on half of its 36 layers.
    ModelSpec("gpt-oss-120b", 36, 64, 8, 64, 2880, 2880, 201088, 116.8e9, 5.1e9, 131072, 128, 18),
    ModelSpec("smollm2-135m", 30, 9, 3, 64, 576, 1536, 49152, 134.5e6, 134.5e6, 8192),
]}
_MODEL_ALIASES = {"smollm2": "smollm2-135m", "llama-3-8b": "llama-3.1-8b", "deepseek-r1": "deepseek-v3"}

GPUS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec("h100", 81559 * _MiB, 3.35e12, 989e12, 700),
    GPUSpec("h200", 143771 * _MiB, 4.8e12, 989e12, 700),
    GPUSpec("b200", 183359 * _MiB, 8.0e12, 2250e12, 1000),
    GPUSpec("a100-40gb", 40960 * _MiB, 1.555e12, 312e12, 400),
    GPUSpec("a100-80gb", 81920 * _MiB, 2.039e12, 312e12, 400),
    GPUSpec("l40s", 46068 * _MiB, 0.864e12, 362e12, 350),
    GPUSpec("rtx-4090", 24564 * _MiB, 1.008e12, 165e12, 450),
    GPUSpec("mi300x", 196608 * _MiB, 5.3e12, 1307e12, 750),
]}
_GPU_ALIASES = {"h100-80gb": "h100", "h200-141gb": "h200", "a100": "a100-80gb", "4090": "rtx-4090"}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-").removeprefix("meta-")


def model_spec(name_or_path: str) -> ModelSpec:
    """A catalog name, a Hugging Face config.json (or its directory), or a .gguf file."""
    path = Path(name_or_path)
    if path.suffix == ".gguf" and path.is_file():
        return spec_from_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return spec_from_config(json.loads(path.read_text()), path.parent.name or path.stem)
    key = _MODEL_ALIASES.get(_norm(name_or_path), _norm(name_or_path))
    if key not in MODELS:
        raise UserError(f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)}, a config.json or a .gguf")
    return MODELS[key]


def gpu_spec(name: str) -> GPUSpec:
    key = _GPU_ALIASES.get(_norm(name), _norm(name))
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}, or --gpu-mem")
    return GPUS[key]


def _need(config: dict, *names: str):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    raise UserError(f"config.json lacks {names[0]!r}, needed to size the KV cache")


def _estimate_params(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv_heads: int,
                     head_dim: int, experts: int, tied: bool) -> float:
    attn = hidden * head_dim * (heads * 2 + kv_heads * 2)
    mlp = 3 * hidden * inter * max(1, experts)
    return layers * (attn + mlp) + vocab * hidden * (1 if tied else 2)


def spec_from_config(config: dict, name: str = "config") -> ModelSpec:
    config = config.get("text_config", config)
    layers = int(_need(config, "num_hidden_layers", "n_layer"))
    heads = int(_need(config, "num_attention_heads", "n_head"))
    hidden = int(_need(config, "hidden_size", "n_embd"))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    vocab = int(config.get("vocab_size") or 32000)
    experts = int(config.get("num_local_experts") or config.get("n_routed_experts") or 1)
    active_experts = int(config.get("num_experts_per_tok") or 1)
    window = config.get("sliding_window")
    num_sliding = 0
    if window and config.get("use_sliding_window", True):
        types = config.get("layer_types")
        if types:
            num_sliding = sum(t == "sliding_attention" for t in types)
        elif config.get("sliding_window_pattern"):
            num_sliding = layers - layers // int(config["sliding_window_pattern"])
        else:
            num_sliding = layers
    else:
        window = None
    tied = bool(config.get("tie_word_embeddings", False))
    total = _estimate_params(layers, hidden, inter, vocab, heads, kv_heads, head_dim, experts, tied)
    active = _estimate_params(layers, hidden, inter, vocab, heads, kv_heads, head_dim,
                              min(experts, active_experts) if experts > 1 else 1, tied)
    return ModelSpec(name, layers, heads, kv_heads, head_dim, hidden, inter, vocab, total, active,
                     int(config.get("max_position_embeddings") or 4096), int(window) if window else None,
                     num_sliding, int(config.get("kv_lora_rank") or 0), int(config.get("qk_rope_head_dim") or 0))


def spec_from_gguf(path: Path) -> ModelSpec:
    """Read the architecture fields of a GGUF file's metadata (`{arch}.block_count`, ...)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value.tolist()[0]

    arch = field("general.architecture")
    if arch is None:
        raise UserError(f"{path} has no general.architecture metadata")
    config = {
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": field(f"{arch}.attention.head_count"),
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "head_dim": field(f"{arch}.attention.key_length"),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    spec = spec_from_config(config, str(field("general.name", path.stem)))
    params = float(sum(int(t.n_elements) for t in reader.tensors))
    return ModelSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "params_total": params, "params_active": params})
