"""Test helpers around `kvtier.bench.servers.VllmServer` (a real vLLM server)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvtier import models
from kvtier.bench.servers import BLOCK_TOKENS, VLLM_PYTHON, VllmServer, kvtier_transfer_config

__all__ = ["BLOCK_TOKENS", "VLLM_PYTHON", "kv_events_args", "start_vllm", "wait_for", "wait_stable_count"]


def start_vllm(log_path: Path, tiers: list[str] | None = None, *, load: str = "layerwise",
               num_device_blocks: int | None = None, extra_args: tuple[str, ...] = ()) -> VllmServer:
    """vLLM on the converted SmolLM2 (fp32, 1 GiB of KV, or `num_device_blocks` blocks), with kvtier's
    connector on `tiers` if given, loading in mode `load`; `extra_args` go to vLLM."""
    model_dir = models.cache_dir() / "smollm2-135m-instruct"
    kv_transfer = None if tiers is None else kvtier_transfer_config(tiers, load=load)
    if num_device_blocks is None:
        return VllmServer(model_dir, log_path, kv_transfer=kv_transfer, extra_args=extra_args)
    return VllmServer(model_dir, log_path, kv_transfer=kv_transfer,
                      max_model_len=(num_device_blocks - 1) * BLOCK_TOKENS,
                      extra_args=("--num-gpu-blocks-override", str(num_device_blocks), *extra_args))


def kv_events_args(endpoint: str, replay: str) -> tuple[str, ...]:
    """vLLM's `--kv-events-config` publishing over ZMQ on `endpoint`, replaying on `replay`."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
    return ("--kv-events-config", json.dumps(config))


def wait_for(fetch, ok, what: str, timeout_s: float = 60.0):
    """`fetch()` until `ok(value)` (events land after the steps that caused them); the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fetch()
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {got}"
        time.sleep(0.5)


def wait_stable_count(directory: Path, min_count: int, timeout_s: float = 60) -> int:
    """Waits until `directory` holds at least `min_count` files and their number stops growing."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        count = sum(1 for p in directory.rglob("*") if p.is_file())
        if count >= min_count and count == last:
            return count
        last = count
        time.sleep(1.0)
    return last
