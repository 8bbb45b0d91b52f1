"""Every KV layout vLLM 0.32 can hand the connector, built on CPU as vLLM builds it (one buffer, a strided
`[B, H, N, C]` view per layer, `KVCacheLayout` stride orders captured below as data), read through each
backend's own K/V split, and round-tripped through every tier bit-exactly. No vLLM import here
(`test_vllm_layouts_in_vllm.py` checks the same against vLLM's own code)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.layouts import block_view, kv_dtype, page_format
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers.manager import build_manager

L, H, T, D, NUM_BLOCKS = 3, 2, 4, 8, 6
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]

# vLLM 0.32 `KVCacheLayout`: the physical order of the logical axes [L, B, H, N, C]
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4)}
# (page format, physical layout): what each backend runs on (CPU_ATTN reads LBHNC only; the packed-cell
# GPU backends any order; "halves" is the pre-RFC [B, 2, N, H, D] page; MLA any order, one head slot)
CASES = [("planes", "LBHNC"), ("cells", "LBHNC"), ("cells", "LBNHC"), ("cells", "BLHNC"), ("cells", "BLNHC"),
         ("halves", "-"), ("latent", "LBNHC"), ("latent", "BLHNC")]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.uint8,
          "float8_e5m2": torch.uint8}  # vLLM holds fp8 KV in uint8 tensors


def layout_of(page: str, dtype: str = "float32") -> KVLayout:
    latent = page == "latent"
    return KVLayout(num_layers=L, num_kv_heads=1 if latent else H, head_dim=D, dtype=dtype, block_tokens=T,
                    latent=latent, page="cpu_attn:vec" if page == "planes" else "")


def vllm_caches(page: str, order: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """As `create_kv_cache_views`: one buffer, each layer a strided view of it (random contents)."""
    torch_dtype = DTYPES[dtype]
    heads = 1 if page == "latent" else H
    if page == "halves":
        raw = torch.empty(L, NUM_BLOCKS, 2, T, H, D, dtype=torch_dtype)
        _fill_random(raw)
        return {name: raw[i] for i, name in enumerate(NAMES)}
    shape = (L, NUM_BLOCKS, heads, T, D if page == "latent" else 2 * D)
    strides, stride = [0] * 5, 1
    for dim in reversed(ORDERS[order]):
        strides[dim], stride = stride, stride * shape[dim]
    raw = torch.empty(math.prod(shape), dtype=torch_dtype)
    _fill_random(raw)
    view = raw.as_strided(shape, strides)
    return {name: view[i] for i, name in enumerate(NAMES)}


def _fill_random(t: torch.Tensor) -> None:
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))


def backend_kv(page: str, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V of every block, [B, H, T, D] each (MLA: the latent [B, T, D], None), read as the backend
    reads them (vLLM 0.32's code)."""
    if page == "planes":  # cpu_attn.py
        key, value = cache.view(cache.shape[0], H, 2 * T, D).chunk(2, dim=2)
        return key, value
    if page == "cells":   # flash_attn.py / triton_attn.py; flashinfer.py splits its permuted view the same way
        key, value = cache.transpose(1, 2).split(D, dim=-1)
        return key.transpose(1, 2), value.transpose(1, 2)
    if page == "halves":
        key, value = cache.unbind(1)
        return key.transpose(1, 2), value.transpose(1, 2)
    return cache[:, 0], None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("page,order", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_block_view_is_k_then_v_as_the_backend_reads_them(page, order, dtype):
    caches = vllm_caches(page, order, dtype)
    layout = layout_of(page, dtype)
    for cache in caches.values():
        view = block_view(cache, page, layout)
        assert tuple(view.shape) == (NUM_BLOCKS, *layout.block_shape[1:])
        assert str(view.dtype) == f"torch.{dtype}" and view.data_ptr() == cache.data_ptr()  # a view, no copy
        key, value = backend_kv(page, cache)
        if value is None:
            assert torch.equal(as_bytes(view[:, 0, 0]), as_bytes(key))
        else:
            assert torch.equal(as_bytes(view[:, 0]), as_bytes(key))
            assert torch.equal(as_bytes(view[:, 1]), as_bytes(value))


def test_a_cache_that_is_not_the_named_page_is_refused():
    cells = vllm_caches("cells", "LBNHC")[NAMES[0]]
    with pytest.raises(ValueError, match="CPU_ATTN reads a head's tokens contiguous"):
        block_view(cells, "planes", layout_of("planes"))  # NHD strides under the CPU backend's format
    with pytest.raises(ValueError, match=r"is not the cells page \[6, 2, 8, 16\]"):
        block_view(cells, "cells", KVLayout(L, H, D, block_tokens=8))  # kernel blocks of 4 tokens, --block-size 8
    with pytest.raises(ValueError, match="does not hold bfloat16"):
        block_view(cells, "cells", layout_of("cells", "bfloat16"))
    kv, cpu, latent = layout_of("cells"), layout_of("planes"), layout_of("latent")
    with pytest.raises(ValueError, match="does not know where attention backend FLEX_ATTENTION keeps K and V"):
        page_format("FLEX_ATTENTION", kv)
    assert [page_format(b, kv) for b in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")] == ["cells"] * 3
    assert page_format("CPU_ATTN", cpu) == "planes"
    assert page_format("TRITON_MLA", latent) == page_format("CPU_MLA", replace(latent, page="cpu_mla")) == "latent"
    # the scheduler named the CPU kernel's bytes in the keys, the worker got a GPU backend (or the reverse)
    with pytest.raises(ValueError, match="FLASH_ATTN holds cells pages, but the keys name page 'cpu_attn:vec'"):
        page_format("FLASH_ATTN", cpu)
    with pytest.raises(ValueError, match="CPU_ATTN holds planes pages, but the keys name page ''"):
        page_format("CPU_ATTN", kv)
    with pytest.raises(ValueError, match="CPU_MLA holds latent pages, but the keys name page ''"):
        page_format("CPU_MLA", latent)


def test_the_key_names_the_layout_and_only_same_bytes_share_it():
    roots = {name: KeySpace("fp", layout).root_key() for name, layout in {
        "fp32": layout_of("cells"), "bf16": layout_of("cells", "bfloat16"),
        "e4m3": layout_of("cells", "float8_e4m3fn"), "e5m2": layout_of("cells", "float8_e5m2"),
        "latent": layout_of("latent"), "one head": KVLayout(L, 1, D, block_tokens=T),
        # vLLM's CPU kernels pack K per ISA (K transposed for "vec"): not the GPU backends' bytes
        "cpu vec": layout_of("planes"), "cpu amx": replace(layout_of("planes"), page="cpu_attn:amx")}.items()}
    assert len(set(roots.values())) == len(roots)
    assert (kv_dtype("auto", "bfloat16"), kv_dtype("fp8", "bfloat16"), kv_dtype("fp8_e5m2", "float32")) == \
        ("bfloat16", "float8_e4m3fn", "float8_e5m2")
    with pytest.raises(ValueError, match="supports --kv-cache-dtype auto, fp8, fp8_e4m3, fp8_e5m2; got int8_per_token_head"):
        kv_dtype("int8_per_token_head", "bfloat16")


def test_a_tier_holds_four_times_the_fp8_tokens_it_holds_in_fp32():
    raw = get_codec("raw")
    fp32, fp8 = layout_of("cells"), layout_of("cells", "float8_e4m3fn")
    assert raw.bytes_per_token(fp32) == 4 * raw.bytes_per_token(fp8) == 4 * 2 * L * H * D
    with pytest.raises(ValueError, match="is stored raw only"):
        get_codec("int8").encode(torch.zeros(fp8.block_shape, dtype=torch.float8_e4m3fn), bytes(16))


# -- every layout through every tier, bit-exact ---------------------------------------------------

def _tier_spec(tier: str, tmp_path, request) -> str:
    if tier == "dram":
        return "dram:1MiB"
    if tier == "shm":
        return f"shm:{tmp_path}:4MiB"
    if tier == "ssd":
        return f"ssd:{tmp_path}:4MiB"
    return request.getfixturevalue("mooncake_master" if tier == "mooncake" else "redis_server").spec


def _worker(layout: KVLayout, manager, caches: dict[str, torch.Tensor], page: str) -> WorkerSide:
    worker = WorkerSide(layout, get_codec("raw"), manager)
    worker.register(caches, lambda name: int(name.split(".")[2]), page)
    return worker


def _blocks(page: str, caches: dict[str, torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """The bytes of K and V of `block_ids` in every layer, as the backend reads them."""
    out = []
    for cache in caches.values():
        for part in backend_kv(page, cache):
            if part is not None:
                out.append(as_bytes(part[block_ids]))
    return out


ROUND_TRIPS = [("planes", "LBHNC", "float32"), ("cells", "LBNHC", "bfloat16"), ("cells", "BLHNC", "float8_e4m3fn"),
               ("cells", "LBHNC", "float8_e5m2"), ("halves", "-", "float32"), ("latent", "BLNHC", "bfloat16")]


@pytest.mark.services
@pytest.mark.parametrize("tier", ["dram", "shm", "ssd", "mooncake", "redis"])
@pytest.mark.parametrize("page,order,dtype", ROUND_TRIPS)
def test_every_layout_round_trips_through_every_tier_bit_exactly(page, order, dtype, tier, tmp_path, request):
    layout = layout_of(page, dtype)
    space = KeySpace(f"layouts-{time.monotonic_ns()}", layout)  # pools are shared by the session: own keys
    manager = build_manager([_tier_spec(tier, tmp_path, request)], slot_bytes=1 << 14, async_writes=False)
    source_caches, target_caches = vllm_caches(page, order, dtype), vllm_caches(page, order, dtype)
    source, target = _worker(layout, manager, source_caches, page), _worker(layout, manager, target_caches, page)
    keys = block_keys(space, list(range(3 * T)))
    source.begin_step([SaveSpec("r0", keys, [4, 1, 3])])
    for name in NAMES:
        source.save_layer(name)
    source.finish_save()
    source.wait_saves()
    assert source.take_stats()["saved_blocks"] == 3
    untouched = _blocks(page, target_caches, [1, 3, 4])
    target.start_loads([LoadSpec("r1", keys, [0, 2, 5], [tier] * 3)])
    target.shutdown()  # drains the loader
    assert target.take_finished_loads() == {"r1"} and target.take_invalid_block_ids() == set()
    assert target.take_loaded_tiers() == {"r1": [tier] * 3}
    for got, want in zip(_blocks(page, target_caches, [0, 2, 5]), _blocks(page, source_caches, [4, 1, 3])):
        assert torch.equal(got, want)
    for got, want in zip(_blocks(page, target_caches, [1, 3, 4]), untouched):
        assert torch.equal(got, want)  # no other block written
    source.shutdown()
    manager.close()
