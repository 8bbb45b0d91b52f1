"""The engine with a quantized resident arena (`EngineConfig.kv_codec`): the same budget holds more
blocks, and on the tiny model a sequence's tokens do not depend on batching, chunking, preemption or a
tier round trip — by design the quantized KV a token attends to is the same in every case, up to the
float rounding of the projections under another batch shape (on SmolLM2 that rounding can flip a code
and a near-tied greedy token: tests/engine/test_smollm2.py measures agreement instead)."""

import sys
from pathlib import Path

import pytest
import torch

from kvtier import models
from kvtier.codecs import get_codec
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.engine.arena import arena_block_bytes
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

BLOCK = 8
NEW = 30
CODECS = ["fp8", "int8", "int4", "int2"]


def make_engine(model, num_blocks, codec, manager=None, **kwargs):
    """An engine whose arena holds exactly `num_blocks` blocks of `codec`."""
    kwargs.setdefault("max_prefill_tokens", 16)
    layout = model.kv_layout(BLOCK)
    max_num_seqs = kwargs.setdefault("max_num_seqs", 8)
    reserved = max_num_seqs * layout.block_bytes if codec in ("int4", "int2") else 0
    config = EngineConfig(device_kv_budget_bytes=num_blocks * arena_block_bytes(layout, codec) + reserved,
                          block_tokens=BLOCK, kv_codec=codec, **kwargs)
    engine = LLMEngine(model, config, manager)
    assert engine.num_blocks == num_blocks
    return engine


def run_all(engine, prompts):
    return engine.generate(prompts, SamplingParams(max_tokens=NEW))


@pytest.fixture(scope="module")
def tiny64():
    """The tiny model in float64: another batch shape moves the projections by ~1e-16, which never flips a
    code of the (fp32-computed) quantizers; in float32 a flip — and then a near-tied greedy token — can
    happen on another CPU's GEMM kernels."""
    return models.load("tiny", dtype=torch.float64, device="cpu")


@pytest.fixture(scope="module")
def alone(tiny64, tiny_prompts):
    """Each prompt run by itself on an ample quantized arena: the reference for that codec."""
    return {codec: [run_all(make_engine(tiny64, 64, codec), [p])[0] for p in tiny_prompts] for codec in CODECS}


@pytest.mark.parametrize("codec", CODECS)
def test_batched_chunked_prefill_matches_running_alone(tiny64, tiny_prompts, alone, codec):
    assert run_all(make_engine(tiny64, 64, codec), tiny_prompts) == alone[codec]


@pytest.mark.parametrize("codec", CODECS)
def test_preemption_keeps_outputs(tiny64, tiny_prompts, alone, codec):
    engine = make_engine(tiny64, 14, codec)  # the 7 requests need ~30 blocks
    assert run_all(engine, tiny_prompts) == alone[codec]
    assert engine.stats().num_preemptions > 0
    if codec in ("int4", "int2"):
        assert not engine.arena.staging  # no open block's staging left behind


def test_int8_resident_matches_dynamic_cache(tiny64, tiny_prompts, alone):
    # int8 per token is near-lossless: on this model every greedy token equals DynamicCache's
    assert alone["int8"] == [reference(tiny64.model, p, NEW) for p in tiny_prompts]


def test_the_same_budget_holds_more_tokens(tiny_model):
    budget = 64 * tiny_model.kv_layout(BLOCK).block_bytes
    counts = {codec: LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=budget, block_tokens=BLOCK,
                                                        kv_codec=codec, max_num_seqs=4)).num_blocks
              for codec in ["raw", *CODECS]}
    assert counts["raw"] == 64
    assert counts["int8"] > 3 * 64 and counts["int4"] > counts["int8"] and counts["int2"] > counts["int4"]


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_prefix_from_the_tiers_gives_the_same_tokens(tiny64, tiny_prompts, alone, codec):
    layout = tiny64.kv_layout(BLOCK)
    manager = build_manager(["dram:2MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        first = make_engine(tiny64, 14, codec, manager)
        assert run_all(first, tiny_prompts) == alone[codec]
        first.flush_to_tiers()
        second = make_engine(tiny64, 14, codec, manager)  # a fresh device: the prefix comes from DRAM
        second.add_request("x", tiny_prompts[2], SamplingParams(max_tokens=NEW))
        outputs = []
        while second.has_unfinished_requests():
            outputs += second.step()
        # the tier holds the dequantized block; quantizing it again gives the same codes
        assert [o.new_token_ids[0] for o in outputs] == alone[codec][2]
        assert outputs[-1].cached_tokens_by_tier == {"dram": 32}
    finally:
        manager.close()


def test_quantized_and_raw_engines_never_share_blocks(tiny_model, tiny_prompts):
    # a quantized arena changes the KV itself (later layers attended to quantized KV): other key space
    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager(["dram:1MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        run_all(make_engine(tiny_model, 64, "int8", manager), [tiny_prompts[2]])
        manager.flush()
        raw = LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=64 * layout.block_bytes, block_tokens=BLOCK),
                        manager)
        run_all(raw, [tiny_prompts[2]])
        assert raw.stats().prefix_hit_tokens_by_tier == {}
        again = make_engine(tiny_model, 64, "int8", manager)
        run_all(again, [tiny_prompts[2]])
        assert again.stats().prefix_hit_tokens_by_tier == {"dram": 32}
    finally:
        manager.close()


def test_unknown_kv_codec_is_refused():
    with pytest.raises(ValueError, match="kv_codec"):
        EngineConfig(kv_codec="int3")
