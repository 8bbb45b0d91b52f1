"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread; the tiny-model app."""

from __future__ import annotations

import contextlib
import socket
import threading

import uvicorn

from kvtier.codecs import get_codec
from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
from kvtier.tiers.manager import build_manager
from kvtier.server.app import create_app
from kvtier.server.tokenizer import ByteTokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """Serve `app` until the block ends; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started = threading.Event()
    while not server.started and thread.is_alive():
        started.wait(0.02)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


BLOCK = 8
MAX_MODEL_TOKENS = 512


def tiny_app(model, num_blocks: int = 96, *, dram: str = "4MiB", tiers: list[str] | None = None, **kwargs):
    """The tiny model served on `num_blocks` device blocks; tiers `dram:DRAM`, or the `tiers` specs."""
    layout = model.kv_layout(BLOCK)
    manager = build_manager(tiers or [f"dram:{dram}"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    config = EngineConfig(device_kv_budget_bytes=num_blocks * layout.block_bytes, block_tokens=BLOCK,
                          max_prefill_tokens=64, max_model_tokens=MAX_MODEL_TOKENS, **kwargs)
    llm = LLMEngine(model, config, manager)

    def on_shutdown() -> None:
        llm.close()  # its pending tier writes land first (as `kvtier serve`'s flush)
        manager.close()

    return create_app(AsyncEngine(llm), ByteTokenizer(), "tiny", manager=manager, on_shutdown=on_shutdown)
