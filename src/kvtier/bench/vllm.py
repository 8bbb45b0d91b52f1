"""`kvtier bench vllm`: the chat workload of `kvtier bench serve` (or the Mooncake trace) through real
vLLM's OpenAI API, on one device KV budget that cannot hold all conversations, side by side:

- `vllm`: vLLM alone (its device prefix cache);
- `vllm-kvtier-dram`: vLLM + kvtier's connector on DRAM only: a shared-memory tier (`shm:`, block files
  under /dev/shm, which vLLM's scheduler and worker processes both see);
- `vllm-kvtier-ssd`: vLLM + kvtier's connector on DRAM + SSD (a temporary directory);
- `vllm-kvtier-pool`: vLLM + kvtier on DRAM + a local Mooncake pool (started here);
- `vllm-kvtier-disagg`: prefill/decode disaggregation: a `kv_producer` and a `kv_consumer` vLLM sharing an
  `shm:` tier behind kvtier's proxy (`integrations/vllm/proxy.py`), each on the device budget;
- `vllm-example`: vLLM + its ExampleConnector (safetensors files per prompt);
- `vllm-lmcache`: vLLM + LMCache's multi-process connector and cache server on DRAM (its own
  environment, `make lmcache`; skipped with a message when that is missing);
- `kvtier-serve`: kvtier's own engine with a DRAM tier, in this process, on the same budget.

Each system replays the same requests (greedy, EOS ignored). Reported: TTFT p50/p99, ITL, tokens/s,
cached prompt tokens by tier (device = vLLM's own prefix cache, from /metrics), failures, and whether
every reply equals vLLM alone's (kvtier-serve is another engine: its text is not compared), and where
each vLLM system's time went (`breakdown`, from /metrics): per request, the mean time queued (waiting for
device blocks, and for an asynchronous kvtier load), in prefill and in decode; the prompt tokens vLLM
really computed; preemptions; kvtier's worker time in loads and in copying saves out; the machine's
1-minute load average (the larger of the system's start and end: other work on the cores shows there).
A disaggregated pair's replies come from its consumer (TTFT through the proxy includes the producer's
prefill); its breakdown has a row for each engine, so the prompts the producer computed show too.

`--workload decode` asks what a connector costs when there is nothing to load: rounds of `--users`
concurrent requests, every prompt a passage no other request shares (so no hit anywhere; kvtier still
saves every full block), `--max-tokens` greedy tokens each, the first round a warm-up. Every vLLM
system runs with the same OpenMP layout (`VLLM_CPU_NUM_OF_RESERVED_CPU`, by default what vLLM gives a
server with a KV connector: two cores per rank reserved, i.e. none on a 2-core box), so the comparison is
the connector's own cost, not vLLM's choice of cores. Reported per system: each round's ITL p50 and
decode tokens/s, the best round of each, and the best against vLLM alone's best (`decode_vs_vllm`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from kvtier.bench import cpu
from kvtier.bench.harness import SystemResult, TurnClock, Workload, chat_prompt, conversations, trace_requests

SYSTEMS = ("vllm", "vllm-kvtier-dram", "vllm-kvtier-ssd", "vllm-kvtier-pool", "vllm-kvtier-disagg", "vllm-example",
           "vllm-lmcache", "kvtier-serve")


async def _stream(client, result: SystemResult, key, ids: list[int], max_tokens: int) -> str | None:
    """One streamed greedy completion: TTFT and gaps into `result`; the reply text, None on failure."""
    body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    result.num_prompt_tokens += len(ids)
    clock, text, tokens = TurnClock(), [], []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("token_ids")):
                    continue
                clock.tick()
                text.append(choices[0].get("text") or "")
                tokens += choices[0].get("token_ids") or []
    except Exception as exc:  # noqa: BLE001 - counted; the other users go on
        result.fail(exc)
        return None
    result.turns[key] = clock.turn(tokens, result.t0)
    return "".join(text)


def _run_chat(url: str, tokenizer, convs, w: Workload, name: str) -> SystemResult:
    import httpx

    result = SystemResult(name=name, wall_s=0.0)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
            async def user(u: int, passage: str, user_messages: list[str]) -> None:
                replies: list[str] = []
                for turn in range(len(user_messages)):
                    ids = chat_prompt(tokenizer, passage, user_messages[:turn + 1], replies)
                    text = await _stream(client, result, (u, turn), ids, w.max_tokens)
                    if text is None:
                        return
                    replies.append(text)

            await asyncio.gather(*(user(u, p, m) for u, (p, m) in enumerate(convs)))

    start = time.perf_counter()
    asyncio.run(main())
    result.wall_s = time.perf_counter() - start
    return result


def decode_rounds(text: str, tokenizer, w: Workload) -> list[list[list[int]]]:
    """`--workload decode`'s prompts: `w.num_turns` rounds (the first a warm-up) of `w.num_users` prompts,
    each a passage of `w.context_chars` as it is (no chat template, whose system prompt every request would
    share): no prompt shares a first block with another, so nothing is cached anywhere to load."""
    passages = conversations(text, Workload(num_users=w.num_users * w.num_turns, num_turns=1,
                                            context_chars=w.context_chars, turn_chars=w.turn_chars))
    prompts = [[int(t) for t in tokenizer(passage)["input_ids"]] for passage, _ in passages]
    return [prompts[r * w.num_users:(r + 1) * w.num_users] for r in range(w.num_turns)]


def decode_device_tokens(rounds: list[list[list[int]]], max_tokens: int, block_tokens: int) -> int:
    """The device KV (tokens, whole blocks) the largest round needs with every request at its last token."""
    return max(sum(-(-(len(ids) + max_tokens) // block_tokens) for ids in r) for r in rounds) * block_tokens


def _run_decode(url: str, rounds: list[list[list[int]]], max_tokens: int, name: str,
                first_round: int = 0) -> SystemResult:
    """The rounds one after another (numbered from `first_round`), each round's requests at once."""
    import httpx

    result = SystemResult(name=name, wall_s=0.0)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
            for r, prompts in enumerate(rounds, first_round):
                await asyncio.gather(*(_stream(client, result, (r, i), ids, max_tokens)
                                       for i, ids in enumerate(prompts)))

    start = time.perf_counter()
    asyncio.run(main())
    result.wall_s = time.perf_counter() - start
    return result


