"""kvtier under real vLLM (the CPU build in `.venv-vllm`): four engine starts in all, shared by the tests.

1. vLLM alone: the reference replies (and the converted checkpoint against transformers).
2. vLLM + kvtier on DRAM, an SSD directory, a Mooncake pool and Redis: stores the prompts' blocks
   (copied out layer by layer, as every kvtier process here).
3. A second vLLM process on the same SSD directory, loading layer by layer (`"load": "layerwise"`, the
   default): loads them (ssd hits), recomputes a corrupted or replaced block file, keeps two salts apart.
4. A third on shared memory + the pools, loading asynchronously (`"load": "async"`), on a device budget
   too small to keep its prompts: the prefix comes through Mooncake; with Mooncake killed, through Redis;
   a prompt the device evicted comes back from the shared-memory tier (written by the worker, found by
   the scheduler).
Every reply must equal vLLM alone's.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier import models
from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.integrations.vllm.config import model_fingerprint
from kvtier.bench.pools import MooncakePool, RedisServer

sys.path.insert(0, str(Path(__file__).parent))
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, start_vllm, wait_stable_count  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),  # module fixtures start up to two engines inside one test's setup
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing: `make vllm` creates it (`make test` does)"),
]

_PROMPT_NAMES = ("shared", "corrupt", "replaced", "salted", "pool_a", "pool_b", "fresh")
PROMPT_CHARS = 1400  # ~400 tokens: 12 full blocks of 32


@pytest.fixture(scope="module")
def prompts(shakespeare_text) -> dict[str, str]:
    return {name: shakespeare_text[i * 5000:i * 5000 + PROMPT_CHARS] for i, name in enumerate(_PROMPT_NAMES)}


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """This module's own Mooncake pool and Redis (the pool test kills Mooncake)."""
    mooncake, redis = MooncakePool(tmp_path_factory.mktemp("mooncake")), RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        mooncake.start()
        redis.start()
        yield {"mooncake": mooncake, "redis": redis}
    finally:
        mooncake.kill()
        redis.kill()


@pytest.fixture(scope="module")
def reference(prompts, smollm2, tmp_path_factory) -> dict[str, dict]:
    """vLLM alone (its own device prefix cache only), on the checkpoint `smollm2` converted."""
    with start_vllm(tmp_path_factory.mktemp("vllm") / "reference.log") as server:
        out = {name: server.complete(prompt) for name, prompt in prompts.items()}
        out["france"] = server.complete("The capital of France is", max_tokens=8)
    return out


@pytest.fixture(scope="module")
def ssd_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ssd")


@pytest.fixture(scope="module")
def stored(prompts, pools, ssd_dir, reference, tmp_path_factory) -> dict[str, dict]:
    """A first vLLM + kvtier process writes every prompt's blocks down all tiers, then exits."""
    tiers = ["dram:64MiB", f"ssd:{ssd_dir}:1GiB", pools["mooncake"].spec, pools["redis"].spec]
    with start_vllm(tmp_path_factory.mktemp("vllm") / "first.log", tiers) as server:
        out = {name: server.complete(prompt, cache_salt="tenant-a" if name == "salted" else None)
               for name, prompt in prompts.items() if name != "fresh"}
        num_blocks = sum(num_full_blocks(r) for r in out.values())
        assert wait_stable_count(ssd_dir, num_blocks) >= num_blocks
    for name, reply in out.items():
        assert reply["text"] == reference[name]["text"], name  # nothing to load yet: vLLM alone's text
        assert reply["kvtier_hit_tokens"] == {}
    return out


@pytest.fixture(scope="module")
def second(stored, ssd_dir, tmp_path_factory):
    """A second process on the same SSD directory (and a DRAM tier of its own), loading layer by layer."""
    with start_vllm(tmp_path_factory.mktemp("vllm") / "second.log", ["dram:64MiB", f"ssd:{ssd_dir}:1GiB"],
                    load="layerwise") as server:
        yield server


def num_full_blocks(reply: dict) -> int:
    """Full blocks of prompt + reply whose KV was computed (the last sampled token's was not)."""
    return (len(reply["prompt_token_ids"]) + len(reply["token_ids"]) - 1) // BLOCK_TOKENS


