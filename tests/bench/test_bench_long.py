"""`kvtier bench long`: its pure parts on fake rows (targets, ratios, the table, prompts, vLLM's
message), and the whole run on the tiny model (targets evaluated, never asserted as timings)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.long import (LongRow, LongSetup, RequestResult, agreement, compare_to_reference, make_prompts,
                               fetch_alone, merge_rows, passkey_prompt, refusal_message, render,
                               targets)
from kvtier.cli import main
from kvtier.evals.passkey import is_correct

MB = 1_000_000


def request(fetched: float = 0.0, peak: int = 0, reason: str = "length", correct: bool = True) -> RequestResult:
    return RequestResult(100, [1, 2, 3], 12345, " 12345", correct, 2.0, reason, None, peak, 0, fetched, 0.0)


def row(system: str, scenario: str, *, tok_s: float = 10.0, fetched: float = 0.0, n: int = 1, peak: int = 3 * MB,
        identical: bool = True, copy_gb_s: float = 4.0, strided_gb_s: float = 5.0, alone_gb_s: float = 7.2,
        reason: str = "length") -> LongRow:
    r = LongRow(system, scenario, [request(fetched, peak, reason) for _ in range(n)], budget_bytes=47 * MB,
                device_kv_bytes=47 * MB if system != "reference" else 400 * MB, peak_device_kv_used_bytes=20 * MB,
                decode_tokens=int(tok_s * 10), decode_s=10.0, copy_bytes=int(copy_gb_s * 1e9), copy_s=1.0,
                strided_copy_gb_s=strided_gb_s, fetch_alone_gb_s=alone_gb_s, memcpy_gb_s=9.0)
    if system != "reference":
        r.agreement = [1.0 if identical else 0.5] * n
    return r


def fake_rows(changes: dict | None = None) -> list[LongRow]:
    rows = [row("reference", "long", tok_s=10.0), row("exact", "long", tok_s=6.0, fetched=368 * MB),
            row("sparse:1/8", "long", tok_s=9.0, fetched=46 * MB, identical=False),
            row("reference", "concurrent", n=4), row("exact", "concurrent", n=4, fetched=270 * MB),
            row("sparse:1/8", "concurrent", n=4, fetched=34 * MB)]
    for (system, scenario), new in (changes or {}).items():
        rows = [new if (r.system, r.scenario) == (system, scenario) else r for r in rows]
    return rows


def by_name(rows: list[LongRow]) -> dict:
    return {t.name: t for t in targets(rows)}


def test_targets_on_fake_rows():
    t = by_name(fake_rows())
    assert t["peak device KV <= budget (exact, sparse)"].met is True
    assert t["peak device KV <= budget (exact, sparse)"].value == "100% of the budget at most"
    assert t["exact token-identical to the reference"].value == "long: yes, concurrent: yes"
    assert t["exact token-identical to the reference"].met is True
    assert t["exact decode tok/s vs reference (long)"].value == "60%"
    assert t["exact decode tok/s vs reference (long)"].met is True
    assert t["exact fetch (the engine's gathers, alone) vs warm memcpy of the same bytes (long)"].value == "80%"  # 7.2 / 9.0
    assert t["exact fetch (the engine's gathers, alone) vs warm memcpy of the same bytes (long)"].met is True
    assert t["exact fetch in the step (beside the forward, on the same cores) vs warm memcpy (long)"].value == "44%"  # 4.0 / 9.0
    assert t["exact fetch in the step (beside the forward, on the same cores) vs warm memcpy (long)"].met is False
    assert t["sparse 1/8 bytes per decode token vs exact (long)"].value == "12.50%"
    assert t["sparse 1/8 bytes per decode token vs exact (long)"].met is True
    assert t["sparse 1/8 bytes per decode token vs exact (concurrent)"].met is False  # 34 / 270 = 12.6%
    assert t["every concurrent request completes on the budget"].value == "exact 4/4, sparse:1/8 4/4"
    assert t["every concurrent request completes on the budget"].met is True


def test_targets_missed_and_unmeasured():
    rows = fake_rows({("exact", "long"): row("exact", "long", tok_s=4.0, fetched=368 * MB, identical=False,
                                               peak=48 * MB, copy_gb_s=3.0, alone_gb_s=6.3),
                        ("exact", "concurrent"): row("exact", "concurrent", n=4, fetched=270 * MB, reason="error")})
    t = by_name(rows)
    assert t["peak device KV <= budget (exact, sparse)"].met is False  # a window of 48 MB on a 47 MB budget
    assert t["exact token-identical to the reference"].value == "long: NO, concurrent: yes"
    assert t["exact decode tok/s vs reference (long)"].met is False   # 40%
    assert t["exact fetch (the engine's gathers, alone) vs warm memcpy of the same bytes (long)"].value == "70%" and t["exact fetch (the engine's gathers, alone) vs warm memcpy of the same bytes (long)"].met is False
    assert t["exact fetch in the step (beside the forward, on the same cores) vs warm memcpy (long)"].value == "33%"
    assert t["every concurrent request completes on the budget"].value == "exact 0/4, sparse:1/8 4/4"
    assert t["every concurrent request completes on the budget"].met is False
    # nothing offloaded ran: every target but those of the reference is "not measured"
    t = by_name([row("reference", "long")])
    assert [x.met for x in t.values()] == [None] * len(t)


def test_fetch_alone_moves_one_exact_steps_bytes_through_the_engines_gathers():
    """The copy reference is the engine's own `FetchArea.gather` of every layer of the host blocks, in
    pieces of a half: the last piece holds exactly its host blocks."""
    import torch

    from kvtier.offload.fetch import FetchArea

    slots, layers, heads, tokens, dim = 7, 3, 2, 4, 8
    fetch = FetchArea(3, heads, tokens, dim, torch.float32, torch.device("cpu"))
    fetch.host = torch.randn(slots, layers, 2, heads, tokens, dim)
    num_bytes, seconds = fetch_alone(fetch, 5, repeats=2)
    assert num_bytes == layers * 5 * 2 * heads * tokens * dim * 4 and seconds > 0
    assert fetch.copied_bytes == 3 * num_bytes  # the warm-up and the 2 repeats
    # the last gather: layer 2, slots 3 and 4 (pieces of 3), in half 0
    expected = fetch.host[3:5, 2].permute(1, 2, 0, 3, 4).reshape(2, heads, 2 * tokens, dim)
    assert torch.equal(fetch.kv(0, 2 * tokens), expected)
    fetch.close()


def test_row_round_trips_through_json():
    r = fake_rows()[1]
    data = json.loads(json.dumps(r.to_dict()))
    assert data["decode_tokens_per_s"] == 6.0 and data["within_budget"] is True and data["completed"] == 1
    again = LongRow.from_dict(data)
    assert again == r


def test_render_has_every_row_targets_and_vllm_message():
    rows = [LongRow("vllm", "long", message="ValueError: To serve at least one request ...")] + fake_rows()
    text = render(rows)
    assert text.count("\n| long |") == 4 and text.count("\n| concurrent |") == 3
    assert "| long | exact | 1/1 | 2.0 s | 6.00 | 47.0 MB | 20.0 MB | 3.0 MB | 368.0 MB | 4.00 | 7.20 | 5.00 | 9.00 | 100% | 1/1 |" in text
    assert "| sparse 1/8 bytes per decode token vs exact (concurrent) | 12.59% | <= 12.5% | NOT met |" in text
    assert text.endswith("vLLM (long): ValueError: To serve at least one request ...")


def test_agreement_is_the_leading_run():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert agreement([], [1, 2]) == 0.0


def test_passkey_prompt_has_its_length_and_needle():
    text = "To be, or not to be, that is the question. " * 200
    encode = lambda s: list(s.encode())  # noqa: E731
    p = passkey_prompt(encode, text, 600, 0.5, 24680, 3)
    assert len(p.token_ids) == 600
    body = bytes(p.token_ids).decode()
    assert body.count("24680") == 2 and body.endswith("What is the pass key? The pass key is")
    assert 0.3 < body.index("24680") / len(body) < 0.7
    prompts = make_prompts(encode, text, [500, 500, 500], seed=1)
    assert [p.depth for p in prompts] == [0.2, 0.5, 0.8] and len({p.passkey for p in prompts}) == 3
    assert is_correct(" 24680.", 24680)


def test_refusal_message_is_vllms_value_error():
    log = ("INFO 12-04 loading\n(EngineCore pid=1) ERROR Traceback\n"
           "(EngineCore pid=1) ValueError: To serve at least one request with the model's max seq len (8192), "
           "(1.41 GiB KV cache is needed, which is larger than the available KV cache memory (0.04 GiB).\n"
           "RuntimeError: Engine core initialization failed.\n")
    assert refusal_message(log).startswith("ValueError: To serve at least one request with the model's max seq len")
    assert refusal_message("") == "vLLM exited without a message"


def test_setup_expands_sparse_budgets():
    setup = LongSetup(budgets=("1/8", "1/4"), systems=("reference", "exact", "sparse"))
    assert setup.system_names() == ["reference", "exact", "sparse:1/8", "sparse:1/4"]
    assert setup.prompt_lengths("concurrent") == [6144] * 4


def test_bench_long_tiny_end_to_end(capsys, tmp_path):
    """The whole run on the tiny model: a budget of 192 tokens (12 blocks of 16, a fetch area of 2 x 2
    layer-blocks and the window's room: 5 of them on a 2-layer model), one 400-token request, two
    concurrent 340-token ones."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "long", "--model", "tiny", "--long-tokens", "400", "--concurrent", "2",
              "--concurrent-tokens", "340", "--max-tokens", "4", "--budgets", "1/4", "--device-tokens", "192",
              "--block-tokens", "16", "--fetch-blocks", "2", "--systems", "reference,exact,sparse", "--json",
              "--save", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "long.png")])
    assert exc.value.code in (0, None)
    rows = [LongRow.from_dict(d) for d in json.loads(capsys.readouterr().out)]
    assert [(r.system, r.scenario) for r in rows] == [(s, sc) for sc in ("long", "concurrent")
                                                      for s in ("reference", "exact", "sparse:1/4")]
    assert len(json.loads((tmp_path / "rows.json").read_text())) == 6 and (tmp_path / "long.png").stat().st_size
    for r in rows:
        assert r.completed == len(r.requests) and all(len(q.token_ids) == 4 for q in r.requests)
        if r.system != "reference":
            assert r.within_budget and r.fetched_bytes_per_token > 0
    t = by_name(rows)
    assert t["exact token-identical to the reference"].met is True  # exact == everything on the device
    assert t["peak device KV <= budget (exact, sparse)"].met is True
    exact, sparse = rows[1], rows[2]
    assert exact.request_peak_device_kv_bytes <= 3 * exact.budget_bytes // 12  # sink + 2 recent blocks of 12
    assert sparse.fetched_bytes_per_token < exact.fetched_bytes_per_token


