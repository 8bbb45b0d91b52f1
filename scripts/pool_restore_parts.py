"""Where a pool restore's time goes (issue 21; docs/benchmarks/pools.md, "Where a local Mooncake restore's time goes").

SmolLM2's 4k-token prefix (16 blocks of 256 tokens) stored in a local Mooncake pool (started on 127.0.0.1, as
`kvtier bench prefix` does), then, interleaved over rounds (best and median of each): the lookup
(`manager.match`), the raw batched get of all 16 blocks into registered buffers, the same as two gets of 8 (the
stream's chunks), the payload verification of all 16 (xxh3 with the key-bound header), their copies into a paged
arena (`copy_threads()` threads), verify + copy block by block as the stream does it, and the engine's whole
restore (`KVTransfer`, as `kvtier bench prefix` times it).

    .venv/bin/python scripts/pool_restore_parts.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.bench.prefix import _arena_restore
from kvtier.blocks import DEFAULT_BLOCK_TOKENS
from kvtier.codecs.header import verify
from kvtier.engine.arena import RawArena
from pooled_prefix import pooled_prefix
from kvtier.transfer.copies import CopyGroup, copy_threads


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(rounds: int = 7) -> None:
    with pooled_prefix() as prefix:
        loaded, ids, layout, codec, manager = prefix.loaded, prefix.ids, prefix.layout, prefix.codec, prefix.manager
        backend, keys, names = prefix.backend, prefix.keys, prefix.names
        arena = RawArena(layout, len(keys), torch.device("cpu"))
        leased = backend.lease(names)
        blocks = [item[0] for item in leased]
        headers = [verify(block, key) for key, block in zip(keys, blocks)]

        def get(parts: int):
            size = len(names) // parts
            got = [item for i in range(0, len(names), size) for item in backend.lease(names[i:i + size])]
            backend.release([item[1] for item in got])

        def copy(check: bool):
            with CopyGroup(copy_threads()) as copies:
                for i, (key, block, header) in enumerate(zip(keys, blocks, headers)):
                    arena.write_block(i, codec.decode_verified(verify(block, key) if check else header, block),
                                      copies)

        def match():
            manager.unpin(manager.match(keys, pin=True))

        def overlapped():  # the stream's shape: the second get on a thread beside the first half's checks
            first = backend.lease(names[:8])
            with ThreadPoolExecutor(1) as ahead:
                second = ahead.submit(backend.lease, names[8:])
                with CopyGroup(copy_threads()) as copies:
                    for i in range(8):
                        arena.write_block(i, codec.decode_verified(verify(blocks[i], keys[i]), blocks[i]), copies)
                got = first + second.result()
            with CopyGroup(copy_threads()) as copies:
                for i in range(8, 16):
                    arena.write_block(i, codec.decode_verified(verify(blocks[i], keys[i]), blocks[i]), copies)
            backend.release([item[1] for item in got])

        parts = {"lookup (match)": match, "raw get, 1 x 16": lambda: get(1), "raw get, 2 x 8": lambda: get(2),
                 "verify 16": lambda: [verify(b, k) for k, b in zip(keys, blocks)],
                 f"copy 16 ({copy_threads()} threads)": lambda: copy(False),
                 "verify + copy, block by block": lambda: copy(True),
                 "get 8, then get 8 beside verify + copy 8, then verify + copy 8": overlapped}
        engine = _arena_restore(loaded, manager, ids, DEFAULT_BLOCK_TOKENS)
        times: dict[str, list[float]] = {name: [] for name in [*parts, "engine restore (KVTransfer)"]}
        process_s = dict.fromkeys(times, 0.0)  # this process's CPU time (the pool's server is another)
        for _ in range(rounds):
            for name, fn in [*parts.items(), ("engine restore (KVTransfer)", engine)]:
                cpu = time.process_time()
                times[name].append(timed(fn))
                process_s[name] += time.process_time() - cpu
        backend.release([item[1] for item in leased])
        print(f"{sum(map(len, blocks)) / 1e6:.1f} MB in {len(blocks)} blocks; best, median and mean CPU of {rounds} rounds")
        raw = min(times["raw get, 1 x 16"])
        for name, values in times.items():
            print(f"{name:64s} {min(values) * 1e3:7.1f} ms  {statistics.median(values) * 1e3:7.1f} ms"
                  f"  {process_s[name] / len(values) * 1e3:7.1f} ms CPU")
        print(f"engine restore / raw get (best): {raw / min(times['engine restore (KVTransfer)']):.0%}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
