"""`kvtier bench serve`: a multi-turn chat workload on one device KV budget, three ways.

Workload (deterministic, built from tinyshakespeare): `num_users` users chat concurrently; user u
has a private opening passage (`context_chars` of the text at its own offset) and `num_turns`
turns; each turn adds a user message (the next `turn_chars` of the text) and resends the whole
conversation so far (the model's chat template), then waits for the greedy reply (`max_tokens`,
EOS ignored) and appends it. The device budget holds the KV of only a few conversations.

Systems, each on the same requests:
- `kvtier`: the engine with the tier stack under it (DRAM, + SSD with `--ssd`): a preempted
  sequence's full blocks come back from the device cache or the tiers, its partial last block is
  recomputed; `kvtier-<codec>` with a quantized device arena;
- `device-prefix`: the same engine with a prefix cache on the device only (a preempted sequence's
  evicted blocks are recomputed: the vLLM-style baseline);
- `generate`: plain transformers `model.generate` with DynamicCache, one request at a time (FIFO).

Reported per system: TTFT p50/p99 (submit to first token, queueing included), inter-token latency
p50/mean, output tokens/s over the run's wall time, requests completed, failures, prefix hit
tokens, preemptions, tokens through the forward (recomputation included), KV bytes loaded back from
the tiers, and whether every reply equals the `generate` reply (greedy must agree).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field


SYSTEM_PROMPT = "You are a helpful assistant who answers questions about the play you are given."


@dataclass(slots=True)
class Workload:
    num_users: int = 6
    num_turns: int = 3
    context_chars: int = 1200
    turn_chars: int = 160
    max_tokens: int = 24


@dataclass(slots=True)
class Turn:
    ttft_s: float
    itl_s: list[float]
    token_ids: list[int]


@dataclass(slots=True)
class SystemResult:
    name: str
    wall_s: float
    turns: dict[tuple[int, int], Turn] = field(default_factory=dict)
    num_failed: int = 0
    first_error: str = ""
    prefix_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    step_tier_io_s: float = 0.0     # the engine step thread's time in tier calls
    transfer_s: float = 0.0         # the transfer worker's time in tier loads and stores
    computed_tokens: int = 0        # tokens through the forward (recomputation included)
    moved_bytes: int = 0            # KV loaded from the tiers onto the device

    def fail(self, exc: BaseException) -> None:
        """Count a failed request; keep the first error's text."""
        self.num_failed += 1
        self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"

    def row(self, reference: "SystemResult | None") -> dict:
        ttfts = sorted(t.ttft_s for t in self.turns.values())
        itls = sorted(x for t in self.turns.values() for x in t.itl_s)
        num_tokens = sum(len(t.token_ids) for t in self.turns.values())
        same = None if reference is None else len(self.turns) == len(reference.turns) and all(
            reference.turns.get(k) is not None and reference.turns[k].token_ids == t.token_ids
            for k, t in self.turns.items())
        return {"system": self.name, "requests": len(self.turns), "failed": self.num_failed,
                "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
                "itl_p50_s": _pct(itls, 50), "itl_mean_s": statistics.fmean(itls) if itls else 0.0,
                "tokens_per_s": num_tokens / self.wall_s, "wall_s": self.wall_s,
                "prompt_tokens": self.num_prompt_tokens,
                "cached_tokens_by_tier": dict(self.prefix_hit_tokens_by_tier),
                "preemptions": self.num_preemptions, "step_tier_io_s": self.step_tier_io_s,
                "transfer_s": self.transfer_s, "computed_tokens": self.computed_tokens,
                "moved_bytes": self.moved_bytes, "same_text_as_generate": same, "first_error": self.first_error}


