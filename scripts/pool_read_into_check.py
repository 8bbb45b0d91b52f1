"""Would a Mooncake restore gain from the store writing each block straight into the engine's arena?
(issue 21; docs/benchmarks/pools.md, "Reading a pool block straight into the arena: built, measured, left off main").

SmolLM2's 4k-token prefix (16 blocks of 256 tokens) in a local Mooncake pool (started on 127.0.0.1, as
`kvtier bench prefix` does), then, interleaved over rounds (best, median, and this process's mean CPU):
- the raw get of the 16 blocks into registered contiguous buffers (`batch_get_into`: the bench's reference);
- the same blocks scattered straight into a paged `RawArena`'s slots (`batch_get_into_multi_buffers`: the
  header into a small registered buffer, then one range per layer and K/V, 61 ranges a block), as 1 x 16
  and as the stream's 2 x 8;
- that, then the payload checksums computed over the arena's ranges in place (what the restore would still
  owe), with the second get beside the first half's checks (the stream's overlap);
- the engine's restore as it is (`KVTransfer`: get into read buffers, verify, copy into the arena).

    .venv/bin/python scripts/pool_read_into_check.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from kvtier.bench.prefix import _arena_restore
from kvtier.blocks import DEFAULT_BLOCK_TOKENS
from kvtier.codecs.header import HEADER_BYTES, verify
from kvtier.engine.arena import RawArena
from pooled_prefix import pooled_prefix


def main(rounds: int = 9) -> None:
    with pooled_prefix() as prefix:
        loaded, ids, layout, codec, manager = prefix.loaded, prefix.ids, prefix.layout, prefix.codec, prefix.manager
        backend, keys, names = prefix.backend, prefix.keys, prefix.names
        store = backend._store
        arena = RawArena(layout, len(keys), torch.device("cpu"))
        heads = np.zeros((len(keys), HEADER_BYTES), dtype=np.uint8)
        for buf in (arena.k_cache, arena.v_cache):
            assert store.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size()) == 0
        assert store.register_buffer(heads.ctypes.data, heads.nbytes) == 0
        parts = [[part for layer in range(layout.num_layers) for part in (arena.k_cache[layer, b],
                                                                          arena.v_cache[layer, b])]
                 for b in range(len(keys))]
        ptrs = [[heads[b].ctypes.data, *(p.data_ptr() for p in parts[b])] for b in range(len(keys))]
        sizes = [[HEADER_BYTES, *(p.numel() * p.element_size() for p in parts[b])] for b in range(len(keys))]

        def scatter(blocks: range) -> None:
            codes = store.batch_get_into_multi_buffers([names[b] for b in blocks], [ptrs[b] for b in blocks],
                                                       [sizes[b] for b in blocks])
            assert all(code == sum(sizes[b]) for code, b in zip(codes, blocks)), codes

        def check(b: int) -> None:  # the payload checksum over the block's ranges, in place
            header = verify(heads[b].tobytes() + bytes(sum(sizes[b]) - HEADER_BYTES), keys[b], payload=False)
            digest = xxhash.xxh3_64()
            for part in parts[b]:
                digest.update(memoryview(part.numpy()).cast("B"))
            assert digest.intdigest() == header.payload_checksum, f"block {b} differs in place"

        def raw_get() -> None:
            got = backend.lease(names)
            backend.release([item[1] for item in got])

        def scatter_and_check() -> None:  # the stream's shape: get 8, get 8 beside checking 8, check 8
            scatter(range(8))
            with ThreadPoolExecutor(1) as ahead:
                second = ahead.submit(scatter, range(8, 16))
                for b in range(8):
                    check(b)
                second.result()
            for b in range(8, 16):
                check(b)

        engine = _arena_restore(loaded, manager, ids, DEFAULT_BLOCK_TOKENS)
        runs = {"raw get, 1 x 16 (contiguous buffers)": raw_get,
                "into the arena's ranges, 1 x 16": lambda: scatter(range(16)),
                "into the arena's ranges, 2 x 8": lambda: (scatter(range(8)), scatter(range(8, 16))),
                "into the arena, then checksums in place (overlapped)": scatter_and_check,
                "engine restore as it is (KVTransfer)": engine}
        times: dict[str, list[float]] = {name: [] for name in runs}
        cpu = dict.fromkeys(runs, 0.0)
        for _ in range(rounds):
            for name, fn in runs.items():
                process, start = time.process_time(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - process
        raw = min(times["raw get, 1 x 16 (contiguous buffers)"])
        print(f"{sum(map(sum, sizes)) / 1e6:.1f} MB in {len(keys)} blocks; best, median, mean CPU of {rounds} "
              "rounds; raw get / best")
        for name, values in times.items():
            print(f"{name:56s} {min(values) * 1e3:7.1f} ms {statistics.median(values) * 1e3:7.1f} ms "
                  f"{cpu[name] / rounds * 1e3:7.1f} ms CPU  {raw / min(values):5.0%}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
