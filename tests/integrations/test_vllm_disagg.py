"""Prefill/decode disaggregation under real vLLM (the CPU build in `.venv-vllm`): three engine starts.

1. vLLM alone: the reference replies, and its TTFT computing a ~4k-token prompt.
2. A `kv_producer` and a `kv_consumer` vLLM sharing three tiers, `[shm, mooncake, redis]`, behind kvtier's
   proxy. The producer writes every full block through to all three before its reply leaves; the consumer's
   lookup asks them top-down and loads each block where it found it. In turn:
   - shm holds the prompt: the consumer loads every full block from it and prints vLLM alone's text; its
     TTFT on another ~4k-token prompt, prefilled by the producer, is measured (printed, not asserted: no
     timed asserts);
   - shm's directory removed: the producer's shm writes fail (counted), its write-through to the pools goes
     on, and the consumer loads the next prompt from Mooncake;
   - Mooncake's master stopped: both engines find the pool dead and skip it, and the consumer loads the
     next prompt from Redis; no prefill fails;
   - the producer killed mid-run: the consumer computes the prompt itself and nothing fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from kvtier import models
from kvtier.bench.pools import MooncakePool, RedisServer
from kvtier.bench.servers import DisaggSystem

sys.path.insert(0, str(Path(__file__).parent))
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, start_vllm  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing: `make vllm` creates it"),
]
MAX_MODEL_LEN = 4608
PROMPT_CHARS = 14000      # ~4k tokens
POOL_PROMPT_CHARS = 4000  # ~1.1k tokens: the pool steps check where blocks come from, not how fast
_PROMPT_CHARS = {"disagg": PROMPT_CHARS, "ttft": PROMPT_CHARS, "killed": PROMPT_CHARS, "fresh": PROMPT_CHARS,
                 "mooncake": POOL_PROMPT_CHARS, "redis": POOL_PROMPT_CHARS}
_REFERENCE_NAMES = ("disagg", "mooncake", "redis", "killed")


@pytest.fixture(scope="module")
def prompts(shakespeare_text) -> dict[str, str]:
    return {name: shakespeare_text[i * 20000:i * 20000 + num_chars]
            for i, (name, num_chars) in enumerate(_PROMPT_CHARS.items())}


def ttft(url: str, prompt: str) -> float:
    """Seconds to the first streamed token of a greedy completion."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def loadable_tokens(reply: dict) -> int:
    """Prompt tokens the consumer can load: full blocks, the last token always computed."""
    return (len(reply["prompt_token_ids"]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.fixture(scope="module")
def reference(prompts, tmp_path_factory) -> dict:
    with start_vllm(tmp_path_factory.mktemp("vllm") / "alone.log",
                    extra_args=("--max-model-len", str(MAX_MODEL_LEN))) as server:
        out = {name: server.complete(prompts[name]) for name in _REFERENCE_NAMES}
        ttft(server.url, prompts["disagg"][:200])  # warm up
        out["ttft_s"] = ttft(server.url, prompts["ttft"])
    return out


@pytest.fixture
def shm_dir():
    path = tempfile.mkdtemp(prefix="kvtier-disagg-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_consumer_loads_from_each_shared_tier_in_turn_and_a_dead_pool_or_producer_fails_nothing(
        reference, prompts, shm_dir, tmp_path_factory):
    model_dir = models.cache_dir() / "smollm2-135m-instruct"
    log_dir = tmp_path_factory.mktemp("disagg")
    # room for every prompt (~1.5 MB a block): neither pool evicts during the test
    with MooncakePool(log_dir, segment="1GB") as mooncake, RedisServer(log_dir, maxmemory="1gb") as redis, \
            DisaggSystem(model_dir, log_dir, [f"shm:{shm_dir}:2GiB", mooncake.spec, redis.spec],
                         max_model_len=MAX_MODEL_LEN) as system:
        reply = system.complete(prompts["disagg"])
        num_prompt = len(reply["prompt_token_ids"])
        assert num_prompt > 3500
        loadable = loadable_tokens(reply)
        assert reply["kvtier_hit_tokens"] == {"shm": loadable} and loadable >= num_prompt - BLOCK_TOKENS
        assert reply["text"] == reference["disagg"]["text"]

        # TTFT: the producer prefills (as the proxy does), then the consumer is timed alone
        system.producer.complete(prompts["ttft"], max_tokens=1)
        consumer_ttft = ttft(system.consumer.url, prompts["ttft"])
        print(f"\nTTFT on a {num_prompt}-token prompt: vLLM alone {reference['ttft_s']:.3f} s, "
              f"consumer after the producer's prefill {consumer_ttft:.3f} s "
              f"({reference['ttft_s'] / consumer_ttft:.1f}x lower)")

        # shm gone: the producer writes every block through to every tier, so files removed now would be
        # written again by the next prefill; without its directory the producer's shm writes fail (counted)
        # and its write-through to the pools goes on
        shutil.rmtree(shm_dir)
        from_mooncake = system.complete(prompts["mooncake"])
        assert from_mooncake["kvtier_hit_tokens"] == {"mooncake": loadable_tokens(from_mooncake)}
        assert loadable_tokens(from_mooncake) >= 30 * BLOCK_TOKENS
        assert from_mooncake["text"] == reference["mooncake"]["text"]

        mooncake.kill_master()  # the pool is dead to every client: lookups, reads and writes fail at once
        from_redis = system.complete(prompts["redis"])
        assert from_redis["kvtier_hit_tokens"] == {"redis": loadable_tokens(from_redis)}
        assert from_redis["text"] == reference["redis"]["text"]
        stats = system.proxy.stats()
        assert (stats["prefills"], stats["prefill_failures"]) == (3, 0)  # the producer served on without the pool
        assert system.metric("kvtier:hit_tokens_total", tier="mooncake") == loadable_tokens(from_mooncake)
        assert system.metric("kvtier:hit_tokens_total", tier="redis") == loadable_tokens(from_redis)
        assert system.metric("kvtier:saved_blocks_total") == 0  # the consumer writes nothing

        os.killpg(system.producer.proc.pid, signal.SIGKILL)  # the producer dies mid-run
        system.producer.proc.wait(timeout=60)
        killed = system.complete(prompts["killed"])
        assert killed["text"] == reference["killed"]["text"] and killed["kvtier_hit_tokens"] == {}
        assert system.proxy.stats()["prefill_failures"] == 1
        # the same moment's load on the cores: the consumer computing a ~4k-token prompt itself
        own_ttft = ttft(system.consumer.url, prompts["fresh"])
        print(f"consumer computing a fresh prompt itself: {own_ttft:.3f} s "
              f"({own_ttft / consumer_ttft:.1f}x its TTFT after the producer's prefill)")
