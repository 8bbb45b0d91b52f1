"""Would restoring a DRAM hit layer by layer, overlapping the forward, shorten it here? (issue 21; docs/benchmarks/pools.md,
"Where a local Mooncake restore's time goes", the DRAM-hit TTFT bullet.)

SmolLM2 with a 4k-token cache: times, best and median of 9 interleaved rounds, the 1-token forward alone, a copy
of the cache's bytes (189 MB, as the restore moves) alone on 1 and 2 threads, the two one after the other, and
the copy on a thread beside the forward. If the last equals the one before, the two share one bottleneck
(memory bandwidth on this machine) and an overlapped restore gains nothing.

    .venv/bin/python scripts/hit_overlap_check.py
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import torch

from kvtier import models
from kvtier.data import SHAKESPEARE, shared_data_file
from kvtier.hf import TieredCache
from kvtier.transfer.copies import split_copy

PREFIX_TOKENS = 4096


def main(rounds: int = 9) -> None:
    loaded = models.load("smollm2")
    text = shared_data_file(SHAKESPEARE).read_text()[:PREFIX_TOKENS * 8]
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, :PREFIX_TOKENS + 1]
    cache = TieredCache.for_model(loaded)
    with torch.inference_mode():
        loaded.model(ids[:, :-1], past_key_values=cache, use_cache=True)
    num_bytes = PREFIX_TOKENS * loaded.kv_layout(256).bytes_per_token
    src, dst = np.ones(num_bytes, np.uint8), np.zeros(num_bytes, np.uint8)

    def forward() -> None:
        with torch.inference_mode():
            loaded.model(ids[:, -1:], past_key_values=cache, use_cache=True)
        for layer in cache.layers:  # back to the prefix alone
            layer.set_length(PREFIX_TOKENS)

    def beside() -> None:
        copier = threading.Thread(target=split_copy, args=(dst, src, 1))
        copier.start()
        forward()
        copier.join()

    runs = {"forward alone": forward, "copy alone, 1 thread": lambda: split_copy(dst, src, 1),
            "copy alone, 2 threads": lambda: split_copy(dst, src, 2),
            "copy, then forward": lambda: (split_copy(dst, src, 2), forward()),
            "copy on a thread beside the forward": beside}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"{num_bytes / 1e6:.1f} MB of KV; best and median of {rounds} rounds")
    for name, values in times.items():
        print(f"{name:38s} {min(values) * 1e3:7.1f} ms  {statistics.median(values) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
