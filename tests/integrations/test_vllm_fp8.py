"""fp8 KV (`--kv-cache-dtype fp8`) under real vLLM (the CPU build in `.venv-vllm`): three engine starts.

vLLM's CPU build keeps fp8 KV on x86 with AVX-512 or AMX only; elsewhere these tests are skipped with that
reason. 1. vLLM fp8 alone: the reference. 2. vLLM fp8 + kvtier on an SSD directory stores the prompt's
blocks (vLLM's fp8 bytes, 1 byte per element: a quarter of fp32's). 3. A second process loads them and
must print the reference text.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvtier import models
from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.codecs.header import HEADER_BYTES
from kvtier.integrations.vllm.config import model_fingerprint

sys.path.insert(0, str(Path(__file__).parent))
from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, start_vllm, wait_stable_count  # noqa: E402


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


_FP8_CPU = bool(_cpu_flags() & {"avx512f", "amx_tile"})
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing: `make vllm` creates it"),
    pytest.mark.skipif(not _FP8_CPU, reason="vLLM's CPU build keeps fp8 KV on x86 with AVX-512 or AMX only "
                                            "(cpu_attn.py: 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.')"),
]
FP8 = ("--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def prompt(shakespeare_text) -> str:
    return shakespeare_text[20000:21400]  # ~400 tokens: 12 full blocks of 32


@pytest.fixture(scope="module")
def reference(prompt, tmp_path_factory) -> dict:
    with start_vllm(tmp_path_factory.mktemp("vllm") / "fp8-alone.log", extra_args=FP8) as server:
        return server.complete(prompt)


def fp8_layout() -> KVLayout:
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float8_e4m3fn", block_tokens=BLOCK_TOKENS,
                    page="cpu_attn:vec")


def test_fp8_blocks_go_down_and_a_second_process_prints_vllm_fp8s_text(reference, prompt, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("ssd")
    tiers = [f"ssd:{ssd}:1GiB"]
    with start_vllm(tmp_path_factory.mktemp("vllm") / "fp8-first.log", tiers, extra_args=FP8) as server:
        first = server.complete(prompt)
        num_blocks = (len(first["prompt_token_ids"]) + len(first["token_ids"]) - 1) // BLOCK_TOKENS
        assert wait_stable_count(ssd, num_blocks) >= num_blocks
        assert "layers of planes pages" in server.log_tail(200_000)
    assert first["text"] == reference["text"] and first["kvtier_hit_tokens"] == {}

    # the blocks are vLLM's fp8 bytes under keys naming the fp8 format: 1 byte an element
    space = KeySpace(model_fingerprint(str(models.cache_dir() / "smollm2-135m-instruct")), fp8_layout())
    keys = block_keys(space, first["prompt_token_ids"])
    paths = [ssd / key.hex()[:2] / f"{key.hex()}.kvb" for key in keys]
    assert all(path.is_file() for path in paths)
    # header, payload, and the layer table (a checksum of 8 bytes per layer)
    assert {path.stat().st_size for path in paths} == {HEADER_BYTES + 2 * 30 * 3 * 64 * BLOCK_TOKENS + 8 * 30}
    assert get_codec("raw").decode(paths[0].read_bytes(), keys[0]).dtype.itemsize == 1

    with start_vllm(tmp_path_factory.mktemp("vllm") / "fp8-second.log", tiers, extra_args=FP8) as server:
        second = server.complete(prompt)
    loadable = (len(reference["prompt_token_ids"]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert loadable >= len(reference["prompt_token_ids"]) - BLOCK_TOKENS
    assert second["kvtier_hit_tokens"] == {"ssd": loadable}
    assert second["text"] == reference["text"]