class TurnClock:
    """One request's TTFT (submit to first token, queueing included) and the gaps after it: `tick()`
    at each token (or chunk) that arrives."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.ttft: float | None = None
        self.itl: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def turn(self, token_ids: list[int]) -> Turn:
        return Turn(self.ttft or 0.0, self.itl, token_ids)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def conversations(text: str, w: Workload) -> list[tuple[str, list[str]]]:
    """(opening passage, user messages) per user; users start far apart in the text."""
    stride = max(len(text) // max(w.num_users, 1), w.context_chars + w.num_turns * w.turn_chars)
    out = []
    for u in range(w.num_users):
        start = (u * stride) % max(1, len(text) - w.context_chars - w.num_turns * w.turn_chars)
        passage = text[start:start + w.context_chars]
        pos = start + w.context_chars
        messages = [f"Continue this: {text[pos + i * w.turn_chars:pos + (i + 1) * w.turn_chars]}"
                    for i in range(w.num_turns)]
        out.append((passage, messages))
    return out


def _prompt(tokenizer, passage: str, user_messages: list[str], replies: list[str]) -> list[int]:
    messages = [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{passage}"}]
    for i, user in enumerate(user_messages):
        messages.append({"role": "user", "content": user})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


# -- the engine systems -----------------------------------------------------------------------------

def engine_system(name: str) -> tuple[bool, str]:
    """(with tiers, resident KV codec) of a system name: "kvtier" (tiers, raw), "kvtier-<codec>" (the
    same with fp8/int8/int4/int2 resident on the device), "device-prefix" (device prefix cache only:
    the vLLM-style baseline)."""
    from kvtier.engine.arena import ARENA_CODECS

    if name == "device-prefix":
        return False, "raw"
    base, _, codec = name.partition("-")
    if base == "kvtier" and (codec or "raw") in ARENA_CODECS:
        return True, codec or "raw"
    raise ValueError(f"unknown system {name!r}: use generate, kvtier, kvtier-<{'|'.join(ARENA_CODECS[1:])}>, "
                     "device-prefix")


@contextlib.contextmanager
def _engine_system(loaded, name: str, *, budget_bytes: int, block_tokens: int, tier_specs: list[str],
                   kv_codec: str = "raw", max_num_seqs: int = 32):
    """A started AsyncEngine (+ its tier stack) and the SystemResult it fills; stats on exit."""
    from kvtier.codecs import get_codec
    from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
    from kvtier.tiers.manager import build_manager

    layout = loaded.kv_layout(block_tokens)
    manager = build_manager(tier_specs, slot_bytes=get_codec("raw").max_encoded_bytes(layout)) if tier_specs else None
    engine = LLMEngine(loaded, EngineConfig(device_kv_budget_bytes=budget_bytes, block_tokens=block_tokens,
                                            max_prefill_tokens=512,
                                            kv_codec=kv_codec, max_num_seqs=max_num_seqs), manager)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    result = SystemResult(name, 0.0)
    start = time.perf_counter()
    try:
        yield async_engine, result
    finally:
        result.wall_s = time.perf_counter() - start
        async_engine.shutdown()
        stats = engine.stats()
        result.prefix_hit_tokens_by_tier = stats.prefix_hit_tokens_by_tier
        result.num_preemptions = stats.num_preemptions
        result.step_tier_io_s = stats.step_tier_io_seconds
        result.transfer_s = stats.transfer_load_seconds + stats.transfer_store_seconds
        result.computed_tokens = stats.num_tokens_computed
        result.moved_bytes = stats.num_blocks_loaded_from_tiers * layout.block_bytes
        if manager is not None:
            manager.close()


async def _request(async_engine, result: SystemResult, key, ids: list[int], sampling) -> list[int] | None:
    """One request through the engine: its TTFT and inter-token gaps into `result`; None on failure."""
    result.num_prompt_tokens += len(ids)
    clock, tokens = TurnClock(), []
    try:
        async for out in async_engine.generate(f"r{key}", ids, sampling):
            clock.tick()
            tokens += out.new_token_ids
    except Exception as exc:  # noqa: BLE001 — counted, the others go on
        result.fail(exc)
        return None
    result.turns[key] = clock.turn(tokens)
    return tokens


def run_engine(loaded, convs, w: Workload, *, name: str, budget_bytes: int, block_tokens: int,
               tier_specs: list[str], kv_codec: str = "raw") -> SystemResult:
    from kvtier.engine import SamplingParams

    sampling = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
    # at most one request per user runs at a time: max_num_seqs = users (KIVI reserves an open block each)
    with _engine_system(loaded, name, budget_bytes=budget_bytes, block_tokens=block_tokens,
                        tier_specs=tier_specs, kv_codec=kv_codec, max_num_seqs=w.num_users) as (async_engine, result):
        async def user(u: int, passage: str, user_messages: list[str]) -> None:
            replies: list[str] = []
            for turn in range(len(user_messages)):
                ids = _prompt(loaded.tokenizer, passage, user_messages[:turn + 1], replies)
                tokens = await _request(async_engine, result, (u, turn), ids, sampling)
                if tokens is None:
                    return
                replies.append(loaded.tokenizer.decode(tokens, skip_special_tokens=True))

        async def main() -> None:
            await asyncio.gather(*(user(u, p, m) for u, (p, m) in enumerate(convs)))

        asyncio.run(main())
    return result


# -- the Mooncake trace, scaled to this model ---------------------------------------------------------

@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    token_ids: list[int]
    max_tokens: int


def trace_requests(path, *, num_requests: int = 32, block_tokens: int = 16, max_tokens: int = 8,
                   time_scale: float = 1.0, vocab_size: int = 49152, max_context: int = 8192,
                   start: int = 0) -> list[TraceRequest]:
    """`num_requests` of a Mooncake trace from request `start` on (arrivals relative to the first of
    them), scaled to a small model: each 512-token block
    (`hash_ids`) becomes `block_tokens` tokens — fixed per block id, so requests that share block ids
    share exactly those token prefixes, as in the trace — the partial last block in proportion,
    outputs capped at `max_tokens`, arrivals at `timestamp × time_scale`, prompts cut to the context."""
    import torch

    from kvtier.sim.trace import BLOCK_TOKENS, read_trace

    out = []
    selected = read_trace(path)[start:start + num_requests]
    t0_ms = selected[0].timestamp_ms if selected else 0.0
    for r in selected:
        ids: list[int] = []
        for i, block_id in enumerate(r.hash_ids):
            n = max(1, round(r.block_tokens(i) * block_tokens / BLOCK_TOKENS))
            g = torch.Generator().manual_seed(block_id)
            ids += torch.randint(0, vocab_size, (block_tokens,), generator=g)[:n].tolist()
        ids = ids[:max_context - max_tokens - 1] or [0]
        out.append(TraceRequest((r.timestamp_ms - t0_ms) / 1000 * time_scale, ids,
                                max(1, min(r.output_length, max_tokens))))
    return out


def run_engine_trace(loaded, reqs: list[TraceRequest], *, name: str, budget_bytes: int, block_tokens: int,
                     tier_specs: list[str], kv_codec: str = "raw") -> SystemResult:
    from kvtier.engine import SamplingParams

    with _engine_system(loaded, name, budget_bytes=budget_bytes, block_tokens=block_tokens,
                        tier_specs=tier_specs, kv_codec=kv_codec) as (async_engine, result):
        async def one(i: int, r: TraceRequest, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            await _request(async_engine, result, (i, 0), r.token_ids,
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))

        async def main() -> None:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, r, t0) for i, r in enumerate(reqs)))

        asyncio.run(main())
    return result


# -- plain generate -----------------------------------------------------------------------------------

class _Streamer:
    """A transformers streamer that timestamps every generated token (the prompt comes first)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_generate(loaded, convs, w: Workload) -> SystemResult:
    """One worker serves the users' turns FIFO with `model.generate`; users still submit concurrently."""
    import torch

    result = SystemResult("generate", 0.0)
    lock = threading.Lock()

    def user(u: int, passage: str, user_messages: list[str]) -> None:
        replies: list[str] = []
        for turn in range(len(user_messages)):
            ids = _prompt(loaded.tokenizer, passage, user_messages[:turn + 1], replies)
            result.num_prompt_tokens += len(ids)
            start = time.perf_counter()
            streamer = _Streamer()
            with lock, torch.inference_mode():
                out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=w.max_tokens, min_new_tokens=w.max_tokens,
                                            do_sample=False, streamer=streamer)
            tokens = out[0, len(ids):].tolist()
            times = streamer.times
            result.turns[(u, turn)] = Turn(times[0] - start, [b - a for a, b in zip(times, times[1:])], tokens)
            replies.append(loaded.tokenizer.decode(tokens, skip_special_tokens=True))

    threads = [threading.Thread(target=user, args=(u, p, m)) for u, (p, m) in enumerate(convs)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    return result


def run_generate_trace(loaded, reqs: list[TraceRequest]) -> SystemResult:
    """Plain `generate`, one request at a time in arrival order (TTFT counts the wait from arrival)."""
    import torch

    result = SystemResult("generate", 0.0)
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        time.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        arrived = t0 + r.arrival_s
        result.num_prompt_tokens += len(r.token_ids)
        streamer = _Streamer()
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([r.token_ids]), max_new_tokens=r.max_tokens,
                                        min_new_tokens=r.max_tokens, do_sample=False, streamer=streamer)
        times = streamer.times
        result.turns[(i, 0)] = Turn(times[0] - arrived, [b - a for a, b in zip(times, times[1:])],
                                    out[0, len(r.token_ids):].tolist())
    result.wall_s = time.perf_counter() - t0
    return result