def test_bench_long_repeat_reuses_the_offloaded_prefix(capsys):
    """`--scenarios repeat`: the 400-token request again on the same engine; exact's second request finds
    every full block before its last token cached (sink loaded, the middle pinned in DRAM) and still
    equals the reference's tokens."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "long", "--model", "tiny", "--long-tokens", "400", "--max-tokens", "4", "--device-tokens",
              "192", "--block-tokens", "16", "--fetch-blocks", "2", "--systems", "reference,exact",
              "--scenarios", "repeat", "--json"])
    assert exc.value.code in (0, None)
    rows = [LongRow.from_dict(d) for d in json.loads(capsys.readouterr().out)]
    assert [(r.system, r.scenario) for r in rows] == [("reference", "repeat"), ("exact", "repeat")]
    exact = rows[1]
    assert exact.requests[0].cached_tokens == 399 // 16 * 16 and exact.first_ttft_s > 0
    assert exact.identical and exact.within_budget
    target = by_name(rows)["exact repeat: the second request reuses the offloaded prefix, same tokens"]
    assert target.met is True and "384 of 400 prompt tokens cached" in target.value


def test_merge_rows_later_run_replaces_same_system_and_scenario():
    first = fake_rows()
    vllm_old, vllm_new = LongRow("vllm", "long", message="started"), LongRow("vllm", "long", message="ValueError: ...")
    merged = merge_rows([[vllm_old] + first, [vllm_new]])
    assert [(r.system, r.scenario) for r in merged] == [("vllm", "long")] + [(r.system, r.scenario) for r in first]
    assert merged[0].message == "ValueError: ..."


def test_compare_to_reference_across_saved_runs():
    ref = row("reference", "long")
    other = row("exact", "long")
    other.agreement = []
    other.requests[0].token_ids = [1, 2, 9]
    shorter = row("sparse:1/8", "long")
    shorter.agreement = []
    shorter.requests[0].prompt_tokens = 50  # another run's prompts: not comparable
    compare_to_reference([other, ref, shorter])
    assert other.agreement == [pytest.approx(2 / 3)] and shorter.agreement == []
