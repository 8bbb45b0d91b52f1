"""Killing the pool backend (redis-server, or the Mooncake master + memory server) mid-run loses no request: the engine keeps serving from
the device and DRAM, and every text equals its run without any tiers."""

import asyncio

import httpx
import pytest

from kvtier.codecs import get_codec
from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from kvtier.tiers.manager import build_manager
from kvtier.server.app import create_app
from kvtier.server.tokenizer import ByteTokenizer
from kvtier.bench.pools import MooncakePool, RedisServer
from server_support import running

pytestmark = pytest.mark.services
BLOCK, NUM_BLOCKS, MAX_TOKENS = 8, 40, 16


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_pool_killed_mid_run(kind, tiny_model, shakespeare_text, tmp_path):
    prompts = [shakespeare_text[100 * i:100 * i + 60 + 5 * i] for i in range(16)]
    tokenizer = ByteTokenizer()
    layout = tiny_model.kv_layout(BLOCK)
    config = EngineConfig(device_kv_budget_bytes=NUM_BLOCKS * layout.block_bytes, block_tokens=BLOCK,
                          max_prefill_tokens=64, max_model_tokens=512)
    plain = LLMEngine(tiny_model, config)
    expected = [tokenizer.decode(ids) for ids in
                plain.generate([tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=MAX_TOKENS))]
    redis = RedisServer(tmp_path) if kind == "redis" else MooncakePool(tmp_path, segment="64MB")
    redis.start()
    manager = build_manager(["dram:32KiB", redis.spec], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    app = create_app(AsyncEngine(LLMEngine(tiny_model, config, manager)), tokenizer, "tiny", manager=manager,
                     on_shutdown=manager.close)
    try:
        with running(app) as url:
            async def one(client, prompt):
                r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                               "max_tokens": MAX_TOKENS, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            async def main():
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    warm = [await one(client, p) for p in prompts[:8]]  # blocks now live in DRAM and redis
                    tasks = [asyncio.create_task(one(client, p)) for p in prompts]
                    await tasks[0]
                    await asyncio.to_thread(redis.kill)
                    return warm, await asyncio.gather(*tasks)
            warm, texts = asyncio.run(main())
            again = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompts[3],
                                                              "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    finally:
        redis.kill()
    assert warm == expected[:8] and texts == expected
    assert again["choices"][0]["text"] == expected[3]
    pool = manager.tiers[1]
    assert pool.stats.puts > 0 and pool.stats.hits > 0  # the pool served prefixes before the kill
    assert not pool.health.healthy or pool.stats.errors > 0  # and the kill was noticed, not hidden