def run_trace(*, model: str = "smollm2", num_requests: int = 32, trace_start: int = 0, trace_block_tokens: int = 16,
              max_tokens: int = 8, time_scale: float = 1.0, device_kv_budget: str = "48MiB",
              block_tokens: int = 16, dram: str = "1GiB",
              systems: tuple[str, ...] = ("generate", "kvtier", "device-prefix")) -> list[dict]:
    """The Mooncake sample trace, scaled (see `trace_requests`), through the same three systems."""
    from kvtier import models
    from kvtier.data import MOONCAKE_TRACE, shared_data_file
    from kvtier.units import parse_bytes

    loaded = models.load(model)
    reqs = trace_requests(shared_data_file(MOONCAKE_TRACE), num_requests=num_requests,
                          block_tokens=trace_block_tokens, max_tokens=max_tokens, time_scale=time_scale,
                          start=trace_start,
                          vocab_size=loaded.config.vocab_size,
                          max_context=getattr(loaded.config, "max_position_embeddings", 8192))
    budget = parse_bytes(device_kv_budget)
    results: dict[str, SystemResult] = {}
    for name in systems:
        if name == "generate":
            results[name] = run_generate_trace(loaded, reqs)
        else:
            tiered, kv_codec = engine_system(name)
            results[name] = run_engine_trace(
                loaded, reqs, name=name, budget_bytes=budget, block_tokens=block_tokens,
                tier_specs=[f"dram:{dram}"] if tiered else [], kv_codec=kv_codec)
    reference = results.get("generate")
    return [r.row(reference if r is not reference else None) for r in results.values()]


