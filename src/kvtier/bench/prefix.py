"""`kvtier bench prefix`: TTFT of a request whose long prefix is cached, per tier, vs recompute.

Protocol (all in one process, one run, on the same model and prompt):
1. recompute: an empty cache prefills the whole prompt and produces the first token;
2. for each tier (alone in its manager): a first request stores the prompt's full blocks, then
   `repeats` fresh requests look the prefix up, load it, compute the remaining tokens (at least
   the last one) and produce the first token. TTFT is wall time from cache creation to the first
   token's logits. Medians are reported.
The ratio is recompute TTFT / tier TTFT.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvtier.hf import TieredCache


@dataclass(slots=True)
class PrefixRow:
    tier: str
    prefix_tokens: int
    cached_tokens: int
    ttft_s: float
    speedup: float
    restore_gb_s: float


def _first_token(loaded, ids: torch.Tensor, cache: TieredCache) -> tuple[int, float]:
    start = time.perf_counter()
    num_cached = cache.load_prefix(ids)
    cache.load_seconds = time.perf_counter() - start
    with torch.inference_mode():
        logits = loaded.model(ids[:, num_cached:], past_key_values=cache, use_cache=True).logits
    token = int(logits[0, -1].argmax())
    return token, time.perf_counter() - start


def measure_recompute(loaded, ids: torch.Tensor, repeats: int) -> tuple[int, float]:
    times, token = [], -1
    for _ in range(repeats):
        token, seconds = _first_token(loaded, ids, TieredCache.for_model(loaded))
        times.append(seconds)
    return token, statistics.median(times)


def measure_tier(loaded, manager, tier: str, ids: torch.Tensor, repeats: int, recompute_s: float,
                 expected_token: int, block_tokens: int) -> PrefixRow:
    warm = TieredCache.for_model(loaded, manager, block_tokens=block_tokens)
    _first_token(loaded, ids, warm)
    warm.store(ids[0])
    manager.flush()
    times, loads, cached = [], [], 0
    for _ in range(repeats):
        cache = TieredCache.for_model(loaded, manager, block_tokens=block_tokens)
        token, seconds = _first_token(loaded, ids, cache)
        if token != expected_token:
            raise AssertionError(f"{tier}: first token {token} differs from recompute's {expected_token}")
        cached = cache.prefix.cached_tokens
        times.append(seconds)
        loads.append(cache.load_seconds)
    ttft = statistics.median(times)
    restore_bytes = cached * loaded.kv_layout(block_tokens).bytes_per_token
    return PrefixRow(tier, ids.shape[1], cached, ttft, recompute_s / ttft, restore_bytes / statistics.median(loads) / 1e9)


def run(prefix_tokens: int = 4096, tiers: tuple[str, ...] = ("dram", "ssd"), repeats: int = 3,
        block_tokens: int = 256, ssd_dir: str | None = None) -> list[PrefixRow]:
    """The whole benchmark on SmolLM2 and tinyshakespeare; returns one row per tier plus recompute."""
    import tempfile

    from kvtier import models
    from kvtier.codecs import get_codec
    from kvtier.data import SHAKESPEARE, shared_data_file
    from kvtier.manager import build_manager

    loaded = models.load("smollm2")
    text = shared_data_file(SHAKESPEARE).read_text()[:prefix_tokens * 8]
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, :prefix_tokens + 1]
    token, recompute_s = measure_recompute(loaded, ids, repeats)
    rows = [PrefixRow("recompute", prefix_tokens, 0, recompute_s, 1.0, 0.0)]
    slot = get_codec("raw").max_encoded_bytes(loaded.kv_layout(block_tokens))
    with tempfile.TemporaryDirectory(dir=ssd_dir) as tmp:
        specs = {"dram": "dram:2GiB", "ssd": f"ssd:{tmp}:4GiB"}
        for tier in tiers:
            manager = build_manager([specs[tier]], slot_bytes=slot)
            rows.append(measure_tier(loaded, manager, tier, ids, repeats, recompute_s, token, block_tokens))
            manager.close()
    return rows
