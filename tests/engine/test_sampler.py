"""The batched sampler on hand-made logits: greedy rows, hostile temperatures and top_p, NaN rows,
seeded rows independent of the batch, and the distribution it samples."""

import math

import torch

from kvtier.engine.sampler import MIN_TEMPERATURE, sample


def _f32(values):
    return torch.tensor(values, dtype=torch.float32)


def _logits(num_rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_and_tiny_temperatures_are_argmax():
    logits = _logits(5)
    temperatures = _f32([0.0, 1e-300, 5e-324, MIN_TEMPERATURE / 2, 0.0])  # the doubles become 0 in float32
    token_ids, bad = sample(logits, temperatures, _f32([1.0] * 5), [None] * 5)
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert bad.tolist() == [False] * 5


def test_tiny_top_p_keeps_the_top_token():
    logits = _logits(4, seed=1)
    for top_p in (1e-300, 1e-30, 1e-7):  # 0 or denormal-small once in float32
        token_ids, bad = sample(logits, _f32([1.0] * 4), _f32([top_p] * 4), [None] * 4)
        assert token_ids.tolist() == logits.argmax(dim=-1).tolist() and not bad.any()


def test_a_nan_row_is_flagged_and_the_others_sample():
    logits = _logits(3, seed=2)
    logits[1, 7] = math.nan
    for temperature in (0.0, 0.7):
        token_ids, bad = sample(logits, _f32([temperature] * 3), _f32([0.9] * 3), [_gen(1), _gen(2), _gen(3)])
        assert bad.tolist() == [False, True, False]
    greedy, _ = sample(logits, _f32([0.0] * 3), _f32([1.0] * 3), [None] * 3)
    assert greedy[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()


def test_a_seeded_row_ignores_the_rest_of_the_batch():
    logits = _logits(4, seed=3) / 4
    temperatures, top_ps = _f32([0.0, 1.3, 2.0, 0.5]), _f32([1.0, 0.5, 0.95, 1.0])

    def six_tokens(draw) -> list[int]:
        gen = _gen(42)
        return [draw(gen) for _ in range(6)]
    alone = six_tokens(lambda gen: sample(logits[2:3], temperatures[2:3], top_ps[2:3], [gen])[0][0].item())
    batched = six_tokens(lambda gen: sample(logits, temperatures, top_ps, [None, _gen(7), gen, None])[0][2].item())
    assert batched == alone and len(set(alone)) > 1


def test_sampled_frequencies_follow_the_probabilities():
    # probs [0.1, 0.2, 0.3, 0.4]; top_p 0.75 keeps the three most likely (0.4 + 0.3 < 0.75 <= 0.9)
    logits = torch.log(_f32([[0.1, 0.2, 0.3, 0.4]])).repeat(4000, 1)
    gen = _gen(5)
    token_ids, _ = sample(logits, _f32([1.0] * 4000), _f32([1.0] * 4000), [gen] * 4000)
    counts = torch.bincount(token_ids, minlength=4) / 4000
    assert torch.allclose(counts, _f32([0.1, 0.2, 0.3, 0.4]), atol=0.03), counts
    token_ids, _ = sample(logits, _f32([1.0] * 4000), _f32([0.75] * 4000), [gen] * 4000)
    counts = torch.bincount(token_ids, minlength=4) / 4000
    assert counts[0] == 0 and torch.allclose(counts[1:], _f32([2, 3, 4]) / 9, atol=0.03), counts
