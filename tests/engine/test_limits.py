"""Every setting the engine (or a tier) refuses at construction: `kvtier serve` exits 2 with one line naming the
setting and the smallest value that works — and each value it names does build the engine, and the next smaller
budget does not. The tiny model: 2 layers, 2 KV heads of 16 fp32 channels, 512 B a token, a 256-token block 128 KiB."""

from __future__ import annotations

import pytest

from kvtier import models
from kvtier.cli import main
from kvtier.codecs import get_codec
from kvtier.config import EngineConfig
from kvtier.engine import LLMEngine
from kvtier.engine.limits import device_blocks, fetch_area_bytes
from kvtier.errors import ConfigError
from kvtier.server.cli import build_engine
from kvtier.server.config import ServeConfig
from kvtier.tiers.manager import build_manager

BASE = {"model": "tiny", "tiers": ["dram:4MiB"]}

# (settings refused, the one line, settings that work instead (each named by the line), a smaller one still refused)
REFUSALS = [
    pytest.param(
        {"device_kv_budget": "64KiB"},
        "device_kv_budget 64KiB holds 0 blocks of 256 tokens; the engine needs 1: device_kv_budget 128KiB works "
        "(or block_tokens 128)",
        [{"device_kv_budget": "128KiB"}, {"block_tokens": 128}], {"device_kv_budget": "127KiB"}, id="budget-block"),
    pytest.param(
        {"device_kv_budget": "640KiB", "kv_offload": "exact"},
        "device_kv_budget 640KiB holds 1 block of 256 tokens beside the offload fetch area (512.00 KiB); the engine "
        "needs 4 (an offloaded request's window: 1 sink + 2 recent blocks, and one more): device_kv_budget 1MiB "
        "works (or block_tokens 160)",
        [{"device_kv_budget": "1MiB"}, {"block_tokens": 160}], {"device_kv_budget": "1023KiB"}, id="budget-window"),
    pytest.param(
        {"device_kv_budget": "1MiB", "kv_offload": "sparse:1/8", "offload_fetch_blocks": 6},
        "device_kv_budget 1MiB holds 0 blocks of 256 tokens beside the offload fetch area (1.12 MiB); the engine "
        "needs 4 (an offloaded request's window: 1 sink + 2 recent blocks, and one more): device_kv_budget 2MiB "
        "works (or block_tokens 128, or offload_fetch_blocks 1)",
        [{"device_kv_budget": "2MiB"}, {"block_tokens": 128}, {"offload_fetch_blocks": 1}],
        {"device_kv_budget": "1.5MiB"}, id="budget-fetch-area"),
    pytest.param(
        {"device_kv_budget": "2MiB", "kv_codec": "int4"},
        "device_kv_budget 2MiB holds 0 blocks of 256 tokens beside the 32 open blocks int4 keeps at full precision "
        "(4.00 MiB); the engine needs 1: device_kv_budget 5MiB works (or block_tokens 127, or max_num_seqs 15)",
        [{"device_kv_budget": "5MiB"}, {"block_tokens": 127}, {"max_num_seqs": 15}], {"device_kv_budget": "4MiB"},
        id="budget-kivi-open-blocks"),
    pytest.param(
        {"kv_offload": "exact", "tiers": []},
        "kv_offload exact needs a DRAM tier first in tiers (offloaded blocks live in its memory): start the tiers "
        "with dram:SIZE, e.g. --tier dram:4GiB",
        [{"tiers": ["dram:4MiB"]}], None, id="offload-without-dram"),
    pytest.param(
        {"tiers": ["dram:64KiB"]},
        "tier dram:64KiB holds no block (a slot is 131,152 B): dram:129KiB works",  # format 4: +8 B a layer
        [{"tiers": ["dram:129KiB"]}], {"tiers": ["dram:128KiB"]}, id="dram-tier-slot"),
    pytest.param(
        {"kv_offload": "sparse:1/8", "block_tokens": 96, "offload_page_tokens": 64},
        "offload_page_tokens (64) must divide block_tokens (96): a block is a whole number of pages; "
        "offload_page_tokens 48 works",
        [{"offload_page_tokens": 48}], None, id="page-tokens"),
    pytest.param(
        {"kv_offload": "exact", "kv_codec": "int8"},
        "kv_offload needs the raw device and tier formats (kv_codec 'int8', codec 'raw'): offloaded blocks are "
        "attended to as they are; kv_codec raw and codec raw work",
        [{"kv_codec": "raw"}], None, id="codec-with-offload"),
    pytest.param(
        {"block_tokens": 0}, "block_tokens must be positive (>= 1), got 0", [{"block_tokens": 1}], None,
        id="block-tokens"),
    pytest.param(
        {"max_num_seqs": 0}, "max_num_seqs must be positive (>= 1), got 0", [{"max_num_seqs": 1}], None,
        id="max-num-seqs"),
    pytest.param(
        {"offload_sink_blocks": -1}, "offload_sink_blocks must be >= 0, got -1", [{"offload_sink_blocks": 0}], None,
        id="sink-blocks"),
    pytest.param(
        {"model": "tiny-swa"},
        "model: the engine serves full-attention models only, and this one has sliding-window layers (smollm2, or a "
        "Llama / Qwen2 / Qwen3 / Mistral directory without one, works)",
        [{"model": "tiny"}], None, id="sliding-window-model"),
]


