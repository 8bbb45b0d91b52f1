"""Bounded load on 127.0.0.1: 24 concurrent streaming clients on a device budget too small for all of
them (preemption and tier traffic happen); every text equals the same request run alone."""

import asyncio
import json

import httpx

from server_support import running, tiny_app

NUM_CLIENTS = 24
MAX_TOKENS = 24


def prompts(text: str) -> list[str]:
    # shared prefixes of different lengths (multi-turn style) and some unrelated prompts
    return [text[:40 + 7 * i] if i % 3 else text[1000 + 13 * i:1060 + 13 * i] for i in range(NUM_CLIENTS)]


async def solo(client: httpx.AsyncClient, prompt: str) -> str:
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def streamed(client: httpx.AsyncClient, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


def test_concurrent_streams_equal_solo_runs(tiny_model, shakespeare_text):
    app = tiny_app(tiny_model, num_blocks=40)  # 320 tokens of KV for ~24 x 150
    texts = prompts(shakespeare_text)
    with running(app) as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                alone = [await solo(client, p) for p in texts]
                together = await asyncio.gather(*(streamed(client, p) for p in texts))
            return alone, together
        alone, together = asyncio.run(main())
        stats = app.state.kvtier.engine.engine.stats()
    assert together == alone
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.prefix_hit_tokens_by_tier  # the shared prefixes were reused
    assert stats.num_blocks_written_to_tiers > 0  # 24 solo runs overflow 40 blocks: evictions went to DRAM
