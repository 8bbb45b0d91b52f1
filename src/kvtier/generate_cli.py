"""`kvtier generate`: one generation on a real model through `TieredCache`, with per-tier hits.

Run it twice on the same `--ssd-dir` as two processes: the second run finds the prompt's full
blocks on SSD (or in the pool), skips that part of the prefill, and prints the same text.
`--kv-offload exact|sparse:1/8` keeps each layer's middle blocks in host memory (`TieredCache`'s
block windows); with `--device-kv-budget` too, the serving engine runs it on that device budget.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import typer

from kvtier.blocks import DEFAULT_BLOCK_TOKENS
from kvtier.config import command_settings
from kvtier.errors import UserError
from kvtier.offload.config import DEFAULT_RECENT_BLOCKS, DEFAULT_SINK_BLOCKS
from kvtier.tiers.spec import TierSpec, parse_specs

DEFAULT_TIERS = "dram,ssd"


@dataclass(slots=True)
class GenerateResult:
    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    decode_tokens_per_s: float
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    stored_blocks: int = 0
    tier_stats: dict[str, dict] = field(default_factory=dict)
    offload: dict | None = None  # --kv-offload: what the long context cost (kvtier/offload/ OffloadStats)
    # where the TTFT went: restore_s (load_prefix: the tiers' reads, verify, copies into the cache, and the
    # promotion of blocks read from below into the top tier, in tier_write_s) + prefill_s (the forward of the
    # uncached tokens and the first token's sampling); tier_read_s / tier_write_s by tier, within restore_s
    ttft_breakdown: dict = field(default_factory=dict)
    warmup_s: float = 0.0  # the process's first forward, before the request's clock (as a server warms up)


def tier_specs(tiers: str, *, ssd_dir: str | None, pool_url: str | None,
               dram_bytes: str = "1GiB", ssd_bytes: str = "20GiB") -> list[TierSpec]:
    """`dram,ssd,mooncake` + paths/URLs -> the manager's tier specs, top tier first (pools between DRAM and SSD)."""
    from kvtier.models import cache_dir

    specs = []
    for name in [t.strip() for t in tiers.split(",") if t.strip()]:
        if name == "dram":
            specs.append(f"dram:{dram_bytes}")
        elif name == "ssd":
            specs.append(f"ssd:{ssd_dir or cache_dir() / 'ssd'}:{ssd_bytes}")
        elif name in ("mooncake", "redis"):
            if not pool_url:
                raise UserError(f"the {name} tier needs --pool-url")
            specs.append(pool_url if pool_url.startswith(f"{name}:") else f"{name}://{pool_url.removeprefix('//')}")
        else:
            raise UserError(f"unknown tier {name!r}: use dram, ssd, mooncake, redis")
    order = {"dram": 0, "mooncake": 1, "redis": 1, "ssd": 2}
    return sorted(parse_specs(specs), key=lambda spec: order[spec.kind])