def _flags(settings: dict) -> list[str]:
    flags = []
    for name, value in settings.items():
        if name == "tiers":
            flags += [f for spec in value for f in ("--tier", spec)] if value else ["--no-tiers"]
        else:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def _build(settings: dict) -> None:
    """The engine `kvtier serve` builds from these settings (and its tiers), closed again."""
    _, engine, manager = build_engine(ServeConfig.load(None, **settings))
    engine.close()
    if manager is not None:
        manager.close()


@pytest.mark.parametrize("refused, line, works, smaller", REFUSALS)
def test_serve_refuses_in_one_line_naming_the_value_that_works(capsys, refused, line, works, smaller):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *_flags({**BASE, **refused})])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == f"kvtier: error: {line}\n"
    for fix in works:
        _build({**BASE, **refused, **fix})
    if smaller is not None:  # the value named is the smallest that works (in its unit)
        with pytest.raises(ConfigError):
            _build({**BASE, **refused, **smaller})


def test_the_engine_itself_raises_the_same_config_error(tiny_model):
    """Library callers get the ConfigError (a ValueError) from LLMEngine before anything is allocated."""
    with pytest.raises(ConfigError, match="^device_kv_budget 64KiB holds 0 blocks of 256 tokens"):
        LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=64 << 10))


def test_kivi_head_dim_that_does_not_pack_names_the_codec_that_does():
    tiny6 = models.tiny_llama(hidden=24, heads=4, kv_heads=2)  # head_dim 6: 6 x 2 bits is not whole bytes
    with pytest.raises(ConfigError) as exc:
        LLMEngine(tiny6, EngineConfig(kv_codec="int2", block_tokens=8, max_num_seqs=2))
    assert str(exc.value) == "kv_codec int2 cannot pack this model's head_dim (6) of 2-bit codes into whole bytes: " \
                             "kv_codec int4 works"
    LLMEngine(tiny6, EngineConfig(kv_codec="int4", block_tokens=8, max_num_seqs=2)).close()


@pytest.mark.parametrize("settings", [
    {}, {"kv_codec": "int8"}, {"kv_codec": "int4", "max_num_seqs": 4}, {"kv_offload": "exact"},
    {"kv_offload": "sparse:1/8", "offload_fetch_blocks": 5}, {"kv_offload": "exact", "offload_recent_blocks": 4},
])
def test_blocks_and_fetch_area_are_the_engines(tiny_model, settings):
    """The arithmetic the checks run on is what the engine allocates: its block slots and fetch area."""
    config = EngineConfig(device_kv_budget_bytes=1 << 20, block_tokens=16, **settings)
    layout = tiny_model.kv_layout(16)
    manager = build_manager(["dram:4MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    engine = LLMEngine(tiny_model, config, manager)
    try:
        assert engine.num_blocks == device_blocks(layout, config)
        assert (engine.fetch.nbytes if engine.fetch is not None else 0) == \
            (fetch_area_bytes(layout, config.offload_config(), config.device_kv_budget_bytes)
             if "kv_offload" in settings else 0)
    finally:
        engine.close()
        manager.close()
