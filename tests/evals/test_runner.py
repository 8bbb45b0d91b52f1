"""The eval harness: shared prefill == prefill through the cache, scoring, the CLI's JSON rows."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvtier import cli
from kvtier.errors import UserError
from kvtier.evals import passkey as pk
from kvtier.evals.cli import ByteTokenizer
from kvtier.evals.perplexity import score_continuation, text_windows
from kvtier.evals.runner import ALL_METHODS, Method, fill, parse_methods, prefill
from kvtier.levers.eviction import EvictionCache, EvictionPolicy

REQUIRED_KEYS = {"method", "keep", "bytes_per_token", "compression", "ppl", "delta_ppl_pct", "passkey_acc"}


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv"])
def test_shared_prefill_fill_equals_prefill_through_the_cache(tiny_model, name):
    ids = _ids(48)
    policy = EvictionPolicy(name, keep=0.5, window_tokens=8)
    direct = EvictionCache.for_model(tiny_model, policy)
    with torch.inference_mode():
        tiny_model.model(ids, past_key_values=direct)
    replayed = EvictionCache(tiny_model.config, policy)
    fill(replayed, prefill(tiny_model.model, ids, record_queries=True))
    for a, b in zip(direct.layers, replayed.layers):
        assert a.num_resident_tokens == b.num_resident_tokens == 24
        assert torch.equal(a.positions, b.positions)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.scores, b.scores)


def test_chunked_scoring_with_full_cache_matches_one_forward(tiny_model):
    ids = _ids(64)
    cache = DynamicCache(config=tiny_model.config)
    fill(cache, prefill(tiny_model.model, ids[:, :32], record_queries=False))
    nll = score_continuation(tiny_model.model, cache, ids[:, 32:], chunk_tokens=8)
    with torch.inference_mode():
        logits = tiny_model.model(ids).logits[0]
    want = torch.nn.functional.cross_entropy(logits[32:63], ids[0, 33:64], reduction="sum")
    assert nll.num_tokens == 31
    assert nll.total == pytest.approx(float(want), rel=1e-4)
    assert cache.get_seq_length() == 63


def test_text_windows_are_evenly_spaced_and_disjoint():
    token_ids = torch.arange(1000)
    windows = text_windows(token_ids, 100, 3)
    assert [int(w[0, 0]) for w in windows] == [0, 450, 900]
    assert all(w.shape == (1, 100) for w in windows)
    with pytest.raises(ValueError):
        text_windows(token_ids, 600, 2)


def test_parse_methods_expands_keeps_and_puts_raw_first():
    labels = [m.label for m in parse_methods("h2o,int4", "0.25,0.5")]
    assert labels == ["raw", "h2o@0.25", "h2o@0.5", "int4"]
    with pytest.raises(UserError):
        parse_methods("int3", "0.5")
    with pytest.raises(UserError):
        parse_methods("h2o", "1.5")


def test_passkey_prompt_hides_the_key_at_the_depth():
    tok = ByteTokenizer()
    early = pk.make_prompt(tok, 2000, 0.1, 12345)
    late = pk.make_prompt(tok, 2000, 0.9, 12345)
    needle = list(pk.NEEDLE.format(key=12345).encode())

    def find(ids: list[int]) -> int:
        return next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)

    assert find(early.context_ids[0].tolist()) < 0.2 * early.num_tokens
    assert find(late.context_ids[0].tolist()) > 0.8 * late.num_tokens
    assert tok.decode(early.cue_ids[0].tolist()) == pk.CUE
    assert pk.is_correct(" 12345. Remember", 12345) and not pk.is_correct(" 1234", 12345)
    # the question closes the context: exactly its tokens, for SnapKV's window on the question
    q = early.question_tokens
    assert q == len(pk.QUESTION.encode()) and tok.decode(early.context_ids[0, -q:].tolist()) == pk.QUESTION


def test_kvtier_eval_json_on_tiny_model(capsys):
    with pytest.raises(SystemExit) as exc:
            cli.main(["eval", "--model", "tiny", "--methods", "raw,streamingllm,snapkv,hf-fp8", "--keep", "0.5",
                  "--context", "64", "--windows", "1", "--chunk", "16", "--passkey-lengths", "300",
                  "--passkey-depths", "0.5", "--json"])
    assert exc.value.code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["raw", "streamingllm", "snapkv", "hf-fp8"]
    assert rows[2]["label"] == "snapkv-q@0.5"  # by default SnapKV looks from the question
    for row in rows:
        assert REQUIRED_KEYS <= set(row) and row["error"] is None
        assert row["ppl"] > 1.0 and row["passkey_acc"] in (0.0, 1.0)
    raw, stream = rows[0], rows[1]
    assert raw["delta_ppl_pct"] == 0.0 and raw["compression"] == 1.0 and raw["keep"] is None
    assert stream["keep"] == 0.5 and stream["compression"] == pytest.approx(2.0, rel=0.05)


def test_kvtier_eval_bad_method_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--model", "tiny", "--methods", "lru"])
    assert exc.value.code == 2
    assert "unknown method" in capsys.readouterr().err


def test_method_labels():
    assert Method("h2o", 0.25).label == "h2o@0.25" and Method("int8").label == "int8"
    assert Method("snapkv", 0.5, question_window=True).label == "snapkv-q@0.5"


def test_snapkv_question_window_is_the_question_where_there_is_one(tiny_model):
    [method] = parse_methods("snapkv", "0.5", "question")[1:]
    assert method.question_window
    assert method.new_cache(tiny_model.model, question_tokens=7).policy.window_tokens == 7
    assert method.new_cache(tiny_model.model).policy.window_tokens == 32  # perplexity text: no question


def test_kvtier_eval_bad_snapkv_window_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--model", "tiny", "--methods", "snapkv", "--snapkv-window", "wide"])
    assert exc.value.code == 2
    assert "question" in capsys.readouterr().err


@pytest.mark.parametrize("name", ALL_METHODS)
def test_every_method_generates_end_to_end_and_reports_its_bytes(tiny_model, name):
    from kvtier.evals.runner import EVICTION_METHODS, full_precision_bytes_per_token, kv_bytes

    from kvtier.offload.config import parse_offload

    method = Method(name, 0.5 if name in EVICTION_METHODS else None,
                    offload=parse_offload("sparse:1/4") if name == "sparse" else None, block_tokens=16)
    cache = method.new_cache(tiny_model.model)
    ids = _ids(150)  # past one 128-token block / residual, so every quantizer has quantized something
    out = method.model_for(tiny_model.model).generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 154) and torch.equal(out[:, :150], ids)
    assert cache.get_seq_length() == 153
    raw = full_precision_bytes_per_token(tiny_model.config) * 153    # 2 layers x K,V x 2 heads x 16 x 2 bytes
    assert raw == 256 * 153
    expected_ratio = {"raw": 1.0, "streamingllm": 2.0, "h2o": 2.0, "snapkv": 2.0, "sparse": 1.0}  # offload keeps all
    ratio = raw / kv_bytes(cache, tiny_model.config)
    if name in expected_ratio:
        assert ratio == pytest.approx(expected_ratio[name], rel=0.01)
    else:
        assert ratio > 1.3   # 128 tokens quantized, 25 still 16-bit (hf-fp8: all 8-bit)


def test_prefill_scores_are_shared_across_budgets_but_not_across_windows(tiny_model):
    pre = prefill(tiny_model.model, _ids(48), record_queries=True)
    half, quarter = EvictionPolicy("snapkv", keep=0.5), EvictionPolicy("snapkv", keep=0.25)
    assert pre.policy_scores(half) is pre.policy_scores(quarter)
    narrow = pre.policy_scores(EvictionPolicy("snapkv", keep=0.5, window_tokens=4))
    assert not torch.equal(narrow[0], pre.policy_scores(half)[0])


def test_kvtier_eval_passkey_only_with_a_narrow_snapkv_window(tiny_model, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--model", "tiny", "--methods", "snapkv", "--keep", "0.5", "--snapkv-window", "8",
                  "--context", "", "--passkey-lengths", "300", "--passkey-depths", "0.5", "--json"])
    assert exc.value.code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in rows] == ["raw", "snapkv-w8@0.5"]
    for row in rows:
        assert row["ppl"] is None and row["passkey_acc"] in (0.0, 1.0) and row["error"] is None
    assert rows[1]["compression"] == pytest.approx(2.0, rel=0.05)
    assert Method("snapkv", 0.5, 8).new_cache(tiny_model.model).policy.window_tokens == 8


def test_int4_with_128_token_key_groups_counts_its_bytes_by_the_formula(tiny_model):
    from kvtier.evals.runner import kv_bytes

    cache = Method("int4-g128").new_cache(tiny_model.model)
    with torch.inference_mode():
        tiny_model.model(_ids(300), past_key_values=cache, use_cache=True)
    cfg = tiny_model.config
    h, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    quantized, residual = 256, 300 - 256   # two full 128-token groups, the rest exact (16-bit)
    keys = quantized * h * d // 2 + (quantized // 128) * h * d * 4          # codes + fp16 scale, min per channel
    values = quantized * h * d // 2 + quantized * h * -(-d // 64) * 4      # codes + fp16 scale, min per token
    per_layer = keys + values + 2 * residual * h * d * 2
    assert kv_bytes(cache, cfg) == cfg.num_hidden_layers * per_layer
    assert cache.layers[0].quantizer.group_tokens == 128
