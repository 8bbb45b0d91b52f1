"""TieredCache with `kv_offload` (issue 18): a device window per layer, the middle blocks in host memory.
`exact` is DynamicCache bit for bit; `sparse` decodes the tokens of the eval's masked DynamicCache and of
the engine (the same selection functions); the bytes on each side are what the window says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvtier import models
from kvtier.config import parse_offload
from kvtier.engine import SamplingParams
from kvtier.evals.sparse import SparseWindow, sparse_model
from kvtier.hf import TieredCache
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parent / "engine"))
from test_offload import drain, make  # noqa: E402

BLOCK = 8
NEW = 24
SINK, RECENT = 1, 2
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16     # models.tiny_llama
TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * 4  # K + V of one token in one layer, fp32


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(7)).tolist()


@torch.inference_mode()
def greedy(model, prompt: list[int], cache, num_tokens: int = NEW) -> tuple[list[int], list[torch.Tensor]]:
    """The prompt in one pass, then one token per step (as the eval and the engine decode): tokens, logits."""
    inputs, tokens, logits = torch.tensor([prompt]), [], []
    for _ in range(num_tokens):
        logits.append(model(inputs, past_key_values=cache, use_cache=True).logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
        inputs = torch.tensor([[tokens[-1]]])
    return tokens, logits


def offloaded(loaded, mode: str, manager=None, page_tokens: int = BLOCK) -> TieredCache:
    return TieredCache.for_model(loaded, manager, block_tokens=BLOCK, kv_offload=mode, offload_sink_blocks=SINK,
                                 offload_recent_blocks=RECENT, offload_page_tokens=page_tokens)


def host_blocks(num_tokens: int) -> int:
    """Blocks between the sink and the recent window (the engine's `_window_chunk`)."""
    return max(0, -(-num_tokens // BLOCK) - RECENT - SINK)


def engine_tokens(loaded, mode: str, prompt: list[int], page_tokens: int = BLOCK) -> list[int]:
    engine, manager = make(loaded, "exact", offload_fetch_blocks=4, offload_page_tokens=page_tokens)
    engine.add_request("a", prompt, SamplingParams(max_tokens=NEW, ignore_eos=True, kv_offload=mode))
    try:
        return [t for o in drain(engine)["a"] for t in o.new_token_ids]
    finally:
        engine.close()
        manager.close()


def test_exact_offload_is_dynamic_cache_bit_for_bit(tiny_model, prompt):
    tokens, logits = greedy(tiny_model.model, prompt, DynamicCache(config=tiny_model.config))
    cache = offloaded(tiny_model, "exact")
    got_tokens, got_logits = greedy(tiny_model.model, prompt, cache)
    assert got_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(got_logits, logits))
    # every decode step fetched every host block of every layer: those of the context before its token
    steps = range(len(prompt) + 1, len(prompt) + NEW)  # context length after each decode step's token
    fetched = sum(host_blocks(n - 1) for n in steps) * BLOCK * TOKEN_BYTES * LAYERS
    stats = cache.offload_stats
    assert (stats.mode, stats.num_decode_tokens, stats.decode_fetched_bytes) == ("exact", NEW - 1, fetched)
    assert cache.summary_bytes == 0  # exact needs no summaries


@pytest.mark.parametrize("page_tokens", [BLOCK, 2])  # a page is the block; pages of 2 tokens in 8-token blocks
@pytest.mark.parametrize("mode", ["sparse:2", "sparse:1/4", "sparse:1"])
def test_sparse_offload_decodes_the_evals_masked_dynamic_cache(tiny_model, prompt, mode, page_tokens):
    masked = sparse_model(tiny_model.model, SparseWindow(parse_offload(mode), block_tokens=BLOCK, sink_blocks=SINK,
                                                         recent_blocks=RECENT, page_tokens=page_tokens))
    expected, _ = greedy(masked, prompt, DynamicCache(config=tiny_model.config))
    cache = offloaded(tiny_model, mode, page_tokens=page_tokens)
    assert greedy(tiny_model.model, prompt, cache)[0] == expected
    eval_stats = masked.config.kvtier_sparse.stats
    page_bytes = page_tokens * KV_HEADS * HEAD_DIM * 4 * 2  # one layer-page, K + V, all heads
    # the eval counts layer-head-pages attended to; the cache the bytes it fetched for them
    assert eval_stats.num_fetched_pages and masked.config.kvtier_sparse.window.page_tokens == page_tokens
    assert cache.offload_stats.decode_fetched_bytes == eval_stats.num_fetched_pages * page_bytes // KV_HEADS


@pytest.mark.parametrize("page_tokens", [BLOCK, 2])
def test_sparse_offload_decodes_the_engines_tokens(tiny_model, prompt, page_tokens):
    cache = offloaded(tiny_model, "sparse:1/4", page_tokens=page_tokens)
    assert greedy(tiny_model.model, prompt, cache)[0] == engine_tokens(tiny_model, "sparse:1/4", prompt, page_tokens)


def test_sparse_pages_return_each_heads_pages_and_count_their_summaries(tiny_model, prompt):
    """sparse:3 with 2-token pages: a decode step returns sink + 3 pages (6 tokens) per head + the tail, each
    host page has its own key min/max, and one decode token fetches 3 pages per layer and KV head."""
    cache = offloaded(tiny_model, "sparse:3", page_tokens=2)
    lengths = []
    update = cache.update

    def recording_update(key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] == 1:
            lengths.append((cache.get_seq_length(), keys.shape[2]))
        return keys, values

    cache.update = recording_update
    greedy(tiny_model.model, prompt, cache)
    for num_tokens, returned in lengths:
        assert returned == SINK * BLOCK + 3 * 2 + num_tokens - (SINK + host_blocks(num_tokens)) * BLOCK
    num_tokens = len(prompt) + NEW - 1
    assert cache.summary_bytes == host_blocks(num_tokens) * (BLOCK // 2) * KV_HEADS * 3 * HEAD_DIM * 4 * LAYERS
    assert cache.fetched_bytes_per_token == 3 * 2 * TOKEN_BYTES * LAYERS


def test_a_page_that_does_not_divide_the_block_is_a_value_error(tiny_model):
    with pytest.raises(ValueError, match="offload_page_tokens \\(3\\) must divide block_tokens \\(8\\)"):
        offloaded(tiny_model, "sparse:1", page_tokens=3)
    offloaded(tiny_model, "exact", page_tokens=3)  # exact fetches whole blocks: no page to check


def test_a_budget_over_every_block_is_dynamic_cache_and_a_small_one_is_not(tiny_model, prompt):
    tokens, logits = greedy(tiny_model.model, prompt, DynamicCache(config=tiny_model.config))
    whole, exact = offloaded(tiny_model, "sparse:1000"), offloaded(tiny_model, "exact")
    got_tokens, got_logits = greedy(tiny_model.model, prompt, whole)
    assert got_tokens == tokens and all(torch.equal(a, b) for a, b in zip(got_logits, logits))
    greedy(tiny_model.model, prompt, exact)
    assert whole.fetched_bytes == exact.fetched_bytes > 0
    one = offloaded(tiny_model, "sparse:1")
    assert greedy(tiny_model.model, prompt, one)[0] != tokens  # 1 of 9..11 host blocks per head: it drops some
    assert one.fetched_bytes < exact.fetched_bytes / 8


def test_generate_with_a_sparse_cache_matches_the_step_loop(tiny_model, prompt):
    """`model.generate` (its attention mask, `get_mask_sizes`) decodes as the plain step loop does."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = tiny_model.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=offloaded(
            tiny_model, "sparse:2"), max_new_tokens=NEW, do_sample=False)
    assert out[0, len(prompt):].tolist() == greedy(tiny_model.model, prompt, offloaded(tiny_model, "sparse:2"))[0]


def test_device_and_host_bytes_are_the_windows(tiny_model, prompt, monkeypatch):
    """sparse:2: each decode step returns sink + 2 blocks per head + the recent tail, the window is
    (sink + recent) blocks per layer on the device, the host holds exactly the middle blocks."""
    cache = offloaded(tiny_model, "sparse:2")
    returned, mask_sizes = [], []
    update = cache.update

    def recording_update(key_states, value_states, layer_idx, *args, **kwargs):
        if key_states.shape[-2] == 1 and layer_idx == 0:
            mask_sizes.append(cache.get_mask_sizes(1, 0)[0])
        keys, values = update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] == 1:
            returned.append((layer_idx, cache.get_seq_length(), keys, values))
        return keys, values

    monkeypatch.setattr(cache, "update", recording_update)
    greedy(tiny_model.model, prompt, cache)
    assert len(returned) == LAYERS * (NEW - 1)
    for layer_idx, num_tokens, keys, values in returned:
        tail = num_tokens - (SINK + host_blocks(num_tokens)) * BLOCK
        assert keys.shape == values.shape == (1, KV_HEADS, (SINK + 2) * BLOCK + tail, HEAD_DIM)
    assert mask_sizes == [keys.shape[2] for layer_idx, _, keys, _ in returned if layer_idx == 0]
    num_tokens = len(prompt) + NEW - 1
    window_bytes = (SINK + RECENT) * BLOCK * TOKEN_BYTES * LAYERS
    assert cache.resident_bytes == window_bytes == sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)
    assert all(l.keys.device.type == "cpu" and l.keys.shape[2] == (SINK + RECENT) * BLOCK for l in cache.layers)
    assert cache.offloaded_bytes == host_blocks(num_tokens) * BLOCK * TOKEN_BYTES * LAYERS
    assert cache.summary_bytes == host_blocks(num_tokens) * KV_HEADS * 3 * HEAD_DIM * 4 * LAYERS  # min, max, mean
    # bytes per decode token: 2 blocks per layer and KV head, K + V — the same as one returned tensor pair
    assert cache.fetched_bytes_per_token == 2 * BLOCK * TOKEN_BYTES * LAYERS
    assert cache.fetched_bytes == (NEW - 1) * 2 * BLOCK * TOKEN_BYTES * LAYERS  # the prefill fetched nothing
    assert cache.offload_stats.to_dict()["fetched_bytes_per_decode_token"] == cache.fetched_bytes_per_token


def test_no_offload_and_a_short_context_fetch_nothing(tiny_model):
    cache = offloaded(tiny_model, "sparse:1")
    greedy(tiny_model.model, list(range(3, 20)), cache, num_tokens=4)  # 20 tokens: within the 3-block window
    assert cache.offloaded_bytes == cache.fetched_bytes == 0
    plain = TieredCache.for_model(tiny_model, block_tokens=BLOCK)
    greedy(tiny_model.model, list(range(3, 20)), plain, num_tokens=4)
    assert plain.offloaded_bytes == plain.fetched_bytes == 0 and plain.offload_stats.mode == ""


@pytest.mark.parametrize("mode", ["exact", "sparse:2"])
def test_prefix_reuse_with_offload(tmp_path, tiny_model, prompt, mode):
    slot = tiny_model.kv_layout(BLOCK).block_bytes + 4096
    manager = build_manager(["dram:64MiB"], slot_bytes=slot)
    first = offloaded(tiny_model, mode, manager)
    assert first.load_prefix(torch.tensor([prompt])) == 0
    out1 = greedy(tiny_model.model, prompt, first)[0]
    assert first.store(prompt + out1) == (len(prompt) + NEW - 1) // BLOCK  # from the window and the host
    second = offloaded(tiny_model, mode, manager)
    num_blocks = (len(prompt) - 1) // BLOCK
    assert second.load_prefix(torch.tensor([prompt]), reserve_tokens=NEW) == num_blocks * BLOCK
    assert second.prefix.hit_tokens_by_tier == {"dram": num_blocks * BLOCK}
    assert second.offloaded_bytes == host_blocks(num_blocks * BLOCK) * BLOCK * TOKEN_BYTES * LAYERS
    # every restored block is where the window puts it, bit for bit what a DynamicCache computes
    ref = DynamicCache(config=tiny_model.config)
    with torch.inference_mode():
        tiny_model.model(torch.tensor([prompt]), past_key_values=ref, use_cache=True)
    for i in range(num_blocks):
        expected = torch.stack([torch.stack([layer.keys[0, :, i * BLOCK:(i + 1) * BLOCK],
                                             layer.values[0, :, i * BLOCK:(i + 1) * BLOCK]]) for layer in ref.layers])
        assert torch.equal(second.block_tensor(i), expected), i
    assert greedy(tiny_model.model, prompt[num_blocks * BLOCK:], second)[0] == out1
    manager.close()


def test_exact_offload_takes_batches_and_beam_reorders(tiny_model):
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = tiny_model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                             do_sample=False)
        got = tiny_model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                        past_key_values=offloaded(tiny_model, "exact"), do_sample=False)
        assert torch.equal(got, expected)
        # beam search's reorder: the window and the host blocks (the two rows differ there) follow it
        ref, cache = DynamicCache(config=tiny_model.config), offloaded(tiny_model, "exact")
        for c in (ref, cache):
            tiny_model.model(ids, past_key_values=c)
            c.reorder_cache(torch.tensor([1, 1]))
        assert cache.offloaded_bytes > 0
        step = torch.tensor([[5], [7]])
        assert torch.equal(tiny_model.model(step, past_key_values=cache).logits,
                           tiny_model.model(step, past_key_values=ref).logits)
    with pytest.raises(ValueError, match="batch size 1"):
        with torch.inference_mode():
            tiny_model.model(ids, past_key_values=offloaded(tiny_model, "sparse:2"))


def test_eager_attention_gets_a_mask_of_the_returned_keys_length(tiny_model, prompt):
    """Eager attention adds the mask transformers builds from `get_mask_sizes` to [.., m] scores: a
    wrong size would not broadcast. Its tokens are SDPA's."""
    eager = models.load("tiny", device="cpu")
    eager.model.set_attn_implementation("eager")
    expected, logits = greedy(tiny_model.model, prompt, offloaded(tiny_model, "sparse:2"))
    got, got_logits = greedy(eager.model, prompt, offloaded(eager, "sparse:2"))
    assert got == expected
    torch.testing.assert_close(torch.stack(got_logits), torch.stack(logits))


@pytest.mark.parametrize("text", ["sparse", "sparse:", "sparse:abc", "sparse:0", "sparse:2.5", "sparse:1/0", "lossy"])
def test_a_bad_kv_offload_is_a_value_error(tiny_model, text):
    with pytest.raises(ValueError, match="kv_offload|sparse budget"):
        offloaded(tiny_model, text)


def test_what_offload_refuses(tiny_model):
    assert offloaded(tiny_model, "off").offload is None
    with pytest.raises(ValueError, match="model"):
        TieredCache(tiny_model.config, model_fingerprint="x", block_tokens=BLOCK, kv_offload="sparse:1/8")
    with pytest.raises(ValueError, match="resident_codec"):
        TieredCache.for_model(tiny_model, block_tokens=BLOCK, kv_offload="exact", resident_codec="int8")
    with pytest.raises(ValueError, match="recent_blocks"):
        TieredCache.for_model(tiny_model, block_tokens=BLOCK, kv_offload="exact", offload_recent_blocks=0)


@pytest.mark.smollm2
def test_smollm2_sparse_offload_decodes_the_evals_tokens(smollm2, shakespeare_text):
    prompt = smollm2.tokenizer(shakespeare_text[:4000]).input_ids[:700]
    block, page = 32, 8
    for mode in ("exact", "sparse:1/4"):
        masked = sparse_model(smollm2.model, SparseWindow(parse_offload(mode if mode != "exact" else "sparse:1000"),
                                                          block_tokens=block, page_tokens=page))
        expected = greedy(masked, prompt, DynamicCache(config=smollm2.config), 16)[0]
        cache = TieredCache.for_model(smollm2, block_tokens=block, kv_offload=mode, offload_page_tokens=page)
        assert greedy(smollm2.model, prompt, cache, 16)[0] == expected, mode
        num_host = -(-(700 + 15) // block) - 2 - 1  # 715 tokens in the cache: all but sink + recent
        assert cache.offloaded_bytes == num_host * smollm2.kv_layout(block).block_bytes
