"""`OffloadConfig`: the offload settings parsed once, the one window layout the engine, `TieredCache` and the
sparse eval share."""

import pytest

from kvtier.config import EngineConfig
from kvtier.evals.sparse import SparseWindow
from kvtier.offload.config import OffloadConfig, OffloadMode, parse_offload


def test_engine_config_parses_its_offload_settings_once():
    config = EngineConfig(block_tokens=16, kv_offload="sparse:1/8", offload_sink_blocks=2, offload_recent_blocks=3,
                          offload_page_tokens=64, offload_fetch_blocks=5)
    offload = config.offload_config()
    assert offload == OffloadConfig(OffloadMode("sparse", 0.125), 16, 2, 3, 16, 5)  # a page is at most a block
    assert offload.window_blocks == 5 and offload.window_tokens == 80 and offload.pages_per_block == 1
    assert EngineConfig().offload_config().mode is None and SparseWindow is OffloadConfig


def test_the_window_layout():
    window = OffloadConfig(parse_offload("exact"), block_tokens=8, sink_blocks=1, recent_blocks=2)
    # 40 tokens = 5 blocks: block 0 the sink, 3 and 4 the recent window, 1 and 2 in host memory
    assert window.host_blocks(40) == (1, 3) and window.host_end(41) == 4 and window.host_end(8) == 1
    assert window.host_blocks_needed(41) == 3 and window.host_blocks_needed(20) == 0


def test_bad_windows_and_pages_are_value_errors():
    with pytest.raises(ValueError, match="recent_blocks >= 1"):
        OffloadConfig(parse_offload("exact"), recent_blocks=0)
    with pytest.raises(ValueError, match="must divide block_tokens"):
        OffloadConfig(parse_offload("sparse:1"), block_tokens=8, page_tokens=3)
    assert OffloadConfig(parse_offload("exact"), block_tokens=8, page_tokens=3).page_tokens == 8  # no page: the block
