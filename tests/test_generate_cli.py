"""`kvtier generate`: the options it shares with `kvtier serve` come from the same fields and are checked the same way."""

import pytest

from kvtier.cli import _register_all, app, main


def test_shared_options_have_the_serve_defaults_and_help():
    import typer.main

    from kvtier.config import EngineConfig

    _register_all()
    generate = {p.name: p for p in typer.main.get_command(app).commands["generate"].params}
    serve = {p.name: p for p in typer.main.get_command(app).commands["serve"].params}
    for name in ("model", "codec", "kv_codec", "block_tokens"):
        assert generate[name].opts == serve[name].opts and serve[name].help.startswith(generate[name].help)
    assert (generate["model"].default, generate["block_tokens"].default) == ("smollm2", EngineConfig().block_tokens)


@pytest.mark.parametrize("argv, message", [
    (["--kv-codec", "int3"], "kvtier: error: kv_codec must be one of raw, fp8, int8, int4, int2, got 'int3'\n"),
    (["--block-tokens", "0"], "kvtier: error: block_tokens must be positive (>= 1), got 0\n"),
    (["--codec", "zip"], "kvtier: error: unknown codec 'zip': use one of raw, fp8, int8, int4, int2, optionally "
                         "with '+zstd'\n"),
    (["--kv-codec", "int4", "--kv-offload", "exact"],
     "kvtier: error: kv_offload needs the raw device and tier formats (kv_codec 'int4', codec 'raw'): offloaded "
     "blocks are attended to as they are; kv_codec raw and codec raw work\n"),
    (["--device-kv-budget", "1MiB"],
     "kvtier: error: --device-kv-budget runs the serving engine and needs --kv-offload exact|sparse:BUDGET "
     "(--kv-offload alone offloads through TieredCache)\n"),
    (["--kv-offload", "sometimes"], "kvtier: error: kv_offload must be 'off', 'exact' or 'sparse:BUDGET' (0.125, 1/8 "
                                    "or a number of pages), got 'sometimes'\n"),
])
def test_bad_shared_options_exit_2_before_loading_a_model(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "hello", *argv])
    assert info.value.code == 2 and capsys.readouterr().err == message


def test_kv_offload_generates_through_the_engine_exactly(tiny_model):
    """A prompt longer than the device budget: the engine path, the same tokens as model.generate."""
    import torch

    from kvtier.codecs import get_codec
    from kvtier.config import EngineConfig
    from kvtier.generate_cli import run_engine_generate
    from kvtier.tiers.manager import build_manager

    prompt = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = tiny_model.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 70:].tolist()
    layout = tiny_model.kv_layout(8)
    manager = build_manager(["dram:8MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    config = EngineConfig(device_kv_budget_bytes=12 * layout.block_bytes, block_tokens=8, kv_offload="exact",
                          offload_fetch_blocks=3)
    try:
        result = run_engine_generate(tiny_model, manager, prompt, max_new_tokens=12, config=config)
    finally:
        manager.close()
    assert result.text == str(ref) and result.new_tokens == len(ref)
    assert result.offload["mode"] == "exact" and result.offload["host_kv_bytes"] > 0


def test_kv_offload_without_a_budget_generates_through_tiered_cache(tiny_model):
    """`--kv-offload` alone: `run_generate`'s TieredCache keeps block windows; a budget over every host
    block decodes model.generate's tokens, and the result reports what the offload moved."""
    import torch

    from kvtier.generate_cli import run_generate
    from kvtier.tiers.manager import build_manager

    prompt = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = tiny_model.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 70:].tolist()
    results = {}
    for mode in ("sparse:1000", "sparse:1"):
        manager = build_manager(["dram:8MiB"], slot_bytes=tiny_model.kv_layout(8).block_bytes + 4096)
        try:
            results[mode] = run_generate(tiny_model, manager, prompt, max_new_tokens=12, block_tokens=8,
                                         kv_offload=mode)
        finally:
            manager.close()
    whole, one = results["sparse:1000"], results["sparse:1"]
    assert whole.text == str(ref) and whole.stored_blocks == (70 + 11) // 8
    assert whole.offload["mode"] == "sparse:1000" and whole.offload["host_kv_bytes"] > 0
    # one host block per layer and KV head per decode token: 2 layers x 8 tokens x 256 bytes (K + V, 2 heads)
    assert one.offload["fetched_bytes_per_decode_token"] == 2 * 8 * 256
    assert 0 < one.offload["fetched_bytes_per_decode_token"] < whole.offload["fetched_bytes_per_decode_token"] / 4


