"""Is a pool restore's verify + copy cheaper in one pass? (issue 21; docs/benchmarks/pools.md, "Where a local Mooncake
restore's time goes".)

16 blocks of SmolLM2's layout (30 layers x 393,216 B: 189 MB), one thread, best of 9 interleaved rounds: xxh3 of
each block, its copy into a [blocks, layers, bytes] destination, the two one after the other, and a streaming xxh3
per slice of 1, 3 or 10 layers with each slice copied right after it is hashed (while it is in cache).

    .venv/bin/python scripts/hash_copy_fusion_check.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
import xxhash

LAYERS, LAYER_BYTES, BLOCKS = 30, 393_216, 16


def main(rounds: int = 9) -> None:
    torch.set_num_threads(1)
    srcs = [np.random.default_rng(i).integers(0, 255, LAYERS * LAYER_BYTES, dtype=np.uint8) for i in range(BLOCKS)]
    dst = torch.zeros(BLOCKS, LAYERS, LAYER_BYTES, dtype=torch.uint8)

    def hash_all() -> None:
        for src in srcs:
            xxhash.xxh3_64_intdigest(src)

    def copy_all() -> None:
        for b, src in enumerate(srcs):
            dst[b].view(-1).copy_(torch.from_numpy(src))

    def fused(piece: int) -> None:
        for b, src in enumerate(srcs):
            digest, layers = xxhash.xxh3_64(), torch.from_numpy(src).view(LAYERS, LAYER_BYTES)
            for layer in range(0, LAYERS, piece):
                digest.update(src[layer * LAYER_BYTES:(layer + piece) * LAYER_BYTES])
                dst[b, layer:layer + piece].copy_(layers[layer:layer + piece])
            digest.intdigest()

    runs = {"xxh3": hash_all, "copy": copy_all, "xxh3, then copy": lambda: (hash_all(), copy_all()),
            **{f"fused, slices of {n} layer(s)": (lambda n=n: fused(n)) for n in (1, 3, 10)}}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{BLOCKS * LAYERS * LAYER_BYTES / 1e6:.1f} MB, one thread, best of {rounds}")
    for name, seconds in best.items():
        print(f"{name:30s} {seconds * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
