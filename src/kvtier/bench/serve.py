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
import tempfile
import threading
import time

from kvtier.bench.harness import (SystemResult, TraceRequest, Turn, TurnClock, Workload, chat_prompt, conversations,
                                  plot, print_rows, trace_requests)

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
    result.turns[key] = clock.turn(tokens, result.t0)
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
                ids = chat_prompt(loaded.tokenizer, passage, user_messages[:turn + 1], replies)
                tokens = await _request(async_engine, result, (u, turn), ids, sampling)
                if tokens is None:
                    return
                replies.append(loaded.tokenizer.decode(tokens, skip_special_tokens=True))

        async def main() -> None:
            await asyncio.gather(*(user(u, p, m) for u, (p, m) in enumerate(convs)))

        asyncio.run(main())
    return result


# -- the engine on the Mooncake trace -----------------------------------------------------------------

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
            ids = chat_prompt(loaded.tokenizer, passage, user_messages[:turn + 1], replies)
            result.num_prompt_tokens += len(ids)
            start = time.perf_counter()
            streamer = _Streamer()
            with lock, torch.inference_mode():
                out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=w.max_tokens, min_new_tokens=w.max_tokens,
                                            do_sample=False, streamer=streamer)
            tokens = out[0, len(ids):].tolist()
            times = streamer.times
            result.turns[(u, turn)] = Turn(times[0] - start, [b - a for a, b in zip(times, times[1:])], tokens,
                                           start - result.t0)
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
                                    out[0, len(r.token_ids):].tolist(), arrived - result.t0)
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


if __name__ == "__main__":
    import typer

    _app = typer.Typer(add_completion=False)
    add_command(_app)
    _app()
