"""Bounded load on 127.0.0.1: 24 concurrent streaming clients (and 5 more that hang up mid-stream) on a
device budget too small for all of them; every complete text equals the same request run alone."""

import asyncio
import json
import time

import httpx

from server_support import running, tiny_app

NUM_CLIENTS = 24
MAX_TOKENS = 24
QUITTER_MAX_TOKENS = 96  # + the longest quitter's prompt (180 tokens) fits the 320-token budget


def prompts(text: str) -> list[str]:
    # shared prefixes of different lengths (multi-turn style) and some unrelated prompts
    return [text[:40 + 7 * i] if i % 3 else text[1000 + 13 * i:1060 + 13 * i] for i in range(NUM_CLIENTS)]


async def solo(client: httpx.AsyncClient, prompt: str) -> str:
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def streamed(client: httpx.AsyncClient, prompt: str, hang_up_after: int | None = None) -> str:
    # a client that hangs up asks for more tokens: on a loaded machine a 24-token request can finish
    # before the server hears the socket close (it then counts as finished, not aborted)
    max_tokens = MAX_TOKENS if hang_up_after is None else QUITTER_MAX_TOKENS
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
            if hang_up_after is not None and len(parts) >= hang_up_after:
                break  # the client goes away mid-stream
    return "".join(parts)


def test_concurrent_streams_equal_solo_runs(tiny_model, shakespeare_text):
    app = tiny_app(tiny_model, num_blocks=40)  # 320 tokens of KV for ~24 x 150
    texts = prompts(shakespeare_text)
    with running(app) as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                alone = [await solo(client, p) for p in texts]
                quitters = [streamed(client, texts[i], hang_up_after=2) for i in range(0, NUM_CLIENTS, 5)]
                together, _ = await asyncio.gather(asyncio.gather(*(streamed(client, p) for p in texts)),
                                                   asyncio.gather(*quitters))
            return alone, together
        alone, together = asyncio.run(main())
        engine = app.state.kvtier.engine.engine
        for _ in range(500):  # bounded wait for the hung-up requests to be aborted
            if not engine.request_ids():
                break
            time.sleep(0.02)
        stats = engine.stats()
        num_aborted = app.state.kvtier.metrics.totals.num_finished_by_reason.get("abort", 0)
    assert together == alone
    assert num_aborted == 5
    assert stats.num_running == stats.num_waiting == 0
    assert stats.prefix_hit_tokens_by_tier  # the shared prefixes were reused
    assert stats.num_blocks_written_to_tiers > 0  # 24 solo runs overflow 40 blocks: evictions went to DRAM
