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


def test_penalties_and_bias_on_hand_made_logits():
    from kvtier.engine.sampler import Penalties, process_logits

    logits = _f32([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    pad = 4  # the vocab size pads the id rows
    penalties = Penalties(repetition=_f32([2.0, 1.0]), presence=_f32([0.0, 0.5]), frequency=_f32([0.0, 0.25]),
                          output_ids=torch.tensor([[1, pad, pad], [0, 0, 3]]),
                          seen_ids=torch.tensor([[0, 1, pad], [0, 0, 3]]))
    bias = torch.zeros(2, 4)
    bias[1, 2] = 3.0
    out = process_logits(logits, bias, penalties)
    # row 0: repetition 2 on tokens 0 (positive: halved) and 1 (negative: doubled)
    # row 1: token 0 twice: -0.5 - 2 * 0.25; token 3 once: -0.5 - 0.25; token 2: bias + 3
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.0], [1.0, -1.0, 3.5, 0.25]]
    assert process_logits(logits, None, None) is logits


def test_top_k_and_min_p_limit_what_is_drawn():
    logits = torch.log(_f32([[0.5, 0.3, 0.15, 0.05]] * 3))
    drawn = {row: set() for row in range(3)}
    for seed in range(200):
        token_ids, bad = sample(logits, _f32([1.0] * 3), _f32([1.0] * 3), [_gen(seed), _gen(seed + 1000), None],
                                top_ks=torch.tensor([2, 0, 1]), min_ps=_f32([0.0, 0.5, 0.0]))
        assert not bad.any()
        for row, token in enumerate(token_ids.tolist()):
            drawn[row].add(token)
    # top_k 2: the two most likely; min_p 0.5: p >= 0.25 (0.5, 0.3); top_k 1: the argmax
    assert drawn == {0: {0, 1}, 1: {0, 1}, 2: {0}}
