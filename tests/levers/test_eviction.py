"""Eviction policies: exact kept tokens, positions after eviction, generation on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtier.errors import UserError
from kvtier.levers.eviction import (EvictionCache, EvictionLayer, EvictionPolicy, attention_probs_sum,
                                    snapkv_scores, streaming_keep_indices, topk_keep_indices)


def _prompt(n: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _layer_with(policy: EvictionPolicy, num_tokens: int, heads: int = 1, dim: int = 4) -> EvictionLayer:
    layer = EvictionLayer(policy)
    keys = torch.arange(num_tokens * heads * dim, dtype=torch.float32).reshape(1, heads, num_tokens, dim)
    layer.update(keys, -keys)
    return layer


def test_streaming_keeps_sinks_and_recent_window_exactly():
    assert streaming_keep_indices(10, 6, 2).tolist() == [0, 1, 6, 7, 8, 9]
    assert streaming_keep_indices(5, 6, 2).tolist() == [0, 1, 2, 3, 4]


def test_streaming_layer_keeps_exact_positions_and_values():
    layer = _layer_with(EvictionPolicy("streamingllm", budget_tokens=6, num_sink_tokens=2), 10)
    keys_before = layer.keys.clone()
    layer.apply_scores(None)
    assert layer.positions[0, 0].tolist() == [0, 1, 6, 7, 8, 9]
    assert torch.equal(layer.keys, keys_before[..., [0, 1, 6, 7, 8, 9], :])
    assert torch.equal(layer.values, -keys_before[..., [0, 1, 6, 7, 8, 9], :])
    assert layer.get_seq_length() == 10 and layer.num_resident_tokens == 6


def test_topk_keeps_top_scores_and_protected_recent_tokens():
    scores = torch.tensor([[[5.0, 1.0, 9.0, 0.0, 7.0, 2.0, 3.0, 0.5]]])
    assert topk_keep_indices(scores, 4, 1).tolist() == [[[0, 2, 4, 7]]]
    assert topk_keep_indices(scores, 4, 0).tolist() == [[[0, 2, 4, 6]]]


def test_h2o_keeps_heavy_hitters_per_head_and_accumulates():
    policy = EvictionPolicy("h2o", budget_tokens=4, recent_fraction=0.5)
    layer = _layer_with(policy, 8, heads=2)
    # head 0 favours tokens 1 and 3, head 1 tokens 0 and 5; the last two are the recent window
    first = torch.zeros(1, 2, 8)
    first[0, 0, [1, 3]] = 1.0
    first[0, 1, [0, 5]] = 1.0
    layer.scores += first  # scores of an earlier pass: accumulated, not replaced
    second = torch.zeros(1, 2, 8)
    second[0, 0, 2] = 0.5
    layer.apply_scores(second)
    assert layer.positions.tolist() == [[[1, 3, 6, 7], [0, 5, 6, 7]]]
    assert layer.scores.tolist() == [[[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]]


def test_attention_probs_sum_matches_causal_softmax():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)  # 2 query heads per KV head
    got = attention_probs_sum(q, k, 0.5)
    logits = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.5  # [1, 4, 3, 5]
    causal = torch.arange(5)[None, :] > torch.arange(2, 5)[:, None]
    probs = logits.masked_fill(causal, float("-inf")).softmax(-1).sum(2)  # [1, 4, 5]
    want = probs.reshape(1, 2, 2, 5).mean(2)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.full((1, 2), 3.0), atol=1e-5)  # 3 queries, mass 1 each


def test_snapkv_keeps_tokens_the_observation_window_attends_to():
    dim, n = 8, 12
    keys = torch.zeros(1, 1, n, dim)
    keys[0, 0, [3, 7], 0] = 10.0            # the window's queries point at tokens 3 and 7
    window = torch.zeros(1, 1, 2, dim)
    window[..., 0] = 1.0
    policy = EvictionPolicy("snapkv", budget_tokens=4, window_tokens=2, kernel_tokens=1)
    layer = EvictionLayer(policy)
    layer.update(keys, keys.clone())
    layer.apply_scores(snapkv_scores(window, layer.keys, 1.0, policy.kernel_tokens))
    assert layer.positions[0, 0].tolist() == [3, 7, 10, 11]


def test_snapkv_pooling_keeps_neighbours():
    dim, n = 4, 12
    keys = torch.zeros(1, 1, n, dim)
    keys[0, 0, 4, 0] = 10.0
    window = torch.ones(1, 1, 1, dim)
    scores = snapkv_scores(window, keys, 1.0, kernel_tokens=3)
    assert torch.isclose(scores[0, 0, 3], scores[0, 0, 5]) and scores[0, 0, 3] > scores[0, 0, 2]
    assert topk_keep_indices(scores, 4, 1).tolist() == [[[3, 4, 5, 11]]]


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv"])
def test_full_budget_generation_equals_dynamic_cache(tiny_model, name):
    ids = _prompt()
    ref = tiny_model.model.generate(ids, max_new_tokens=10, do_sample=False,
                                    past_key_values=DynamicCache(config=tiny_model.config))
    cache = EvictionCache.for_model(tiny_model, EvictionPolicy(name, keep=1.0))
    out = tiny_model.model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.num_resident_tokens == 49


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv"])
def test_generation_with_eviction_bounds_resident_kv_and_positions_continue(tiny_model, name):
    seen_positions: list[list[int]] = []

    def capture(module, args, kwargs):
        seen_positions.append(kwargs["position_ids"][0].tolist())

    handle = tiny_model.model.model.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        cache = EvictionCache.for_model(tiny_model, EvictionPolicy(name, budget_tokens=16, window_tokens=4))
        out = tiny_model.model.generate(_prompt(), max_new_tokens=6, do_sample=False, past_key_values=cache)
    finally:
        handle.remove()
    assert out.shape == (1, 46)
    assert seen_positions == [list(range(40)), [40], [41], [42], [43], [44]]
    assert cache.get_seq_length() == 45
    for layer in cache.layers:
        assert layer.num_resident_tokens == 16
        positions = layer.positions[0]
        assert bool((positions[:, 1:] > positions[:, :-1]).all())        # order kept, no duplicates
        assert positions[:, -1].tolist() == [44, 44]                      # the newest token survives
    assert cache.get_mask_sizes(1, 0) == (17, 45 - 16)


def test_policy_rejects_bad_budgets():
    with pytest.raises(UserError):
        EvictionPolicy("h2o")
    with pytest.raises(UserError):
        EvictionPolicy("h2o", keep=0.0)
    with pytest.raises(UserError):
        EvictionPolicy("lru", keep=0.5)
    assert EvictionPolicy("h2o", keep=0.25).budget(10) == 3
    assert EvictionPolicy("h2o", keep=0.5).budget(10) == 5


def _gathered_cache(config, full: DynamicCache, evicted: EvictionCache) -> DynamicCache:
    """A plain cache holding, per layer and KV head, exactly the full-precision KV of the survivors."""
    out = DynamicCache(config=config)
    for idx, (full_layer, layer) in enumerate(zip(full.layers, evicted.layers)):
        gather = layer.positions.unsqueeze(-1).expand(*layer.positions.shape, full_layer.keys.shape[-1])
        out.update(full_layer.keys.gather(2, gather), full_layer.values.gather(2, gather), idx)
    return out


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv"])
def test_after_eviction_the_next_token_sees_the_survivors_at_their_original_positions(tiny_model, name):
    model, ids, nxt = tiny_model.model, _prompt(), torch.tensor([[9]])
    cache = EvictionCache.for_model(tiny_model, EvictionPolicy(name, budget_tokens=16, window_tokens=4))
    full = DynamicCache(config=tiny_model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache)
        model(ids, past_key_values=full)
        reference = _gathered_cache(tiny_model.config, full, cache)
        shifted = _gathered_cache(tiny_model.config, full, cache)
        got = model(nxt, past_key_values=cache).logits[0, -1]
        # the reference attends to the same 16 survivors; the new token is RoPE-rotated at position 40
        want = model(nxt, past_key_values=reference, position_ids=torch.tensor([[40]])).logits[0, -1]
        wrong = model(nxt, past_key_values=shifted).logits[0, -1]  # position 16: the resident count
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, wrong, atol=1e-3)


def test_snapkv_selects_tokens_per_head_and_h2o_keeps_its_recent_half(tiny_model):
    kept = {}
    for name in ("h2o", "snapkv"):
        cache = EvictionCache.for_model(tiny_model, EvictionPolicy(name, budget_tokens=12, window_tokens=4))
        with torch.inference_mode():
            tiny_model.model(_prompt(), past_key_values=cache)
        kept[name] = cache.layers[0].positions[0]
        assert kept[name].shape == (2, 12)
    # H2O: the 6 most recent tokens + the heaviest older ones (accumulated causal mass favours the start)
    assert kept["h2o"][:, 6:].tolist() == [list(range(34, 40))] * 2
    # SnapKV: the 4-token observation window + the top of each KV head's own scores
    assert kept["snapkv"][:, 8:].tolist() == [list(range(36, 40))] * 2
    assert not torch.equal(kept["snapkv"][0], kept["snapkv"][1])


def test_keep_fraction_follows_the_tokens_seen_during_decode(tiny_model):
    cache = EvictionCache.for_model(tiny_model, EvictionPolicy("streamingllm", keep=0.25, num_sink_tokens=2))
    tiny_model.model.generate(_prompt(), max_new_tokens=8, do_sample=False, past_key_values=cache)
    layer = cache.layers[0]
    assert layer.num_seen_tokens == 47 and layer.num_resident_tokens == 12     # ceil(0.25 * 47)
    assert layer.positions[0, 0].tolist() == [0, 1, *range(37, 47)]
