"""Time to the first layer of a layerwise vLLM load from the SSD (issue 32 item 4), without vLLM.

The connector's worker side (`WorkerSide`) on tensors laid out as vLLM's CPU cache, with SmolLM2's
shape (30 layers, 3 KV heads, d_head 64, fp32, 32-token blocks): a first worker saves N blocks into
DRAM + SSD, then, per round, a fresh worker whose DRAM is empty (a new process on the same directory)
loads them layer by layer. Reported: from `start_layerwise` to layer 0 ready (the forward's first
attention may run) and to the last layer ready, best and median of the rounds; the SSD files stay in
the page cache (the chat's case), or with `--cold` are dropped from it before each round (every byte
from the device). Run it against two commits side by side:

    PYTHONPATH=/tmp/wt-old/src python scripts/layerwise_first_layer.py --blocks 13
    PYTHONPATH=src python scripts/layerwise_first_layer.py --blocks 13
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import statistics
import tempfile
import time

import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers.manager import build_manager

L, H, T, D = 30, 3, 32, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=13, help="blocks per load (13 x 32 = 416 tokens)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cold", action="store_true", help="drop the SSD files from the page cache each round")
    args = parser.parse_args()
    n = args.blocks
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=T)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    codec = get_codec("raw")
    keys = block_keys(KeySpace("fp", layout, "raw"), list(range(n * T)))
    with tempfile.TemporaryDirectory(dir="/var/tmp") as ssd:
        specs = [f"dram:{4 * n * layout.block_bytes}", f"ssd:{ssd}:1GiB"]

        def worker(manager) -> WorkerSide:
            side = WorkerSide(layout, codec, manager)
            side.register({name: torch.randn(2 * n, H, T, 2 * D) for name in names}, lambda s: int(s.split(".")[2]))
            return side

        source_manager = build_manager(specs, slot_bytes=layout.block_bytes + 4096)
        source = worker(source_manager)
        source.begin_step([SaveSpec("r0", keys, list(range(n)))])
        for name in names:
            source.save_layer(name)
        source.finish_save()
        source.wait_saves()
        source_manager.flush()
        source.shutdown()
        source_manager.close()

        first, last = [], []
        for _ in range(args.rounds):
            if args.cold:
                _drop_from_page_cache(Path(ssd))
            manager = build_manager(specs, slot_bytes=layout.block_bytes + 4096)
            side = worker(manager)
            spec = LoadSpec("r1", keys, list(range(n, 2 * n)), ["ssd"] * n)
            start = time.perf_counter()
            side.start_layerwise([spec])
            side.wait_layer(names[0])
            first.append(time.perf_counter() - start)
            side.wait_layer(names[-1])
            last.append(time.perf_counter() - start)
            side.finish_layerwise()
            assert side.take_stats()["loaded_blocks"] == n, "the load did not read every block from the SSD"
            manager.flush()
            side.shutdown()
            manager.close()
    mb = n * layout.block_bytes / 1e6
    print(json.dumps({"blocks": n, "megabytes": round(mb, 1), "rounds": args.rounds, "cold": args.cold,
                      "first_layer_ms": {"best": round(min(first) * 1e3, 2),
                                         "median": round(statistics.median(first) * 1e3, 2)},
                      "last_layer_ms": {"best": round(min(last) * 1e3, 2),
                                        "median": round(statistics.median(last) * 1e3, 2)}}))


def _drop_from_page_cache(directory: Path) -> None:
    """Every block file's pages out of the page cache (they are written back: fsynced at write)."""
    for path in directory.glob("*/*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


if __name__ == "__main__":
    main()
