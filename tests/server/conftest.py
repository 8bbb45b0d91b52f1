import sys
from pathlib import Path

import pytest

from kvtier.codecs import get_codec
from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
from kvtier.manager import build_manager
from kvtier.server.app import create_app
from kvtier.server.tokenizer import ByteTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from server_support import running  # noqa: E402

BLOCK = 8
MAX_MODEL_TOKENS = 512


def tiny_app(model, num_blocks: int = 96, **kwargs):
    layout = model.kv_layout(BLOCK)
    manager = build_manager(["dram:4MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    config = EngineConfig(device_kv_budget_bytes=num_blocks * layout.block_bytes, block_tokens=BLOCK,
                          max_prefill_tokens=64, max_model_tokens=MAX_MODEL_TOKENS, **kwargs)
    engine = AsyncEngine(LLMEngine(model, config, manager))
    return create_app(engine, ByteTokenizer(), "tiny", manager=manager, on_shutdown=manager.close)


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    """(base URL, app) of a server on the tiny model with a byte tokenizer and a DRAM tier."""
    app = tiny_app(tiny_model)
    with running(app) as url:
        yield url, app