def test_generate_passes_offload_page_tokens_to_tiered_cache(tiny_model, monkeypatch, capsys):
    """`kvtier generate --kv-offload sparse:1 --offload-page-tokens 2`: one 2-token page per layer and KV
    head per decode token, not a block (the option reaches TieredCache)."""
    import dataclasses
    import json
    from types import SimpleNamespace

    from kvtier import models

    class ByteTokenizer:  # the tiny model has none: a byte per token
        eos_token_id = None

        def __call__(self, text):
            return SimpleNamespace(input_ids=[3 + b % 250 for b in text.encode()])

        def decode(self, ids, skip_special_tokens=True):
            return str(ids)

    monkeypatch.setattr(models, "load", lambda spec: dataclasses.replace(tiny_model, tokenizer=ByteTokenizer()))
    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "word " * 60, "--max-new-tokens", "6", "--tiers", "dram", "--block-tokens",
              "8", "--kv-offload", "sparse:1", "--offload-page-tokens", "2", "--json"])
    assert not info.value.code
    offload = json.loads(capsys.readouterr().out)["offload"]
    assert offload["mode"] == "sparse:1" and offload["fetched_bytes_per_decode_token"] == 2 * 2 * 256


def test_second_process_reports_where_its_ttft_went(tiny_model, monkeypatch, capsys, tmp_path):
    """`kvtier generate --json` twice on one SSD directory: the second finds the prompt's full blocks on the SSD,
    and its TTFT is split into the restore (the SSD read, the tiers' writes) and the prefill of the rest;
    the process's first forward (the warm-up) runs before the request's clock starts."""
    import dataclasses
    import json
    from types import SimpleNamespace

    from kvtier import generate_cli, models

    class ByteTokenizer:  # the tiny model has none: a byte per token
        eos_token_id = None

        def __call__(self, text):
            return SimpleNamespace(input_ids=[3 + b % 250 for b in text.encode()])

        def decode(self, ids, skip_special_tokens=True):
            return str(ids)

    monkeypatch.setattr(models, "load", lambda spec: dataclasses.replace(tiny_model, tokenizer=ByteTokenizer()))
    order = []
    for name in ("warm_up", "run_generate"):
        real = getattr(generate_cli, name)
        monkeypatch.setattr(generate_cli, name, lambda *a, _real=real, _name=name, **k: order.append(_name) or
                            _real(*a, **k))
    runs = []
    for _ in range(2):
        with pytest.raises(SystemExit) as info:
            main(["generate", "--prompt", "word " * 20, "--max-new-tokens", "4", "--tiers", "dram,ssd", "--ssd-dir",
                  str(tmp_path / "ssd"), "--block-tokens", "16", "--json"])
        assert not info.value.code
        runs.append(json.loads(capsys.readouterr().out))
    first, second = runs
    assert order == ["warm_up", "run_generate"] * 2
    assert (first["cached_tokens"], second["cached_tokens"], second["hit_tokens_by_tier"]) == (0, 96, {"ssd": 96})
    assert second["text"] == first["text"] and second["warmup_s"] > 0
    b = second["ttft_breakdown"]
    assert b["restore_s"] + b["prefill_s"] == pytest.approx(second["ttft_s"], abs=1e-9)
    assert b["tier_read_s"]["ssd"] > 0 and b["tier_read_s"]["dram"] == 0  # all 6 blocks read from the SSD
    assert b["tier_write_s"]["ssd"] == 0  # (their promotion into DRAM: inside the restore, or after it on the writer)
    assert first["ttft_breakdown"]["tier_read_s"] == {"dram": 0, "ssd": 0}
