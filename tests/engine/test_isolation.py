"""One request never breaks the others: hostile sampling values, a row that cannot be sampled, a
failing admission, copy or forward — each fails (or is handled for) its own sequences only, and the
rest of the batch gives exactly the tokens it gives alone."""

import math
import sys
from pathlib import Path

import pytest

from kvtier.codecs import get_codec
from kvtier.engine import ContextLengthError, EngineConfig, LLMEngine, SamplingParams
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

BLOCK = 8
NEW = 12


@pytest.fixture(scope="module")
def refs(tiny_model, tiny_prompts):
    return [reference(tiny_model.model, p, NEW) for p in tiny_prompts[:4]]


def make_engine(model, num_blocks=64, manager=None, **kwargs):
    kwargs.setdefault("max_prefill_tokens", 16)
    config = EngineConfig(device_kv_budget_bytes=num_blocks * model.kv_layout(BLOCK).block_bytes,
                          block_tokens=BLOCK, **kwargs)
    return LLMEngine(model, config, manager)


def hostile(**fields) -> SamplingParams:
    """Sampling values as if validation had let them through."""
    sampling = SamplingParams(max_tokens=NEW)
    for name, value in fields.items():
        setattr(sampling, name, value)
    return sampling


def run(engine, requests: dict[str, tuple]) -> dict[str, tuple[list[int], str, str | None]]:
    """requests: id -> (prompt, sampling[, namespace]), all added before the first step.
    Returns id -> (tokens, finish reason, error)."""
    for request_id, (prompt, sampling, *namespace) in requests.items():
        engine.add_request(request_id, prompt, sampling, *namespace)
    got = {request_id: ([], None, None) for request_id in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    assert engine.request_ids() == [] and engine.stats().num_device_blocks_used == 0
    return got


def normal(tiny_prompts, refs) -> tuple[dict, dict]:
    """Three greedy requests and what each must give."""
    requests = {f"ok{i}": (tiny_prompts[i], SamplingParams(max_tokens=NEW)) for i in range(3)}
    return requests, {f"ok{i}": (refs[i], "length", None) for i in range(3)}


def test_sampling_params_reject_what_the_sampler_cannot_take():
    for fields in ({"seed": 2**64}, {"seed": -2**63 - 1}, {"temperature": math.nan}, {"temperature": math.inf},
                   {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": math.nan}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match=next(iter(fields))):
            SamplingParams(**fields)
    SamplingParams(seed=2**64 - 1, temperature=1e-300, top_p=1e-300)  # accepted: greedy / top-1


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                    {"temperature": 1.0, "top_p": 1e-300}])
def test_tiny_temperature_or_top_p_is_greedy(tiny_model, tiny_prompts, refs, fields):
    requests, expected = normal(tiny_prompts, refs)
    requests["tiny"] = (tiny_prompts[3], hostile(**fields))
    expected["tiny"] = (refs[3], "length", None)
    assert run(make_engine(tiny_model), requests) == expected


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_torch_refuses_fails_that_request_alone(tiny_model, tiny_prompts, refs, seed):
    requests, expected = normal(tiny_prompts, refs)
    requests["bad"] = (tiny_prompts[3], hostile(temperature=0.8, seed=seed))
    got = run(make_engine(tiny_model), requests)
    tokens, reason, error = got.pop("bad")
    assert (tokens, reason) == ([], "error") and f"seed {seed}" in error
    assert got == expected


def test_nan_logits_fail_that_row_alone(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model)
    lm_head = engine.runner.lm_head
    poisoned = []

    def first_row_nan(hidden):
        logits = lm_head(hidden)
        if not poisoned:  # the first sampling step: "bad" (added first) is row 0
            poisoned.append(True)
            logits[0] = math.nan
        return logits
    engine.runner.lm_head = first_row_nan
    requests, expected = normal(tiny_prompts, refs)
    got = run(engine, {"bad": (tiny_prompts[3], SamplingParams(max_tokens=NEW, temperature=0.7)), **requests})
    assert got.pop("bad") == ([], "error", "sampling failed: the model's logits are NaN")
    assert got == expected


def test_a_sampler_exception_fails_only_its_row(tiny_model, tiny_prompts, refs, monkeypatch):
    import kvtier.engine.model_runner as model_runner

    real_sample = model_runner.sample

    def fragile(logits, temperatures, top_ps, generators, **filters):
        if bool((top_ps == 0.5).any()):
            raise RuntimeError("boom")
        return real_sample(logits, temperatures, top_ps, generators, **filters)
    monkeypatch.setattr(model_runner, "sample", fragile)
    requests, expected = normal(tiny_prompts, refs)
    requests["bad"] = (tiny_prompts[3], SamplingParams(max_tokens=NEW, temperature=0.7, top_p=0.5))
    got = run(make_engine(tiny_model), requests)
    assert got.pop("bad") == ([], "error", "sampling failed: boom")
    assert got == expected


def test_a_failed_admission_fails_that_request_alone(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model)
    space = engine.scheduler._space

    def refuse_mallory(namespace):
        if namespace == "mallory":
            raise ValueError("no keys for mallory")
        return space(namespace)
    engine.scheduler._space = refuse_mallory
    requests, expected = normal(tiny_prompts, refs)
    got = run(engine, {"bad": (tiny_prompts[3], SamplingParams(max_tokens=NEW), "mallory"), **requests})
    assert got.pop("bad") == ([], "error", "admission failed: no keys for mallory")
    assert got == expected
    with pytest.raises(ValueError, match="UTF-8"):
        engine.add_request("surrogate", tiny_prompts[0], SamplingParams(), namespace="\ud800")


def test_a_failed_forward_fails_its_step_not_the_waiting(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model, max_num_seqs=2)  # ok0, ok1 run; ok2 waits
    decoder = engine.runner.decoder
    calls = []

    def fail_once(**kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        if len(calls) == 2:  # ok0 and ok1's second step
            raise RuntimeError("device lost")
        return decoder(**kwargs)
    engine.runner.decoder = fail_once
    requests, expected = normal(tiny_prompts, refs)
    got = run(engine, requests)
    assert got["ok0"] == (refs[0][:1], "error", "the forward failed: device lost")  # its prefill step went well
    assert got["ok1"] == ([], "error", "the forward failed: device lost")
    assert got["ok2"] == expected["ok2"]


def test_a_failed_copy_of_a_tier_load_is_recomputed_not_served(tiny_model, tiny_prompts, refs):
    """The prefix loaded from DRAM cannot be copied into the device: its blocks are never registered
    (a key always names written KV), the request computes its whole prompt and answers exactly."""
    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager(["dram:1MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        first = make_engine(tiny_model, manager=manager)
        assert first.generate([tiny_prompts[2]], SamplingParams(max_tokens=NEW)) == [refs[2]]
        first.flush_to_tiers()
        engine = make_engine(tiny_model, manager=manager)  # a fresh device: the prefix comes from DRAM
        assert engine.transfer.write_block == engine.arena.write_block  # the worker writes the device blocks
        engine.transfer.write_block = lambda block_id, block: (_ for _ in ()).throw(RuntimeError("copy failed"))
        got = run(engine, {"loaded": (tiny_prompts[2], SamplingParams(max_tokens=NEW))})
        assert got == {"loaded": (refs[2], "length", None)}
        assert engine.stats().prefix_hit_tokens_by_tier == {}  # nothing counted as loaded
        engine.transfer.write_block = engine.arena.write_block
        assert run(engine, {"again": (tiny_prompts[2], SamplingParams(max_tokens=NEW))}) == {
            "again": (refs[2], "length", None)}
        assert engine.stats().prefix_hit_tokens_by_tier == {"device": 32}  # the recomputed blocks serve
    finally:
        manager.close()


def test_a_seeded_request_gives_the_same_tokens_in_any_batch(tiny_model, tiny_prompts):
    seeded = SamplingParams(max_tokens=NEW, temperature=1.5, seed=1234)
    alone = run(make_engine(tiny_model), {"s": (tiny_prompts[1], seeded)})
    crowd = {f"o{i}": (tiny_prompts[i], SamplingParams(max_tokens=NEW, temperature=t))
             for i, t in ((0, 0.0), (2, 1.0), (3, 0.7))}
    together = run(make_engine(tiny_model), {**crowd, "s": (tiny_prompts[1], seeded)})
    assert together["s"] == alone["s"] and len(set(alone["s"][0])) > 1


def test_max_tokens_beyond_the_context_is_rejected_not_clamped(tiny_model):
    engine = make_engine(tiny_model, max_model_tokens=64)
    with pytest.raises(ContextLengthError, match="Rejected, not clamped: ask for at most 54 tokens") as info:
        engine.add_request("long", [5] * 10, SamplingParams(max_tokens=55))
    assert info.value.param == "max_tokens" and "context is 64 tokens" in str(info.value)
    engine.add_request("fits", [5] * 10, SamplingParams(max_tokens=54))
    with pytest.raises(ContextLengthError) as info:
        engine.add_request("prompt", [5] * 64, SamplingParams(max_tokens=1))
    assert info.value.param == "prompt"


def test_unexpected_step_failure_in_the_async_loop_spares_waiting_requests(tiny_model, tiny_prompts, refs):
    import asyncio

    from kvtier.engine import AsyncEngine, RequestFailedError

    engine = make_engine(tiny_model, max_num_seqs=1)
    postprocess, calls = engine.scheduler.postprocess, []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("bookkeeping bug")
        return postprocess(*args, **kwargs)
    engine.scheduler.postprocess = fail_third
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def collect(request_id, prompt):
        try:
            return [t async for out in async_engine.generate(request_id, prompt, SamplingParams(max_tokens=NEW))
                    for t in out.new_token_ids]
        except RequestFailedError as exc:
            return str(exc)

    async def main():
        return await asyncio.gather(collect("first", tiny_prompts[0]), collect("second", tiny_prompts[1]))
    try:
        first, second = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert first == "engine step failed: bookkeeping bug" and second == refs[1]
