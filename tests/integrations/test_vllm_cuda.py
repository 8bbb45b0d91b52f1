"""The connector's worker on a CUDA cache (skipped without a GPU; `make gpu-check` runs it): saves and both
load modes through the side stream and pinned buffers, bit-exact, with the forward's own stream kept busy."""

from __future__ import annotations

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers.manager import build_manager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

L, H, T, D, NUM_BLOCKS = 4, 8, 16, 128, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def caches(dtype: str) -> dict[str, torch.Tensor]:
    """FlashAttention's cells in NHD order (LBNHC), as vLLM allocates them on the GPU."""
    raw = torch.randint(0, 256, (L, NUM_BLOCKS, T, H, 2 * D * torch.empty(0, dtype=getattr(torch, dtype)).element_size()),
                        dtype=torch.uint8, device="cuda")
    torch_dtype = torch.uint8 if dtype.startswith("float8") else getattr(torch, dtype)
    return {name: raw[i].view(torch_dtype).transpose(1, 2) for i, name in enumerate(NAMES)}  # [B, H, N, C]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("mode", ["async", "layerwise"])
def test_blocks_round_trip_through_the_side_stream_bit_exactly(tmp_path, dtype, mode):
    layout = KVLayout(L, H, D, dtype=dtype, block_tokens=T)
    manager = build_manager([f"shm:{tmp_path}:64MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout) + 4096,
                            async_writes=False)
    workers = []
    for _ in range(2):
        worker = WorkerSide(layout, get_codec("raw"), manager)
        kv = caches(dtype)
        worker.register(kv, lambda name: int(name.split(".")[2]), "cells")
        workers.append((worker, kv))
    (source, source_kv), (target, target_kv) = workers
    keys = block_keys(KeySpace("fp", layout), list(range(8 * T)))
    ids = list(range(3, 11))
    busy = torch.randn(4096, 4096, device="cuda")
    source.begin_step([SaveSpec("r0", keys, ids)])
    for name in NAMES:
        busy @ busy  # the forward's stream is busy while each layer's copy is queued behind it
        source.save_layer(name)
    source.finish_save()
    source.wait_saves()
    assert source.take_stats()["saved_blocks"] == 8
    spec = LoadSpec("r1", keys, list(range(40, 48)), ["shm"] * 8)
    if mode == "async":
        target.start_loads([spec])
        target.shutdown()
        assert target.take_finished_loads() == {"r1"}
    else:
        target.start_layerwise([spec])
        for name in NAMES:
            target.wait_layer(name)
        target.finish_layerwise()
        target.shutdown()
    torch.cuda.synchronize()
    assert target.take_invalid_block_ids() == set()
    for name in NAMES:
        got, want = target_kv[name][40:48], source_kv[name][3:11]
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    source.shutdown()
    manager.close()
