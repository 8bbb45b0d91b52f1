"""Test helpers around `kvtier.testing.vllm.VllmServer` (a real vLLM server)."""

from __future__ import annotations

import time
from pathlib import Path

from kvtier import models
from kvtier.testing.vllm import BLOCK_TOKENS, VLLM_PYTHON, VllmServer, kvtier_transfer_config

__all__ = ["BLOCK_TOKENS", "VLLM_PYTHON", "start_vllm", "wait_stable_count"]


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