def warm_up(loaded, num_tokens: int = 8) -> float:
    """One small forward before any request is timed: a fresh process's first forward pays one-off costs
    (torch's and the model's lazy initialisation) that are not the request's, as a server pays them at start.
    Returns its seconds."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        loaded.model(torch.zeros((1, num_tokens), dtype=torch.long, device=loaded.model.device))
    return time.perf_counter() - start


def _tier_seconds(manager) -> dict[str, tuple[float, float]]:
    return {name: (stats.read_seconds, stats.write_seconds) for name, stats in manager.stats().items()}


class _FirstTokenTimer:
    """A transformers streamer that records when the first new token arrives."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2 and self.first_token_at is None:  # put #1 is the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_generate(loaded, manager, prompt_ids, *, max_new_tokens: int, codec: str = "raw",
                 block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 kv_codec: str = "raw", kv_offload: str | None = None,
                 offload_sink_blocks: int = DEFAULT_SINK_BLOCKS, offload_recent_blocks: int = DEFAULT_RECENT_BLOCKS,
                 offload_page_tokens: int | None = None) -> GenerateResult:
    """Prefix lookup, prefill of the rest, greedy decode, store of new blocks."""
    import torch

    from kvtier.hf import TieredCache

    device = loaded.model.device
    ids = torch.tensor([prompt_ids], device=device)
    tier_before = _tier_seconds(manager) if manager is not None else {}
    start = time.perf_counter()
    cache = TieredCache.for_model(loaded, manager, codec=codec, block_tokens=block_tokens, resident_codec=kv_codec,
                                  kv_offload=kv_offload, offload_sink_blocks=offload_sink_blocks,
                                  offload_recent_blocks=offload_recent_blocks,
                                  **({"offload_page_tokens": offload_page_tokens} if offload_page_tokens else {}))
    cached = cache.load_prefix(ids, reserve_tokens=max_new_tokens)
    restored = time.perf_counter()
    tier_after = _tier_seconds(manager) if manager is not None else {}
    timer = _FirstTokenTimer()
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                    max_new_tokens=max_new_tokens, do_sample=False, streamer=timer,
                                    pad_token_id=getattr(loaded.tokenizer, "eos_token_id", None))
    end = time.perf_counter()
    new_ids = out[0, ids.shape[1]:].tolist()
    stored = cache.store(out[0])
    first = timer.first_token_at or end
    text = loaded.tokenizer.decode(new_ids, skip_special_tokens=True) if loaded.tokenizer else str(new_ids)
    return GenerateResult(
        text=text, ttft_s=first - start, total_s=end - start, prompt_tokens=len(prompt_ids),
        cached_tokens=cached, new_tokens=len(new_ids),
        decode_tokens_per_s=(len(new_ids) - 1) / (end - first) if len(new_ids) > 1 and end > first else 0.0,
        hit_tokens_by_tier=dict(cache.prefix.hit_tokens_by_tier), stored_blocks=stored,
        offload=cache.offload_stats.to_dict() if cache.offload is not None else None,
        ttft_breakdown={
            "restore_s": restored - start, "prefill_s": first - restored,
            "tier_read_s": {name: tier_after[name][0] - read for name, (read, _) in tier_before.items()},
            "tier_write_s": {name: tier_after[name][1] - write for name, (_, write) in tier_before.items()}})


def run_engine_generate(loaded, manager, prompt_ids, *, max_new_tokens: int, config) -> GenerateResult:
    """`--kv-offload` with `--device-kv-budget`: the same greedy generation through the serving engine
    (`LLMEngine`), whose device budget may be smaller than the request: its middle blocks live in the DRAM tier."""
    from kvtier.engine import LLMEngine, SamplingParams

    engine = LLMEngine(loaded, config, manager)
    start = time.perf_counter()
    engine.add_request("generate", list(prompt_ids), SamplingParams(max_tokens=max_new_tokens))
    new_ids, first, last = [], None, None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                new_ids += out.new_token_ids
                first = first or time.perf_counter()
                last = out
        engine.wait_for_transfers()
    finally:
        engine.close()
    end = time.perf_counter()
    first = first or end
    text = loaded.tokenizer.decode(new_ids, skip_special_tokens=True) if loaded.tokenizer else str(new_ids)
    return GenerateResult(
        text=text, ttft_s=first - start, total_s=end - start, prompt_tokens=len(prompt_ids),
        cached_tokens=last.num_cached_tokens if last else 0, new_tokens=len(new_ids),
        decode_tokens_per_s=(len(new_ids) - 1) / (end - first) if len(new_ids) > 1 and end > first else 0.0,
        hit_tokens_by_tier=dict(last.cached_tokens_by_tier) if last else {},
        stored_blocks=engine.stats().num_blocks_written_to_tiers,
        offload=last.offload.to_dict() if last is not None and last.offload is not None else None)


def _print_result(result: GenerateResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{result.text}[/bold]")
    table = Table(title="kvtier generate")
    for col in ("prompt tokens", "cached tokens", "hits by tier", "TTFT", "decode tok/s", "stored blocks"):
        table.add_column(col)
    hits = ", ".join(f"{k}: {v}" for k, v in result.hit_tokens_by_tier.items()) or "-"
    table.add_row(str(result.prompt_tokens), str(result.cached_tokens), hits, f"{result.ttft_s * 1000:.1f} ms",
                  f"{result.decode_tokens_per_s:.1f}", str(result.stored_blocks))
    console.print(table)
    b = result.ttft_breakdown
    if b:
        reads = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in b["tier_read_s"].items() if v)
        writes = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in b["tier_write_s"].items() if v)
        console.print(f"TTFT = restore {b['restore_s'] * 1000:.0f} ms (tier reads: {reads or '-'}; promotion writes: "
                      f"{writes or '-'}) + prefill {b['prefill_s'] * 1000:.0f} ms; the process's first forward "
                      f"({result.warmup_s * 1000:.0f} ms) ran before the clock")
    if result.offload:
        o = result.offload
        console.print(f"offload {o['mode']}: peak device KV {o['peak_device_kv_bytes']:,} B, host KV "
                      f"{o['host_kv_bytes']:,} B, fetched {o['fetched_bytes_per_decode_token']:,.0f} B per decode token")


