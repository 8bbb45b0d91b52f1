"""The background step loop: concurrent asyncio streams, early exit aborts, bad requests."""

import asyncio

import pytest

from kvtier.engine import AsyncEngine, EngineConfig, EngineDeadError, LLMEngine, SamplingParams


@pytest.fixture
def async_engine(tiny_model):
    config = EngineConfig(device_kv_budget_bytes=64 * tiny_model.kv_layout(8).block_bytes, block_tokens=8,
                          max_prefill_tokens=16, max_model_tokens=128)
    engine = AsyncEngine(LLMEngine(tiny_model, config))
    engine.start()
    yield engine
    engine.shutdown()


async def collect(engine, request_id, prompt, max_tokens=12):
    return [t async for out in engine.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens))
            for t in out.new_token_ids]


def test_concurrent_streams_match_solo_runs(async_engine, tiny_prompts):
    async def main():
        solo = [await collect(async_engine, f"solo{i}", p) for i, p in enumerate(tiny_prompts)]
        together = await asyncio.gather(*(collect(async_engine, f"c{i}", p) for i, p in enumerate(tiny_prompts)))
        return solo, together
    solo, together = asyncio.run(main())
    assert together == solo and all(len(t) == 12 for t in solo)


def test_leaving_early_aborts_and_frees(async_engine, tiny_prompts):
    async def main():
        async for _ in async_engine.generate("gone", tiny_prompts[2], SamplingParams(max_tokens=50)):
            break
        return await collect(async_engine, "next", tiny_prompts[0])
    assert len(asyncio.run(main())) == 12
    assert async_engine.engine.request_ids() == []
    assert async_engine.engine.stats().num_device_blocks_used == 0


def test_bad_request_raises_in_its_stream_only(async_engine, tiny_prompts):
    async def main():
        with pytest.raises(ValueError, match="context"):
            await collect(async_engine, "long", [5] * 200)
        return await collect(async_engine, "ok", tiny_prompts[0])
    assert len(asyncio.run(main())) == 12


def test_generate_after_shutdown_fails(tiny_model, async_engine, tiny_prompts):
    async_engine.shutdown()

    async def main():
        await collect(async_engine, "late", tiny_prompts[0])
    with pytest.raises(EngineDeadError):
        asyncio.run(main())