def decode_figures(result: SystemResult) -> dict:
    """Per measured round: ITL p50 and decode tokens/s (tokens after each request's first, over the span
    from the round's first first-token to its last token); the best round of each."""
    by_round: dict[int, list] = {}
    for (r, _), turn in sorted(result.turns.items()):
        by_round.setdefault(r, []).append(turn)
    itls, rates = [], []
    for turns in by_round.values():
        gaps = sorted(x for t in turns for x in t.itl_s)
        itls.append(gaps[len(gaps) // 2] if gaps else 0.0)
        first = min(t.start_s + t.ttft_s for t in turns)
        last = max(t.token_times_s()[-1] for t in turns)
        rates.append(sum(len(t.itl_s) for t in turns) / (last - first) if last > first else 0.0)
    return {"round_itl_p50_s": itls, "round_decode_tokens_per_s": rates,
            "best_itl_p50_s": min(itls, default=0.0), "best_decode_tokens_per_s": max(rates, default=0.0)}


def _run_trace(url: str, reqs, name: str) -> SystemResult:
    import httpx

    result = SystemResult(name=name, wall_s=0.0)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
            t0 = time.perf_counter()

            async def one(i: int, r) -> None:
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
                await _stream(client, result, (i, 0), r.token_ids, r.max_tokens)

            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))

    start = time.perf_counter()
    asyncio.run(main())
    result.wall_s = time.perf_counter() - start
    return result


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    def total(m):
        return sum(v for (n, ls), v in m.items() if n == name and all((k, x) in ls for k, x in labels.items()))
    return total(after) - total(before)