def _shared_settings():
    """The options `kvtier generate` shares with `kvtier serve`: the same fields, names, defaults and help."""
    from kvtier.config import pick
    from kvtier.server.config import ServeConfig

    return pick(ServeConfig.settings(), "model", "codec", "kv_codec", "block_tokens", "kv_offload",
                "offload_sink_blocks", "offload_recent_blocks", "offload_fetch_blocks", "offload_page_tokens")


def register(app: typer.Typer) -> None:
    @app.command()
    @command_settings(*_shared_settings(), layered=False)
    def generate(
        prompt: str = typer.Option(None, help="prompt text"),
        prompt_file: Path = typer.Option(None, help="read the prompt from this file"),
        max_new_tokens: int = typer.Option(32, min=1),
        tiers: str = typer.Option(DEFAULT_TIERS, help="comma list of dram, ssd, mooncake, redis"),
        ssd_dir: str = typer.Option(None, help="SSD tier directory (default: <cache dir>/ssd)"),
        pool_url: str = typer.Option(None, help="mooncake master host:port or redis://host:port/db"),
        device_kv_budget: str = typer.Option(None, help="with --kv-offload: run through the serving engine on this "
                                                        "device KV budget, e.g. 256MiB (without it: TieredCache, "
                                                        "whose device window is the sink + recent blocks)"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
        *, settings: dict,
    ) -> None:
        """Generate with TieredCache: prefix hits from DRAM / pool / SSD, per-tier statistics. With
        --kv-offload, each layer keeps its sink + recent blocks on the device and the middle ones in
        host memory; with --device-kv-budget too, through the serving engine on that budget."""
        from kvtier import models
        from kvtier.codecs import get_codec
        from kvtier.config import EngineConfig, from_settings
        from kvtier.tiers.manager import build_manager
        from kvtier.units import parse_bytes

        if (prompt is None) == (prompt_file is None):
            raise UserError("give exactly one of --prompt or --prompt-file")
        model = settings.pop("model")
        shared = from_settings(EngineConfig, settings, what="generate")  # checked as `kvtier serve` checks them
        budget = parse_bytes(device_kv_budget) if device_kv_budget else None
        if budget is not None and shared.offload_mode() is None:
            raise UserError("--device-kv-budget runs the serving engine and needs --kv-offload exact|sparse:BUDGET "
                            "(--kv-offload alone offloads through TieredCache)")
        text = prompt if prompt is not None else prompt_file.read_text()
        loaded = models.load(model)
        if loaded.tokenizer is None:
            raise UserError(f"model {model!r} has no tokenizer; generate needs one")
        warmup_s = warm_up(loaded)
        layout = loaded.kv_layout(shared.block_tokens)
        manager = build_manager(tier_specs(tiers, ssd_dir=ssd_dir, pool_url=pool_url),
                                slot_bytes=get_codec(shared.codec).max_encoded_bytes(layout))
        prompt_ids = loaded.tokenizer(text).input_ids
        try:
            if budget is not None:
                config = replace(shared, device_kv_budget_bytes=budget)
                result = run_engine_generate(loaded, manager, prompt_ids, max_new_tokens=max_new_tokens, config=config)
            else:
                result = run_generate(loaded, manager, prompt_ids, max_new_tokens=max_new_tokens, codec=shared.codec,
                                      block_tokens=shared.block_tokens, kv_codec=shared.kv_codec,
                                      kv_offload=shared.kv_offload, offload_sink_blocks=shared.offload_sink_blocks,
                                      offload_recent_blocks=shared.offload_recent_blocks,
                                      offload_page_tokens=shared.offload_page_tokens)
            manager.flush()
            result.warmup_s = warmup_s
            result.tier_stats = {name: asdict(stats) for name, stats in manager.stats().items()}
        finally:
            manager.close()
        if json_out:
            json.dump(asdict(result), sys.stdout)
            sys.stdout.write("\n")
        else:
            _print_result(result)