def run(workload: Workload | None = None, *, model: str = "smollm2", device_kv_budget: str = "48MiB",
        block_tokens: int = 64, dram: str = "1GiB", ssd: bool = False,
        systems: tuple[str, ...] = ("generate", "kvtier", "device-prefix")) -> list[dict]:
    from kvtier import models
    from kvtier.data import SHAKESPEARE, shared_data_file
    from kvtier.units import parse_bytes

    w = workload or Workload()
    loaded = models.load(model)
    if loaded.tokenizer is None:  # the tiny random models
        from kvtier.server.tokenizer import ByteTokenizer

        loaded.tokenizer = ByteTokenizer()
    convs = conversations(shared_data_file(SHAKESPEARE).read_text(), w)
    budget = parse_bytes(device_kv_budget)
    results: dict[str, SystemResult] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tiers = [f"dram:{dram}"] + ([f"ssd:{tmp}:8GiB"] if ssd else [])
        for name in systems:
            if name == "generate":
                results[name] = run_generate(loaded, convs, w)
            else:
                tiered, kv_codec = engine_system(name)
                results[name] = run_engine(loaded, convs, w, name=name, budget_bytes=budget,
                                           block_tokens=block_tokens, tier_specs=tiers if tiered else [],
                                           kv_codec=kv_codec)
    reference = results.get("generate")
    return [r.row(reference if r is not reference else None) for r in results.values()]


