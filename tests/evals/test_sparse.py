"""The eval's sparse attention is the engine's sparse offload: same blocks, same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvtier.engine import SamplingParams
from kvtier.offload.config import parse_offload
from kvtier.evals.sparse import SparseWindow, decode_mask, sparse_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_offload import BLOCK, drain, make  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    return torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(7)).tolist()


@torch.inference_mode()
def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Prefill the prompt in one pass, then decode one token per step (the engine's decode steps)."""
    cache = DynamicCache(config=model.config)
    inputs, out = torch.tensor([prompt]), []
    for _ in range(num_tokens):
        next_id = int(model(inputs, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        out.append(next_id)
        inputs = torch.tensor([[next_id]])
    return out


def engine_tokens(tiny_model, mode: str, prompt: list[int], page_tokens: int = BLOCK) -> list[int]:
    engine, manager = make(tiny_model, "exact", offload_fetch_blocks=4, offload_page_tokens=page_tokens)
    engine.add_request("a", prompt, SamplingParams(max_tokens=NEW, ignore_eos=True, kv_offload=mode))
    outputs = drain(engine)["a"]
    assert outputs[-1].offload.mode == mode
    engine.close()
    manager.close()
    return [t for o in outputs for t in o.new_token_ids]


@pytest.mark.parametrize("page_tokens", [BLOCK, 2])  # a page is the block; pages of 2 tokens
@pytest.mark.parametrize("mode", ["sparse:2", "sparse:1/4", "sparse:1"])
def test_sparse_eval_attention_decodes_the_engines_tokens(tiny_model, long_prompt, mode, page_tokens):
    window = SparseWindow(parse_offload(mode), block_tokens=BLOCK, page_tokens=page_tokens)
    model = sparse_model(tiny_model.model, window)
    assert greedy(model, long_prompt, NEW) == engine_tokens(tiny_model, mode, long_prompt, page_tokens)
    stats = model.config.kvtier_sparse.stats
    assert stats.num_decode_steps == NEW - 1  # the first token comes from the (exact) prefill
    assert 0 < stats.num_fetched_pages < stats.num_host_pages
    assert stats.num_attended_tokens < stats.num_context_tokens


def test_sparse_attention_differs_from_full_and_a_whole_budget_is_full(tiny_model, long_prompt):
    full = greedy(tiny_model.model, long_prompt, NEW)
    whole = sparse_model(tiny_model.model, SparseWindow(parse_offload("sparse:1000"), block_tokens=BLOCK))
    assert greedy(whole, long_prompt, NEW) == full == engine_tokens(tiny_model, "sparse:1000", long_prompt)
    stats = whole.config.kvtier_sparse.stats
    assert stats.num_fetched_pages == stats.num_host_pages > 0
    assert stats.num_attended_tokens == stats.num_context_tokens
    one = sparse_model(tiny_model.model, SparseWindow(parse_offload("sparse:1"), block_tokens=BLOCK))
    assert greedy(one, long_prompt, NEW) != full  # one host block of ~9 per head: it does drop something


def test_decode_mask_keeps_sinks_recent_and_the_best_block_per_head():
    t, h, d = 4, 2, 3
    window = SparseWindow(parse_offload("sparse:1"), block_tokens=t)
    assert window.host_blocks(22) == (1, 4) and window.host_blocks(24) == (1, 4) and window.host_blocks(25) == (1, 5)
    assert window.host_blocks(9) == (1, 1)  # nothing between the sink and the recent window yet
    key = torch.zeros(1, h, 22, d)
    key[0, 0, 2 * t, 0] = 5.0   # head 0: block 2 holds the key that matches q
    key[0, 1, 3 * t, 1] = 5.0   # head 1: block 3
    query = torch.tensor([1.0, 1.0, 0.0]).expand(1, 2 * h, 1, d)  # 2 query heads per KV head
    mask, n, k = decode_mask(window, query, key)
    assert (n, k) == (3, 1) and mask.shape == (1, 2 * h, 1, 22)
    blocks = [sorted({i // t for i in range(22) if mask[0, head, 0, i]}) for head in range(2 * h)]
    assert blocks == [[0, 2, 4, 5], [0, 2, 4, 5], [0, 3, 4, 5], [0, 3, 4, 5]]
    assert decode_mask(SparseWindow(parse_offload("sparse:3"), block_tokens=t), query, key)[0] is None
    # pages of 2 tokens: the page holding each head's key (tokens 8-9, 12-13), the rest of its block out
    mask, n, k = decode_mask(SparseWindow(parse_offload("sparse:1"), block_tokens=t, page_tokens=2), query, key)
    assert (n, k) == (6, 1)
    tokens = [[i for i in range(4, 16) if mask[0, head, 0, i]] for head in range(2 * h)]
    assert tokens == [[8, 9], [8, 9], [12, 13], [12, 13]]
    assert decode_mask(SparseWindow(parse_offload("sparse:6"), block_tokens=t, page_tokens=2), query, key)[0] is None
    assert SparseWindow(parse_offload("sparse:1"), block_tokens=t, page_tokens=64).page_tokens == t  # at most a block
    with pytest.raises(ValueError, match="must divide"):
        SparseWindow(parse_offload("sparse:1"), block_tokens=t, page_tokens=3)


def test_parse_methods_expands_sparse_to_the_offload_budgets():
    from kvtier.errors import UserError
    from kvtier.evals.runner import parse_methods

    methods = parse_methods("sparse,sparse:4,h2o", "1/8", offload_budgets="1/32,1/8", block_tokens=16)
    assert [m.label for m in methods] == ["raw", "sparse-1/32-b16", "sparse-1/8-b16", "sparse-4-b16", "h2o@0.125"]
    assert methods[2].sparse_window == SparseWindow(parse_offload("sparse:1/8"), block_tokens=16)
    with pytest.raises(UserError, match="sparse"):
        parse_methods("sparse:2.5", "0.5")
    [_, wide] = parse_methods("sparse:1/8", "0.5", block_tokens=16, recent_blocks=8)
    assert wide.label == "sparse-1/8-b16-r8" and wide.sparse_window.recent_blocks == 8
    [_, sinkless] = parse_methods("sparse:1/8", "0.5", sink_blocks=0)
    assert sinkless.label == "sparse-1/8-s0" and sinkless.sparse_window.host_blocks(1024) == (0, 2)
    [_, paged] = parse_methods("sparse:1/8", "0.5", page_tokens=16)
    assert paged.label == "sparse-1/8-p16" and paged.sparse_window.page_tokens == 16


def test_the_default_layout_is_the_engines():
    from kvtier.engine import EngineConfig
    from kvtier.evals.runner import parse_methods

    engine = EngineConfig()
    [_, default] = parse_methods("sparse:1/8", "0.5")
    assert default.label == "sparse-1/8"  # no layout suffix at the engine's defaults
    assert default.sparse_window == SparseWindow(parse_offload("sparse:1/8"), engine.block_tokens,
                                                 engine.offload_sink_blocks, engine.offload_recent_blocks,
                                                 engine.offload_page_tokens)
    assert default.sparse_window.page_tokens == engine.page_tokens


def test_kvtier_eval_sparse_rows_on_tiny_model(capsys):
    import json

    from kvtier import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--model", "tiny", "--methods", "sparse,streamingllm", "--keep", "1/4",
                  "--offload-budgets", "1/4,1000", "--offload-block-tokens", "8", "--context", "160",
                  "--windows", "1", "--score-tokens", "24", "--passkey-lengths", "300", "--passkey-depths", "0.5",
                  "--json"])
    assert exc.value.code == 0
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["raw", "sparse-1/4-b8", "sparse-1000-b8", "streamingllm@0.25"]
    raw, quarter, whole = rows["raw"], rows["sparse-1/4-b8"], rows["sparse-1000-b8"]
    assert all(r["error"] is None for r in rows.values())
    assert whole["delta_ppl_pct"] == pytest.approx(0.0, abs=1e-3)  # every block fetched: full attention
    assert whole["passkey_acc"] == raw["passkey_acc"]
    assert raw["fetched_bytes_per_token"] == 0.0 and raw["attended_fraction"] == 1.0
    # 136..159 tokens decode: 14..17 host blocks of 8 tokens, ceil(n/4) fetched per layer and KV head
    assert 0 < quarter["fetched_bytes_per_token"] < 0.3 * whole["fetched_bytes_per_token"]
    assert quarter["attended_fraction"] < 0.5 and whole["attended_fraction"] == 1.0
    assert quarter["device_kv_bytes"] < 0.3 * raw["device_kv_bytes"]
    assert quarter["compression"] == 1.0  # offload keeps every token (in host memory)


@pytest.mark.parametrize(("options", "label"), [([], "sparse-1/8"), (["--offload-sink-blocks", "0"], "sparse-1/8-s0"),
                                               (["--offload-block-tokens", "256", "--offload-recent-blocks", "3"],
                                                "sparse-1/8-r3")])
def test_kvtier_eval_sparse_layout_options_default_to_the_engines(capsys, options, label):
    import json

    from kvtier import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--model", "tiny", "--methods", "sparse:1/8", *options, "--context", "",
                  "--passkey-lengths", "", "--json"])
    assert exc.value.code == 0
    assert [r["label"] for r in json.loads(capsys.readouterr().out)] == ["raw", label]


def test_kvtier_eval_negative_sink_blocks_exits_2(capsys):
    from kvtier import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--model", "tiny", "--methods", "sparse", "--offload-sink-blocks", "-1"])
    assert exc.value.code == 2
    assert "--offload-sink-blocks" in capsys.readouterr().err


def test_a_multi_token_pass_over_a_filled_cache_is_exact(tiny_model, long_prompt):
    """The passkey cue: several tokens after a prefill see the whole cache, causally (no block left out)."""
    ids = torch.tensor([long_prompt])
    one = sparse_model(tiny_model.model, SparseWindow(parse_offload("sparse:1"), block_tokens=BLOCK))
    logits = {}
    with torch.inference_mode():
        for name, model in (("full", tiny_model.model), ("sparse", one)):
            cache = DynamicCache(config=model.config)
            model(ids[:, :80], past_key_values=cache)
            logits[name] = model(ids[:, 80:], past_key_values=cache).logits
    torch.testing.assert_close(logits["sparse"], logits["full"])
    assert one.config.kvtier_sparse.stats.num_decode_steps == 0
