"""Offloaded decode on the CPU read in place (`InPlaceDecode`, `paged_kernel.paged_decode_two`): one kernel call a
layer over the host blocks where they sit and the device window, equal to attention over both and to the engine's
fetch-area path and everything on the device, token for token."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier.codecs import get_codec
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams, paged_kernel
from kvtier.offload.in_place import InPlaceDecode
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_support import reference  # noqa: E402

pytestmark = pytest.mark.skipif(not paged_kernel.available(), reason="the paged kernel could not be built")

BLOCK = 8


def _host_slots(num_slots, layers, heads, block, dim, dtype):
    """[S, L, 2, H, T, D] rows after a 7-element header, as the DRAM tier's `payload_view`."""
    rows = torch.randn(num_slots, 7 + layers * 2 * heads * block * dim).to(dtype)
    return rows[:, 7:].unflatten(1, (layers, 2, heads, block, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, group, dim, block, page, picked", [
    (3, 3, 64, 16, 16, None),  # exact: every block
    (3, 3, 64, 16, 4, 5),      # sparse: each head its own 5 pages of 4 tokens
    (1, 8, 16, 8, 2, 3),       # the largest query group the kernel holds
])
def test_decode_over_host_blocks_in_place_and_the_window_is_attention_over_both(dtype, heads, group, dim, block,
                                                                                page, picked):
    torch.manual_seed(0)
    host = _host_slots(20, 2, heads, block, dim, dtype)
    slots, layer, m = torch.tensor([5, 2, 9, 13, 0, 7, 11]), 1, 37
    k_dev, v_dev = torch.randn(heads, m, dim).to(dtype), torch.randn(heads, m, dim).to(dtype)
    q = torch.randn(heads * group, 1, dim)
    reads = InPlaceDecode(host, page)
    pages = slots.numel() * (block // page)
    if picked is None:
        top = torch.arange(slots.numel())[:, None].expand(-1, heads)
        offsets = reads.exact_offsets(slots)
    else:
        top = torch.stack([torch.randperm(pages)[:picked].sort().values for _ in range(heads)], 1)  # [k, H]
        offsets = reads.page_offsets(slots, top // (block // page), top % (block // page))
    # what it must equal: each head's units gathered, then the window, one SDPA
    per_block = block // page
    units = host[:, layer].unflatten(-2, (per_block, page))  # [S, 2, H, pages, P, D]
    heads_idx = torch.arange(heads)
    picked_kv = units[slots[top // per_block], :, heads_idx, top % per_block]  # [k, H, 2, P, D]
    k_host = picked_kv[:, :, 0].permute(1, 0, 2, 3).flatten(1, 2)
    v_host = picked_kv[:, :, 1].permute(1, 0, 2, 3).flatten(1, 2)
    k_all, v_all = torch.cat([k_host, k_dev], 1).float(), torch.cat([v_host, v_dev], 1).float()
    want = F.scaled_dot_product_attention(q[None], k_all[None], v_all[None], enable_gqa=True)[0]
    got = reads.forward(layer, q, k_dev, v_dev, offsets, page, dim ** -0.5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5 if dtype == torch.float32 else 2e-2, rtol=1e-4)


def test_an_offset_outside_the_slots_is_refused():
    host = _host_slots(4, 1, 2, 8, 16, torch.float32)
    reads = InPlaceDecode(host, 8)
    q, k_dev = torch.randn(4, 1, 16), torch.randn(2, 5, 16)
    with pytest.raises(RuntimeError, match="outside the KV's storage"):
        reads.forward(0, q, k_dev, k_dev.clone(), reads.exact_offsets(torch.tensor([1, 4])), 8, 0.25)


def _engine(model, mode, page_tokens=BLOCK):
    layout = model.kv_layout(BLOCK)
    manager = build_manager(["dram:64MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    config = EngineConfig(device_kv_budget_bytes=12 * layout.block_bytes, block_tokens=BLOCK, kv_offload=mode,
                          max_prefill_tokens=16, offload_fetch_blocks=3, offload_page_tokens=page_tokens)
    return LLMEngine(model, config, manager), manager


def _generate(model, prompts, mode, page_tokens=BLOCK):
    engine, manager = _engine(model, mode, page_tokens)
    in_place = engine.offload_attention.in_place is not None
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    tokens = [[t for o in outputs[str(i)] for t in o.new_token_ids] for i in range(len(prompts))]
    fetched = [outputs[str(i)][-1].offload.decode_fetched_bytes for i in range(len(prompts))]
    read = engine.offload_attention.in_place_bytes
    assert manager.tiers[0].num_leased() == 0
    engine.close()
    manager.close()
    return tokens, fetched, read, in_place


@pytest.mark.parametrize("mode, page_tokens", [("exact", BLOCK), ("sparse:1/4", 2), ("sparse:1/4", BLOCK)])
def test_in_place_decode_equals_the_fetch_area_path(tiny_model, mode, page_tokens, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (70, 90)]  # together: two sequences
    tokens, fetched, read, in_place = _generate(tiny_model, prompts, mode, page_tokens)
    assert in_place and read == sum(fetched) > 0  # every decode read its host blocks in place
    with monkeypatch.context() as patch:
        patch.setattr(InPlaceDecode, "usable", staticmethod(lambda *args: False))
        piecewise, fetched_piecewise, read_piecewise, in_place_piecewise = _generate(tiny_model, prompts, mode,
                                                                                     page_tokens)
    assert not in_place_piecewise and read_piecewise == 0
    assert tokens == piecewise and fetched == fetched_piecewise  # the same pages, the same tokens
    if mode == "exact":
        assert tokens == [reference(tiny_model.model, p, 12) for p in prompts]