def add_command(bench) -> None:
    """Register `kvtier bench serve` on the `bench` typer group."""
    import typer

    @bench.command("serve")
    def serve(users: int = typer.Option(6, min=1), turns: int = typer.Option(3, min=1),
              context_chars: int = typer.Option(1200, min=1), turn_chars: int = typer.Option(160, min=1),
              max_tokens: int = typer.Option(24, min=1), device_kv_budget: str = typer.Option("48MiB"),
              block_tokens: int = typer.Option(64, min=1), dram: str = typer.Option("1GiB"),
              ssd: bool = typer.Option(False, help="an SSD tier under DRAM (a temporary directory)"),
              systems: str = typer.Option("generate,kvtier,device-prefix",
                                          help="generate, kvtier, kvtier-fp8/int8/int4/int2 (quantized "
                                               "resident KV), device-prefix"),
              model: str = typer.Option("smollm2"), json_out: bool = typer.Option(False, "--json"),
              workload: str = typer.Option("chat", help="chat (multi-turn tinyshakespeare) or mooncake "
                                                        "(the shared Mooncake trace, scaled to the model)"),
              trace_requests_: int = typer.Option(32, "--trace-requests", min=1, help="mooncake: N requests"),
              trace_start: int = typer.Option(0, min=0, help="mooncake: the first request replayed (its index)"),
              trace_block_tokens: int = typer.Option(16, min=1, help="mooncake: tokens per 512-token trace block"),
              time_scale: float = typer.Option(1.0, help="mooncake: arrival time = trace timestamp x this"),
              plot_path: str = typer.Option(None, "--plot", help="write a PNG of TTFT and tokens/s per system")) -> None:
        """Multi-turn chat (or the Mooncake trace): kvtier with tiers vs device-only prefix cache +
        recompute vs plain generate."""
        from kvtier.errors import UserError

        names = tuple(s.strip() for s in systems.split(","))
        for name in names:  # refuse a typo before any system has run
            if name != "generate":
                try:
                    engine_system(name)
                except ValueError as exc:
                    raise UserError(str(exc)) from None
        if workload == "chat":
            rows = run(Workload(users, turns, context_chars, turn_chars, max_tokens), model=model,
                       device_kv_budget=device_kv_budget, block_tokens=block_tokens, dram=dram, ssd=ssd,
                       systems=names)
        elif workload == "mooncake":
            rows = run_trace(model=model, num_requests=trace_requests_, trace_start=trace_start,
                             trace_block_tokens=trace_block_tokens,
                             max_tokens=max_tokens, time_scale=time_scale, device_kv_budget=device_kv_budget,
                             block_tokens=block_tokens, dram=dram, systems=names)
        else:
            raise UserError(f"unknown workload {workload!r}: use chat or mooncake")
        if plot_path:
            plot(rows, plot_path, f"kvtier bench serve --workload {workload} (SmolLM2 on this machine)"
                 if model == "smollm2" else f"kvtier bench serve --workload {workload} --model {model}")
        print_rows(rows, json_out)


def print_rows(rows: list[dict], as_json: bool, table=None) -> None:
    """The rows as JSON, or as a markdown table (`table(rows)`, default `render`) with each system's
    first failure under it."""
    import json

    if as_json:
        print(json.dumps(rows))
        return
    print((table or render)(rows))
    for r in rows:
        if r["first_error"]:
            print(f"{r['system']}: first failure: {r['first_error']}")


def render(rows: list[dict]) -> str:
    lines = ["| system | requests | failed | TTFT p50 | TTFT p99 | ITL p50 | ITL mean | tokens/s | wall | "
             "prompt tokens | cached tokens by tier | preemptions | computed tokens | KV loaded | "
             "step-thread tier I/O | transfer worker | same text as generate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cached = ", ".join(f"{k}: {v}" for k, v in r["cached_tokens_by_tier"].items()) or "–"
        same = {None: "(reference)", True: "yes", False: "NO"}[r["same_text_as_generate"]]
        lines.append(f"| {r['system']} | {r['requests']} | {r['failed']} | {r['ttft_p50_s'] * 1000:,.0f} ms | "
                     f"{r['ttft_p99_s'] * 1000:,.0f} ms | {r['itl_p50_s'] * 1000:,.0f} ms | "
                     f"{r['itl_mean_s'] * 1000:,.0f} ms | {r['tokens_per_s']:.1f} | {r['wall_s']:.1f} s | "
                     f"{r['prompt_tokens']:,} | {cached} | {r['preemptions']} | "
                     f"{r.get('computed_tokens', 0):,} | {r.get('moved_bytes', 0) / 1e6:,.1f} MB | "
                     f"{r.get('step_tier_io_s', 0.0):.2f} s | {r.get('transfer_s', 0.0):.2f} s | {same} |")
    return "\n".join(lines)


def plot(rows: list[dict], path, title: str) -> None:
    """Two panels per system: TTFT p50 / p99 (s) and tokens/s (failed requests marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["system"] for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(x - 0.2, [r["ttft_p50_s"] for r in rows], 0.4, label="TTFT p50")
    ax1.bar(x + 0.2, [r["ttft_p99_s"] for r in rows], 0.4, label="TTFT p99")
    ax1.set_ylabel("seconds")
    ax1.legend()
    colors = ["#999" if n == "generate" else ("#2a7" if n.startswith("kvtier") else "#c84") for n in names]
    ax2.bar(x, [r["tokens_per_s"] for r in rows], color=colors)
    ax2.set_ylabel("generated tokens / s")
    for i, r in enumerate(rows):
        note = f"{r['tokens_per_s']:.1f}" + (f"\n{r['failed']} failed" if r["failed"] else "")
        ax2.text(i, r["tokens_per_s"], note, ha="center", va="bottom", fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=15, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import typer

    _app = typer.Typer(add_completion=False)
    add_command(_app)
    _app()