def loadable_tokens(reply: dict) -> int:
    """Prompt tokens a later request can load: full blocks, the last token always computed."""
    return (len(reply["prompt_token_ids"]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def block_paths(ssd_dir, reply: dict, salt: str = "") -> list:
    model_dir = models.cache_dir() / "smollm2-135m-instruct"
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=BLOCK_TOKENS,
                      page="cpu_attn:vec")  # vLLM CPU's own bytes (its "vec" kernels keep K transposed)
    space = KeySpace(model_fingerprint(str(model_dir)), layout, "raw", salt)
    return [ssd_dir / key.hex()[:2] / f"{key.hex()}.kvb" for key in block_keys(space, reply["prompt_token_ids"])]


def test_converted_smollm2_gives_vllm_the_greedy_tokens_of_transformers(reference, smollm2):
    """vLLM loads the converted checkpoint (tied embedding as `model.embed_tokens.weight`)."""
    reply = reference["france"]
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smollm2.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert reply["token_ids"] == out[0, ids.shape[1]:].tolist()
    assert reply["text"] == " Paris.\n\nThe answer is:"
    for name in _PROMPT_NAMES:  # not one token 0 (a zero embedding) anywhere
        assert len(set(reference[name]["token_ids"])) > 1


def test_second_process_loads_the_prompt_from_ssd(second, stored, reference, prompts):
    reply = second.complete(prompts["shared"])
    expected = loadable_tokens(stored["shared"])
    assert expected >= 10 * BLOCK_TOKENS
    assert reply["kvtier_hit_tokens"] == {"ssd": expected}
    assert reply["text"] == reference["shared"]["text"]
    assert second.metric("vllm:prompt_tokens_cached_by_source_total", source="disk") >= expected
    assert second.metric("kvtier:hit_tokens_total", tier="ssd") >= expected
    assert second.metric("kvtier:load_seconds_total") > 0  # the worker's load, timed
    assert second.metric("kvtier:scheduler_seconds_total") > 0  # and the scheduler side's lookup
    # the device prefix cache first: asked again, nothing comes from the tiers
    again = second.complete(prompts["shared"])
    assert again["kvtier_hit_tokens"] == {} and again["text"] == reference["shared"]["text"]


def test_a_corrupted_block_file_is_recomputed(second, stored, ssd_dir, reference, prompts):
    path = block_paths(ssd_dir, stored["corrupt"])[3]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one payload byte: the checksum no longer matches
    path.write_bytes(bytes(data))
    failed_before = second.metric("kvtier:failed_blocks_total")
    reply = second.complete(prompts["corrupt"])
    assert reply["text"] == reference["corrupt"]["text"]
    assert reply["kvtier_hit_tokens"] == {"ssd": 3 * BLOCK_TOKENS}  # the blocks before it
    assert second.metric("kvtier:failed_blocks_total") > failed_before


def test_a_block_file_replaced_by_another_blocks_is_recomputed(second, stored, ssd_dir, reference, prompts):
    target = block_paths(ssd_dir, stored["replaced"])[4]
    target.write_bytes(block_paths(ssd_dir, stored["shared"])[4].read_bytes())  # a valid block, another key
    reply = second.complete(prompts["replaced"])
    assert reply["text"] == reference["replaced"]["text"]
    assert reply["kvtier_hit_tokens"] == {"ssd": 4 * BLOCK_TOKENS}


def test_two_salts_never_share_a_block(second, stored, ssd_dir, reference, prompts):
    tenant_a = block_paths(ssd_dir, stored["salted"], "tenant-a")
    assert all(path.is_file() for path in tenant_a)
    assert not any(path.is_file() for path in block_paths(ssd_dir, stored["salted"], ""))
    other = second.complete(prompts["salted"], cache_salt="tenant-b")  # stored by the first process under tenant-a
    assert other["kvtier_hit_tokens"] == {}
    assert other["text"] == reference["salted"]["text"]
    same = second.complete(prompts["salted"], cache_salt="tenant-a")
    assert same["kvtier_hit_tokens"] == {"ssd": loadable_tokens(stored["salted"])}
    assert same["text"] == reference["salted"]["text"]


@pytest.fixture
def shm_dir():
    """A directory on shared memory (/dev/shm), which every process sees."""
    path = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_prefix_shared_through_the_pool_and_a_dead_pool_fails_no_request(stored, pools, shm_dir, reference, prompts,
                                                                           tmp_path_factory):
    tiers = [f"shm:{shm_dir}:64MiB", pools["mooncake"].spec, pools["redis"].spec]
    with start_vllm(tmp_path_factory.mktemp("vllm") / "pool.log", tiers, load="async",
                    num_device_blocks=32) as server:
        reply = server.complete(prompts["pool_a"])
        assert reply["kvtier_hit_tokens"] == {"mooncake": loadable_tokens(stored["pool_a"])}
        assert reply["text"] == reference["pool_a"]["text"]
        pools["mooncake"].kill()  # mid-run: the next lookups find Mooncake dead
        reply = server.complete(prompts["pool_b"])
        assert reply["text"] == reference["pool_b"]["text"]
        assert reply["kvtier_hit_tokens"] == {"redis": loadable_tokens(stored["pool_b"])}
        fresh = server.complete(prompts["fresh"])
        assert fresh["text"] == reference["fresh"]["text"] and fresh["kvtier_hit_tokens"] == {}
        assert server.metric("kvtier:hit_tokens_total", tier="redis") >= loadable_tokens(stored["pool_b"])
        # 32 device blocks: pool_b and fresh (~14 blocks each) evicted pool_a's first blocks from the device
        again = server.complete(prompts["pool_a"])
        assert again["text"] == reference["pool_a"]["text"]
        assert set(again["kvtier_hit_tokens"]) == {"shm"} and again["kvtier_hit_tokens"]["shm"] > 0