def cpu_since(sessions: list[tuple[str, int]], before: list) -> dict[str, float]:
    """The CPU seconds of each (label, session) since its snapshot in `before`, by `bench.cpu` name; one label
    may name two trees (a pool's processes): their figures are added."""
    used: dict[str, float] = {}
    for (tree, session), snap in zip(sessions, before):
        for name, seconds in cpu.since(snap, cpu.snapshot(session), tree).items():
            used[name] = round(used.get(name, 0.0) + seconds, 2)
    return used


def _breakdown(before: dict, after: dict) -> dict[str, float]:
    """Where the time went, from vLLM's request histograms (means per finished request) and kvtier's counters."""
    def delta(name: str) -> float:
        return _delta(before, after, name)

    num_requests = max(1.0, delta("vllm:request_queue_time_seconds_count"))
    out = {f"{phase}_s_mean": delta(f"vllm:request_{phase}_time_seconds_sum") / num_requests
           for phase in ("queue", "prefill", "decode")}
    out["computed_prompt_tokens"] = delta("vllm:request_prefill_kv_computed_tokens_sum")
    out["preemptions"] = delta("vllm:num_preemptions_total")
    for name in ("load_seconds", "save_copy_seconds", "save_write_seconds", "scheduler_seconds"):
        out[f"kvtier_{name}"] = delta(f"kvtier:{name}_total")
    return out


def _cached_tokens(before: dict, after: dict) -> dict[str, int]:
    """Prompt tokens served from caches during the run, by where they were: vLLM's device prefix
    cache, kvtier's tiers (the worker's own count), or another connector ("external")."""
    def delta(name: str, **labels) -> float:
        return _delta(before, after, name, **labels)

    out = {"device": int(delta("vllm:prefix_cache_hits_total"))}
    tiers = {dict(ls).get("tier") for (n, ls) in after if n == "kvtier:hit_tokens_total"}
    for tier in sorted(t for t in tiers if t):
        out[tier] = int(delta("kvtier:hit_tokens_total", tier=tier))
    if not tiers:
        out["external"] = int(delta("vllm:external_prefix_cache_hits_total"))
    return {k: v for k, v in out.items() if v}


def _vllm_system(name: str, model_dir: Path, tmp: Path, stack: ExitStack, *, num_blocks: int, load: str,
                 sessions: list[tuple[str, int]], env: dict[str, str] | None = None):
    """The system's server(s), started; `sessions` gets (label, session) for each process tree it started
    (vLLM's, a disaggregated pair's two, LMCache's cache server, a pool's), for `bench.cpu`."""
    from kvtier.bench.pools import MooncakePool
    from kvtier.bench.servers import (LMCACHE_PYTHON, VLLM_PYTHON, DisaggSystem, LmcacheServer, VllmServer,
                                      kvtier_transfer_config)

    python = VLLM_PYTHON
    if name == "vllm":
        transfer = None
    elif name == "vllm-kvtier-dram":
        shm = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm"))
        stack.callback(shutil.rmtree, shm, ignore_errors=True)
        transfer = kvtier_transfer_config([f"shm:{shm}:2GiB"], load=load)
    elif name == "vllm-kvtier-ssd":
        transfer = kvtier_transfer_config(["dram:2GiB", f"ssd:{tmp / 'ssd'}:8GiB"], load=load)
    elif name == "vllm-kvtier-pool":
        pool = MooncakePool(tmp, segment="2GB", buffer="256MiB")
        stack.callback(pool.kill)
        pool.start()
        sessions += [("mooncake", proc.pid) for proc in pool.procs]
        transfer = kvtier_transfer_config(["dram:2GiB", pool.spec], load=load)
    elif name == "vllm-kvtier-disagg":
        shm = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm"))
        stack.callback(shutil.rmtree, shm, ignore_errors=True)
        pair = stack.enter_context(DisaggSystem(model_dir, tmp, [f"shm:{shm}:2GiB"], load=load,
                                                extra_args=("--num-gpu-blocks-override", str(num_blocks)),
                                                max_model_len=(num_blocks - 1) * 32))
        sessions += [("producer", pair.producer.proc.pid), ("consumer", pair.consumer.proc.pid)]
        return pair
    elif name == "vllm-example":
        (tmp / "example").mkdir(exist_ok=True)
        transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")}}
    elif name == "vllm-lmcache":
        cache_server = stack.enter_context(LmcacheServer(tmp / "lmcache-server.log"))
        transfer = cache_server.transfer_config()
        python = LMCACHE_PYTHON
        sessions.append(("lmcache", cache_server.proc.pid))
    else:
        raise ValueError(f"unknown system {name!r}: use {', '.join(SYSTEMS)}")
    # vLLM refuses a context longer than its KV budget: the budget caps the model length too
    server = stack.enter_context(VllmServer(model_dir, tmp / f"{name}.log", kv_transfer=transfer,
                                            extra_args=("--num-gpu-blocks-override", str(num_blocks)),
                                            max_model_len=(num_blocks - 1) * 32, python=python, env=env))
    sessions.append(("vllm", server.proc.pid))
    return server


