"""`kvtier plan`'s offload section: exact byte counts against the formula
(2 x layers x KV heads x d_head x bytes per element, per token), the sparse budget and its summaries,
the decode bound over each link, and the CLI. No torch."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.errors import UserError
from kvtier.plan import gpu_spec, plan
from kvtier.plan import sizing
from kvtier.plan.catalog_gpus import with_memory
from kvtier.plan.catalog_links import LINKS
from kvtier.plan.offload import OffloadOptions, parse_fraction

SMOL_TOKEN = 2 * 30 * 3 * 64 * 2           # 23,040 B: SmolLM2-135M, bf16
LLAMA70_TOKEN_RANK = 2 * 80 * 1 * 128 * 2  # 40,960 B: Llama-3-70B, bf16, one of 8 KV heads per rank at tp8
TIB = 2**40


def _smol(concurrency: int = 8, **offload):
    return plan("smollm2", with_memory(gpu_spec("h100"), 2 * 10**9), context=8192, concurrency=concurrency,
                offload=OffloadOptions(**offload))


def test_smollm2_window_host_and_step_bytes():
    r = _smol()
    o = r.offload
    assert not r.fits and o is not None
    # 32 blocks of 256; the window keeps the sink block + 3 recent ones: 28 blocks live on the host
    assert (o.window_blocks, o.device_tokens_per_request) == (4, 1024)
    assert (o.off_device_blocks_per_request, o.off_device_tokens_per_request) == (28, 7168)
    assert o.host_bytes_per_request == 7168 * SMOL_TOKEN == 165_150_720
    assert o.host_bytes_total == 8 * 165_150_720
    assert o.window_bytes_per_gpu == 8 * 1024 * SMOL_TOKEN
    assert o.host_kv_capacity_bytes == 0.8 * 2 * TIB and o.fits_host
    # exact: every off-device byte of the 8 requests, every step; fetch area = 2 layers of it
    assert (o.exact.fetched_tokens_per_request, o.exact.fetch_unit_tokens) == (7168, 256)  # 28 blocks
    assert o.exact.link_bytes_per_step == 1_321_205_760
    assert o.exact.fetch_area_bytes_per_gpu == 2 * 8 * 7168 * SMOL_TOKEN / 30 == 88_080_384
    assert o.exact.summary_bytes_per_gpu == 0
    # sparse 1/8 over 32-token pages (the engine's default): 28 blocks = 224 pages, floor(224 / 8) = 28 pages
    # (a cap, as the engine's); key min/max/mean = 3 x 64 fp16 values per page, layer and KV head
    assert o.page_tokens == 32 and o.sparse.name == "sparse 1/8"
    assert (o.sparse.fetched_tokens_per_request, o.sparse.fetch_unit_tokens) == (28 * 32, 32)
    assert o.sparse.link_bytes_per_step == 8 * 28 * 32 * SMOL_TOKEN == 165_150_720
    assert o.sparse.summary_bytes_per_gpu == 8 * 224 * 30 * 3 * 3 * 64 * 2 == 61_931_520
    assert o.sparse.fetch_area_bytes_per_gpu == 2 * 8 * 28 * 32 * SMOL_TOKEN / 30
    assert o.exact.fits_device and o.sparse.fits_device


def test_smollm2_decode_bounds():
    r = _smol()
    o, hbm = r.offload, gpu_spec("h100").hbm_bandwidth_bytes_s
    active_weights = 134.5e6 * 2
    # HBM: weights, the windows, and each fetched byte twice (written into the fetch area, then read)
    assert o.exact.hbm_bytes_per_step == active_weights + 8 * (1024 * SMOL_TOKEN + 2 * 7168 * SMOL_TOKEN)
    assert o.exact.hbm_tokens_per_s == hbm / o.exact.hbm_bytes_per_step
    assert o.sparse.hbm_bytes_per_step == active_weights + 8 * (1024 * SMOL_TOKEN + 224 * 30 * 3 * 3 * 64 * 2
                                                                + 2 * 896 * SMOL_TOKEN)
    for name, link in LINKS.items():
        assert o.exact.tokens_per_s_by_link[name] == min(o.exact.hbm_tokens_per_s, link.bytes_s / 1_321_205_760)
        assert o.sparse.tokens_per_s_by_link[name] == min(o.sparse.hbm_tokens_per_s, link.bytes_s / 165_150_720)
    assert o.exact.tokens_per_s_by_link["pcie5-x16"] == 64e9 / 1_321_205_760  # the link binds
    # buy GPUs: the existing sizing's cluster, one request per replica here
    assert (o.all_on_device_gpus, o.gpus_to_buy) == (r.gpus, r.gpus - 1) == (8, 7)
    assert o.all_on_device_tokens_per_s == hbm / (active_weights + 8192 * SMOL_TOKEN)


def test_llama_3_70b_tp8_exact_bytes():
    r = plan("llama-3.1-70b", "h100", context=131072, concurrency=32, tp=8)  # Llama-3-70B's shape
    o = r.offload
    assert (o.off_device_blocks_per_request, o.off_device_tokens_per_request) == (508, 130048)
    assert o.host_bytes_per_request == 8 * 130048 * LLAMA70_TOKEN_RANK == 42_614_128_640
    assert o.host_bytes_total == 32 * 42_614_128_640 and o.fits_host  # 1.24 TiB of 1.6 TiB
    assert o.exact.link_bytes_per_step == 32 * 130048 * LLAMA70_TOKEN_RANK == 170_456_514_560  # per GPU
    assert o.sparse.fetched_tokens_per_request == 508 * 32  # floor(508 x 8 pages / 8) pages of 32
    assert o.sparse.link_bytes_per_step == 32 * 508 * 32 * LLAMA70_TOKEN_RANK == 21_307_064_320
    assert o.sparse.summary_bytes_per_gpu == 32 * 508 * 8 * 80 * 1 * 3 * 128 * 2 == 7_990_149_120
    assert o.exact.tokens_per_s_by_link["pcie5-x16"] == 64e9 / 170_456_514_560
    assert o.sparse.tokens_per_s_by_link["rdma-400g"] == 50e9 / 21_307_064_320
    assert o.exact.fits_device and o.sparse.fits_device
    assert (o.all_on_device_gpus, o.gpus_to_buy) == (32, 24)


def test_no_offload_section_when_it_fits():
    assert plan("smollm2", "h100", context=4096, concurrency=4).offload is None


def test_sliding_layers_stay_on_the_device():
    r = plan("gemma-2-9b", "h100", context=8192, concurrency=64)
    o = r.offload
    global_token = 2 * 8 * 256 * 2 * 21  # only the 21 global layers offload
    assert o.host_bytes_per_request == 7168 * global_token
    assert o.window_bytes_per_gpu == 64 * (r.kv_bytes_per_request - 7168 * global_token)
    assert o.sparse.summary_bytes_per_gpu == 64 * 28 * 8 * 21 * 8 * 3 * 256 * 2  # 8 pages a block
    assert any("21 full-attention layers offload" in note for note in o.notes)


def test_mla_summary_is_over_the_latent():
    r = plan("deepseek-v3", "h200", context=131072, concurrency=64, tp=16)
    o = r.offload
    assert o.host_bytes_per_request == 16 * 130048 * 61 * 576 * 2  # replicated on each rank
    assert o.sparse.summary_bytes_per_gpu == 64 * 508 * 8 * 61 * 3 * 576 * 2


def test_window_and_block_options():
    r = _smol(window_tokens=2048, block_tokens=64)
    o = r.offload
    assert (o.block_tokens, o.window_blocks, o.off_device_blocks_per_request) == (64, 32, 96)
    assert o.host_bytes_per_request == 96 * 64 * SMOL_TOKEN
    # default window at 16-token blocks: the sink block + 768 recent tokens
    assert _smol(block_tokens=16).offload.window_blocks == 1 + 48


def test_open_block_is_in_the_window():
    r = plan("smollm2", with_memory(gpu_spec("h100"), 2 * 10**9), context=8000, concurrency=8)
    o = r.offload
    # 32 blocks, the last holding 64 tokens: the 28 off-device blocks are all full
    assert (o.off_device_tokens_per_request, o.device_tokens_per_request) == (7168, 832)


def test_sparse_budget_counts_the_fraction_meant():
    # 0.1 x 30 is 3.0000000000000004 in floats: still 3 blocks (a page the size of the block: whole blocks)
    o = plan("smollm2", with_memory(gpu_spec("h100"), 2 * 10**9), context=34 * 256, concurrency=8,
             offload=OffloadOptions(sparse_fraction=0.1, page_tokens=1024)).offload
    assert o.off_device_blocks_per_request == 30 and o.page_tokens == 256
    assert o.sparse.fetched_tokens_per_request == 3 * 256 and o.sparse.summary_bytes_per_gpu == 8 * 30 * 30 * 3 * 3 * 64 * 2
    assert o.sparse.name == "sparse 1/10"


def test_nothing_off_device_is_said():
    o = plan("smollm2", with_memory(gpu_spec("h100"), 2 * 10**9), context=1024, concurrency=64).offload
    assert o.host_bytes_per_request == 0 and o.exact.link_bytes_per_step == 0
    assert o.exact.tokens_per_s_by_link["pcie5-x16"] == o.exact.hbm_tokens_per_s
    assert any("nothing leaves the device" in note for note in o.notes)


def test_link_catalog_feeds_the_restore_constants():
    assert sizing.PCIE5_X16 == LINKS["pcie5-x16"].bytes_s == 64e9
    assert sizing.RDMA_400G == LINKS["rdma-400g"].bytes_s == 50e9
    assert LINKS["rdma-200g"].bytes_s == 25e9 and LINKS["cxl3-x16"].bytes_s == LINKS["pcie6-x16"].bytes_s


@pytest.mark.parametrize("text,value", [("1/8", 0.125), ("0.25", 0.25), (" 1/32 ", 1 / 32)])
def test_parse_fraction(text, value):
    assert parse_fraction(text) == value


@pytest.mark.parametrize("kwargs,message", [
    ({"sparse_fraction": 0.0}, "--sparse-fraction"), ({"sparse_fraction": 1.5}, "--sparse-fraction"),
    ({"block_tokens": 0}, "--block-tokens"), ({"window_tokens": 256}, "at least 2 blocks"),
    ({"page_tokens": 0}, "--page-tokens must be a positive"), ({"page_tokens": 48}, "must divide --block-tokens"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(UserError, match=message):
        OffloadOptions(**kwargs)


def _run(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_cli_json_offload(capsys):
    out = json.loads(_run(capsys, "--model", "smollm2", "--gpu-mem", "2GB", "--context", "8k", "--concurrency", "8",
                          "--sparse-fraction", "1/16", "--offload-window-tokens", "2k", "--json"))
    o = out["offload"]
    assert o["window_blocks"] == 8 and o["off_device_tokens_per_request"] == 6144
    assert o["host_bytes_per_request"] == 6144 * SMOL_TOKEN
    assert o["sparse"]["name"] == "sparse 1/16" and o["sparse"]["fetched_tokens_per_request"] == 12 * 32  # 192 pages / 16
    assert o["exact"]["link_bytes_per_step"] == 8 * 6144 * SMOL_TOKEN
    fits = json.loads(_run(capsys, "--model", "smollm2", "--json"))
    assert fits["fits"] and fits["offload"] is None


def test_cli_table_offload(capsys):
    out = _run(capsys, "--model", "smollm2", "--gpu-mem", "2GB", "--context", "8k", "--concurrency", "8")
    for text in ("offload", "exact", "sparse 1/8", "7,168 (28 blocks of 256)", "896 (28 pages of 32)", "pcie5-x16", "cxl3-x16", "rdma-400g", "host bytes",
                 "buy 7 more GPUs (8 in all)"):
        assert text in out


@pytest.mark.parametrize("args,message", [
    (["--sparse-fraction", "lots"], "cannot parse fraction"),
    (["--sparse-fraction", "1/0"], "cannot parse fraction"),
    (["--offload-window-tokens", "100"], "at least 2 blocks"),
    (["--page-tokens", "48"], "--page-tokens (48) must divide --block-tokens (256)"),
])
def test_cli_bad_offload_input(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "smollm2", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
