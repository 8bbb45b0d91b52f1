import pytest
import torch

from kvtier import models
from kvtier.errors import UserError


def test_tiny_llama_layout(tiny_model):
    layout = tiny_model.kv_layout(block_tokens=16)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert layout.bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_tiny_models_are_reproducible():
    a, b = models.tiny_llama(seed=3), models.tiny_llama(seed=3)
    assert a.fingerprint == b.fingerprint
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert models.tiny_llama(seed=4).fingerprint != a.fingerprint


def test_unknown_model_is_a_user_error():
    with pytest.raises(UserError, match="unknown model"):
        models.load("no-such-model")


def test_directory_without_config_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        models.load(str(tmp_path))


def test_hf_directory_round_trip(tmp_path, tiny_model):
    tiny_model.model.save_pretrained(tmp_path)
    # a tokenizer is needed for a full HF dir; use a tiny byte-level one
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    tok.save_pretrained(tmp_path)
    loaded = models.load(str(tmp_path), device="cpu")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded.model(ids).logits.argmax(-1), tiny_model.model(ids).logits.argmax(-1))


@pytest.mark.smollm2
def test_smollm2_is_converted_once_and_cached(smollm2):
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert models.head_dim(cfg) == 64
    converted = models.cache_dir() / "smollm2-135m-instruct"
    assert (converted / ".converted-from").is_file()
    from safetensors import safe_open

    [weights] = converted.glob("*.safetensors")
    with safe_open(weights, "pt") as f:  # as save_pretrained writes a tied model (vLLM reads it)
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert cfg.tie_word_embeddings
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smollm2.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in smollm2.tokenizer.decode(out[0, ids.shape[1]:])


def test_checkpoint_stores_a_tied_embedding_as_embed_tokens(tmp_path):
    """vLLM skips a tied `lm_head.weight`: the tensor must be written as `model.embed_tokens.weight`."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    tensors = models._checkpoint_tensors(model)
    assert "lm_head.weight" not in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"],
                       model.model.embed_tokens.weight)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_a_checkpoint_of_an_older_format_is_converted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    gguf = models.embedded_gguf_path()
    converted = tmp_path / "smollm2-135m-instruct"
    converted.mkdir()
    (converted / ".converted-from").write_text(f"{gguf.name}:{gguf.stat().st_size}")  # v1's marker
    calls = []
    monkeypatch.setattr(models, "_convert_gguf", lambda src, out: calls.append(out))
    monkeypatch.setattr(models, "_load_hf_dir", lambda path, dtype: models.LoadedModel(None, None, "x", "f"))
    models._load_embedded(torch.float32)
    assert calls == [converted]
    assert (converted / ".converted-from").read_text().startswith(models._CONVERSION_VERSION + ":")
    models._load_embedded(torch.float32)
    assert calls == [converted]  # the new marker is current: no second conversion