def run(workload: Workload | None = None, *, systems: tuple[str, ...] = SYSTEMS, device_kv_tokens: int = 1088,
        trace: bool = False, trace_requests_: int = 32, trace_start: int = 0, time_scale: float = 1.0,
        log_dir: str | None = None, load: str = "layerwise", decode: bool = False,
        reserved_cpus: int = 2) -> list[dict]:
    from kvtier import models
    from kvtier.bench import serve
    from kvtier.data import MOONCAKE_TRACE, SHAKESPEARE, shared_data_file
    from kvtier.bench.servers import BLOCK_TOKENS, LMCACHE_PYTHON
    from kvtier.errors import UserError

    if "vllm-lmcache" in systems and not LMCACHE_PYTHON.exists():
        print(f"vllm-lmcache skipped: {LMCACHE_PYTHON} not found (`make lmcache` creates it, "
              "or set KVTIER_LMCACHE_PYTHON)", file=sys.stderr)
        systems = tuple(n for n in systems if n != "vllm-lmcache")
        if not systems:
            return []
    w = workload or Workload(num_users=8, num_turns=4, max_tokens=24)
    loaded = models.load("smollm2", device="cpu")
    model_dir = models.cache_dir() / "smollm2-135m-instruct"
    convs = conversations(shared_data_file(SHAKESPEARE).read_text(), w)
    num_blocks = device_kv_tokens // BLOCK_TOKENS
    reqs = trace_requests(shared_data_file(MOONCAKE_TRACE), num_requests=trace_requests_, start=trace_start,
                          block_tokens=16, max_tokens=w.max_tokens, time_scale=time_scale,
                          max_context=(num_blocks - 1) * BLOCK_TOKENS) if trace else None
    rounds = decode_rounds(shared_data_file(SHAKESPEARE).read_text(), loaded.tokenizer, w) if decode else None
    if rounds:  # a round that does not fit the device would preempt (recompute), not measure decoding
        need = decode_device_tokens(rounds, w.max_tokens, BLOCK_TOKENS)
        if need > device_kv_tokens:
            raise UserError(f"--workload decode: a round of {w.num_users} requests needs --device-kv-tokens >= "
                            f"{need} (their prompts and --max-tokens {w.max_tokens} on the device at once)")
    # decode: one OpenMP layout for every system (vLLM reserves cores for a connector, not without one)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus)} if decode else None
    results: dict[str, SystemResult] = {}
    breakdowns: dict[str, dict[str, float]] = {}
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    for name, label in zip(systems, run_labels(systems)):
        with ExitStack() as stack:
            tmp = tempfile.mkdtemp(prefix=f"{name}-", dir=log_dir) if log_dir else \
                stack.enter_context(tempfile.TemporaryDirectory())
            if name == "kvtier-serve":
                budget = device_kv_tokens * loaded.kv_layout().bytes_per_token
                args = dict(name=name, budget_bytes=budget, block_tokens=BLOCK_TOKENS,
                            tier_specs=["dram:2GiB"])
                results[label] = (serve.run_engine_trace(loaded, reqs, **args) if trace
                                  else serve.run_engine(loaded, convs, w, **args))
                results[label].name = label
                continue
            sessions: list[tuple[str, int]] = []
            server = _vllm_system(name, model_dir, Path(tmp), stack, num_blocks=num_blocks, load=load, env=env,
                                  sessions=sessions)
            if decode:  # the warm-up round: in neither the figures nor the /metrics deltas
                _run_decode(server.url, rounds[:1], w.max_tokens, label)
            producer = getattr(server, "producer", None)  # a disaggregated pair: `server` reads its consumer
            producer_before = producer.metrics() if producer else {}
            before, load_before = server.metrics(), os.getloadavg()[0]
            cpu_before = [cpu.snapshot(session) for _, session in sessions]
            results[label] = (_run_trace(server.url, reqs, label) if trace
                              else _run_decode(server.url, rounds[1:], w.max_tokens, label, first_round=1) if decode
                              else _run_chat(server.url, loaded.tokenizer, convs, w, label))
            after = server.metrics()
            cpu_used = cpu_since(sessions, cpu_before)
            results[label].prefix_hit_tokens_by_tier = _cached_tokens(before, after)
            breakdowns[label] = _breakdown(before, after) | {"load_avg": max(load_before, os.getloadavg()[0]),
                                                             "cpu_s": cpu_used}
            if producer:
                breakdowns[label]["producer"] = (_breakdown(producer_before, producer.metrics())
                                                 | {"load_avg": breakdowns[label]["load_avg"]})
    reference = results.get("vllm")
    rows = []
    for name, result in results.items():
        row = result.row(reference if name.startswith("vllm") and result is not reference else None)
        row["same_text_as_vllm"] = row.pop("same_text_as_generate")
        row["breakdown"] = breakdowns.get(name, {})
        if decode:
            row["decode"] = decode_figures(result)
        rows.append(row)
    if decode and reference is not None:  # against the best of vLLM alone's runs (a system may run twice)
        best = max(row["decode"]["best_decode_tokens_per_s"] for row in rows if row["system"].split()[0] == "vllm")
        for row in rows:
            row["decode"]["decode_vs_vllm"] = row["decode"]["best_decode_tokens_per_s"] / best if best else 0.0
    return rows


