"""The engine's sampling options on the tiny random Llama, against transformers where it has the same
thing: logprobs == log_softmax of the model's own forward, repetition_penalty == generate's
RepetitionPenaltyLogitsProcessor; logit_bias, allowed_token_ids, min_tokens, stop_token_ids,
presence/frequency penalties by what they must do to greedy output."""

import sys
from pathlib import Path

import pytest
import torch

from kvtier.engine import EngineConfig, LLMEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

BLOCK = 8
NEW = 12


def make_engine(model, num_blocks=64, **kwargs):
    kwargs.setdefault("max_prefill_tokens", 16)  # prompts span several chunks
    config = EngineConfig(device_kv_budget_bytes=num_blocks * model.kv_layout(BLOCK).block_bytes,
                          block_tokens=BLOCK, **kwargs)
    return LLMEngine(model, config)


def outputs_of(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(request_id, prompt, sampling)
    got: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
    return got


def hf_log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: log_softmax of transformers' own forward over the whole sequence."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_equal_transformers_log_softmax(tiny_model, tiny_prompts):
    model = tiny_model.model
    prompt = tiny_prompts[2]  # 40 tokens: three prefill chunks of 16
    engine = make_engine(tiny_model)
    # the same prompt twice: the second must not take the first's cached blocks (it needs their logits)
    got = outputs_of(engine, {"a": (prompt, SamplingParams(max_tokens=NEW, logprobs=5, prompt_logprobs=3))})
    again = outputs_of(engine, {"b": (prompt, SamplingParams(max_tokens=NEW, logprobs=5, prompt_logprobs=3))})
    outs = got["a"]
    generated = [o.new_token_ids[0] for o in outs]
    assert generated == reference(model, prompt, NEW)
    ref = hf_log_softmax(model, prompt + generated)  # row i scores token i + 1
    prompt_lps = outs[0].prompt_logprobs
    assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    scored = [(i, lp) for i, lp in enumerate(prompt_lps) if lp is not None]
    scored += [(len(prompt) + k, o.logprobs[0]) for k, o in enumerate(outs)]
    max_diff = 0.0
    for i, lp in scored:
        row = ref[i - 1]
        assert lp.token_id == (prompt + generated)[i]
        assert lp.rank == int((row > row[lp.token_id]).sum()) + 1
        k = 3 if i < len(prompt) else 5
        assert [t for t, _ in lp.top] == row.topk(k).indices.tolist()
        max_diff = max(max_diff, abs(lp.logprob - row[lp.token_id].item()),
                       *(abs(v - row[t].item()) for t, v in lp.top))
    assert max_diff < 1e-4, max_diff
    assert all(o.logprobs[0].rank == 1 for o in outs)  # greedy
    assert again["b"][0].num_cached_tokens == 0
    assert [o.new_token_ids[0] for o in again["b"]] == generated
    assert [(lp.token_id, lp.rank) for lp in again["b"][0].prompt_logprobs[1:]] == \
           [(lp.token_id, lp.rank) for lp in prompt_lps[1:]]


def test_logprobs_off_by_default_and_zero_means_the_sampled_token_only(tiny_model, tiny_prompts):
    got = outputs_of(make_engine(tiny_model), {
        "off": (tiny_prompts[0], SamplingParams(max_tokens=3)),
        "zero": (tiny_prompts[0], SamplingParams(max_tokens=3, logprobs=0))})
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in got["off"])
    assert [(len(o.logprobs), o.logprobs[0].top) for o in got["zero"]] == [(1, [])] * 3


def test_logit_bias_and_allowed_token_ids_steer_greedy_output(tiny_model, tiny_prompts):
    prompt = tiny_prompts[1]
    free = reference(tiny_model.model, prompt, NEW)
    target = next(t for t in range(3, 256) if t not in free)
    got = outputs_of(make_engine(tiny_model), {
        "bias": (prompt, SamplingParams(max_tokens=NEW, logit_bias={target: 100.0})),
        "ban": (prompt, SamplingParams(max_tokens=NEW, logit_bias={free[0]: -100.0})),
        "allowed": (prompt, SamplingParams(max_tokens=NEW, allowed_token_ids=[target, 60])),
    })
    assert [o.new_token_ids[0] for o in got["bias"]] == [target] * NEW
    assert got["ban"][0].new_token_ids[0] != free[0]
    assert {o.new_token_ids[0] for o in got["allowed"]} <= {target, 60}


def test_min_tokens_masks_stop_tokens_until_reached(tiny_model, tiny_prompts):
    prompt = tiny_prompts[1]
    free = reference(tiny_model.model, prompt, NEW)
    stop = free[0]  # greedy would stop at once on it
    got = outputs_of(make_engine(tiny_model), {
        "plain": (prompt, SamplingParams(max_tokens=NEW, stop_token_ids=[stop])),
        "min": (prompt, SamplingParams(max_tokens=NEW, stop_token_ids=[stop], min_tokens=4)),
    })
    assert [o.new_token_ids[0] for o in got["plain"]] == [stop] and got["plain"][-1].finish_reason == "stop"
    tokens = [o.new_token_ids[0] for o in got["min"]]
    assert stop not in tokens[:4] and len(tokens) >= 5
    assert got["min"][-1].finish_reason == ("stop" if tokens[-1] == stop else "length")


def test_repetition_penalty_equals_transformers_generate(tiny_model, tiny_prompts):
    prompt = tiny_prompts[1]  # greedy repeats itself on it
    model = tiny_model.model
    want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                          repetition_penalty=1.8)[0, len(prompt):].tolist()
    got = outputs_of(make_engine(tiny_model), {
        "r": (prompt, SamplingParams(max_tokens=NEW, repetition_penalty=1.8)),
        "plain": (prompt, SamplingParams(max_tokens=NEW))})
    assert [o.new_token_ids[0] for o in got["r"]] == want
    assert want != [o.new_token_ids[0] for o in got["plain"]]  # it acts on this prompt


def test_presence_and_frequency_penalties_forbid_repeats(tiny_model, tiny_prompts):
    """The tiny model's logits span about 1: a penalty of 2 outweighs that, so greedy output never
    repeats a token; without it, it does."""
    prompt = tiny_prompts[1]
    plain = reference(tiny_model.model, prompt, NEW)
    assert len(set(plain)) < NEW
    got = outputs_of(make_engine(tiny_model), {
        "frequency": (prompt, SamplingParams(max_tokens=NEW, frequency_penalty=2.0)),
        "presence": (prompt, SamplingParams(max_tokens=NEW, presence_penalty=2.0)),
        "negative": (prompt, SamplingParams(max_tokens=NEW, presence_penalty=-2.0))})
    for name in ("frequency", "presence"):
        tokens = [o.new_token_ids[0] for o in got[name]]
        assert tokens[0] == plain[0]  # nothing generated yet: nothing to penalize
        assert len(set(tokens)) == NEW, (name, tokens)
    assert [o.new_token_ids[0] for o in got["negative"]] == [plain[0]] * NEW  # a bonus: the first token forever


@pytest.mark.parametrize("bad, message", [
    (dict(min_p=1.5), "min_p"), (dict(top_k=-1), "top_k"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logprobs=21), "logprobs"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_bad_sampling_params_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_token_ids_outside_the_vocabulary_are_refused_at_admission(tiny_model):
    engine = make_engine(tiny_model)
    for sampling in (SamplingParams(stop_token_ids=[256]), SamplingParams(logit_bias={999: 1.0}),
                     SamplingParams(allowed_token_ids=[5, 300])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("x", [1, 2, 3], sampling)