def run_labels(systems: tuple[str, ...]) -> list[str]:
    """Each run's name: the system's, and for its second and later runs in one command `<system> (k)` —
    a system named twice runs twice (`vllm,vllm-kvtier-dram,vllm,vllm-kvtier-dram`: alternated, so a
    drift of the machine shows in both)."""
    seen: dict[str, int] = {}
    labels = []
    for name in systems:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return labels


def render(rows: list[dict]) -> str:
    lines = ["| system | requests | failed | TTFT p50 | TTFT p99 | ITL p50 | tokens/s | wall | prompt tokens | "
             "cached tokens by tier | same text as vLLM alone |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cached = ", ".join(f"{k}: {v:,}" for k, v in r["cached_tokens_by_tier"].items()) or "–"
        same = {None: "–", True: "yes", False: "NO"}[r["same_text_as_vllm"]]
        if r["system"] == "vllm":
            same = "(reference)"
        lines.append(f"| {r['system']} | {r['requests']} | {r['failed']} | {r['ttft_p50_s']:.2f} s | "
                     f"{r['ttft_p99_s']:.2f} s | {r['itl_p50_s'] * 1000:,.0f} ms | {r['tokens_per_s']:.1f} | "
                     f"{r['wall_s']:.0f} s | {r['prompt_tokens']:,} | {cached} | {same} |")
    return "\n".join(lines + ["", render_breakdown(rows), "", render_cpu(rows)])


def render_decode(rows: list[dict]) -> str:
    """`--workload decode`: each system's rounds, best round, and best against vLLM alone's best."""
    lines = ["| system | ITL p50 per round | decode tokens/s per round | best ITL p50 | best decode tokens/s | "
             "vs vLLM alone | same text as vLLM alone |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["decode"]
        same = "(reference)" if r["system"] == "vllm" else {None: "–", True: "yes", False: "NO"}[r["same_text_as_vllm"]]
        ratio = f"{d['decode_vs_vllm']:.3f}" if "decode_vs_vllm" in d else "–"
        lines.append(f"| {r['system']} | {' / '.join(f'{x * 1000:.1f}' for x in d['round_itl_p50_s'])} ms | "
                     f"{' / '.join(f'{x:.1f}' for x in d['round_decode_tokens_per_s'])} | "
                     f"{d['best_itl_p50_s'] * 1000:.1f} ms | {d['best_decode_tokens_per_s']:.1f} | {ratio} | {same} |")
    return "\n".join(lines + ["", render_breakdown(rows), "", render_cpu(rows)])


def render_breakdown(rows: list[dict]) -> str:
    """Where each vLLM system's time went: per request means, and totals over the run."""
    lines = ["| system | queued (mean) | prefill (mean) | decode (mean) | prompt tokens computed | preemptions | "
             "kvtier load | kvtier save copy | kvtier save write | load average |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.get("breakdown")
        if not b:
            continue
        if "producer" in b:  # a disaggregated pair: one row per engine
            lines += [_breakdown_line(f"{r['system']} (consumer)", b),
                      _breakdown_line(f"{r['system']} (producer)", b["producer"])]
        else:
            lines.append(_breakdown_line(r["system"], b))
    return "\n".join(lines)


def render_cpu(rows: list[dict]) -> str:
    """Each vLLM system's CPU seconds over the measured run (`bench.cpu`: every thread of its processes),
    per output token, by process, and the connector's own: kvtier's threads in the worker and its
    scheduler-side hooks (`kvtier:scheduler_seconds`, on the engine core's thread)."""
    lines = ["| system | CPU s | per output token | by process | kvtier threads | kvtier scheduler hooks |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        used = (r.get("breakdown") or {}).get("cpu_s")
        if not used:
            continue
        total = sum(used.values())
        tokens = r["tokens_per_s"] * r["wall_s"]
        processes = ", ".join(f"{name} {seconds:.1f}" for name, seconds in list(cpu.by_process(used).items())[:5])
        kvtier = sum(seconds for name, seconds in used.items() if name.partition("/")[2].startswith("kvtier"))
        hooks = r["breakdown"].get("kvtier_scheduler_seconds", 0.0)
        lines.append(f"| {r['system']} | {total:.1f} | {total / tokens * 1000 if tokens else 0:.1f} ms | "
                     f"{processes} | {kvtier:.2f} s | {hooks:.2f} s |")
    return "\n".join(lines)


def _breakdown_line(label: str, b: dict[str, float]) -> str:
    return (f"| {label} | {b['queue_s_mean']:.2f} s | {b['prefill_s_mean']:.2f} s | "
            f"{b['decode_s_mean']:.2f} s | {b['computed_prompt_tokens']:,.0f} | {b['preemptions']:.0f} | "
            f"{b['kvtier_load_seconds']:.2f} s | {b['kvtier_save_copy_seconds']:.2f} s | "
            f"{b['kvtier_save_write_seconds']:.2f} s | {b['load_avg']:.1f} |")


def add_command(bench) -> None:
    """Register `kvtier bench vllm` on the `bench` typer group."""
    import typer

    @bench.command("vllm")
    def vllm(users: int = typer.Option(8, min=1), turns: int = typer.Option(4, min=1),
             context_chars: int = typer.Option(1200, min=1), turn_chars: int = typer.Option(160, min=1),
             max_tokens: int = typer.Option(24, min=1),
             device_kv_tokens: int = typer.Option(1088, min=32, help="vLLM's device KV budget (blocks of 32)"),
             systems: str = typer.Option(",".join(SYSTEMS), help=", ".join(SYSTEMS) + " (a system named twice "
                                                                                  "runs twice, in that order)"),
             workload: str = typer.Option("chat", help="chat (multi-turn), mooncake (the shared trace) or decode "
                                                       "(--turns rounds of --users fresh prompts, the first a "
                                                       "warm-up: a connector's cost with nothing to load)"),
             reserved_cpus: int = typer.Option(2, min=0, help="--workload decode: VLLM_CPU_NUM_OF_RESERVED_CPU "
                                                              "for every vLLM system (default: a connector's)"),
             trace_requests_: int = typer.Option(32, "--trace-requests", min=1),
             trace_start: int = typer.Option(0, min=0), time_scale: float = typer.Option(1.0),
             json_out: bool = typer.Option(False, "--json"),
             plot_path: str = typer.Option(None, "--plot", help="write a PNG of TTFT and tokens/s per system"),
             timeline_path: str = typer.Option(None, "--timeline", help="write a PNG of each request's timeline "
                                                                          "per system (the JSON has them too)"),
             log_dir: str = typer.Option(None, help="where servers' logs and SSD files go (default: temp)"),
             load: str = typer.Option("layerwise", help="kvtier's load mode: layerwise (in the request's first "
                                                        "forward, layer by layer) or async (before it runs)")) -> None:
        """vLLM alone vs vLLM + kvtier (DRAM, SSD, pool) vs vLLM + ExampleConnector or LMCache vs kvtier serve."""
        from kvtier.bench.harness import plot, plot_timeline, print_rows
        from kvtier.errors import UserError
        from kvtier.integrations.vllm.config import LOAD_MODES

        names = tuple(s.strip() for s in systems.split(","))
        unknown = [n for n in names if n not in SYSTEMS]
        if load not in LOAD_MODES:
            raise UserError(f"unknown --load {load!r}: use {' or '.join(LOAD_MODES)}")
        if unknown or workload not in ("chat", "mooncake", "decode"):
            raise UserError(f"unknown system(s) {unknown} or workload {workload!r}: systems {', '.join(SYSTEMS)}; "
                            "workload chat, mooncake or decode")
        if workload == "decode" and {"kvtier-serve", "vllm-kvtier-disagg"} & set(names):
            raise UserError("--workload decode compares vLLM with and without a connector: not kvtier-serve or "
                            "vllm-kvtier-disagg")
        if workload == "decode" and turns < 2:
            raise UserError("--workload decode: --turns is the number of rounds, the first a warm-up: at least 2")
        rows = run(Workload(users, turns, context_chars, turn_chars, max_tokens), systems=names,
                   device_kv_tokens=device_kv_tokens, trace=workload == "mooncake", trace_requests_=trace_requests_,
                   trace_start=trace_start, time_scale=time_scale, log_dir=log_dir, load=load,
                   decode=workload == "decode", reserved_cpus=reserved_cpus)
        if plot_path:
            plot(rows, plot_path, f"kvtier bench vllm --workload {workload} (SmolLM2 fp32, {device_kv_tokens} "
                                  "device KV tokens, this machine)")
        if timeline_path:
            plot_timeline(rows, timeline_path, f"kvtier bench vllm --workload {workload}: each request's timeline")
        print_rows(rows, json_out, render_decode if workload == "decode" else render)
