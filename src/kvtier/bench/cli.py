"""`kvtier bench` subcommands."""

from __future__ import annotations

import os
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="benchmarks; runs land in docs/benchmarks/<topic>.md, the latest figures in "
                             "docs/BENCHMARKS.md", no_args_is_help=True)
    app.add_typer(bench, name="bench")

    @bench.command("prefix")
    def prefix(prefix_tokens: int = typer.Option(4096, min=2),
               tiers: str = typer.Option("dram,ssd,mooncake,redis", help="comma list of dram, ssd, mooncake, redis"),
               repeats: int = typer.Option(3, min=1),
               ssd_dir: str = typer.Option(None, help="where the SSD tier's files go (default: the temp dir)"),
               mooncake_url: str = typer.Option(None, help="an existing pool (default: start one on 127.0.0.1)"),
               redis_url: str = typer.Option(None, help="an existing redis (default: start one on 127.0.0.1)"),
               plot_path: Path = typer.Option(None, "--plot", help="write a PNG of TTFT and bandwidth"),
               as_json: bool = typer.Option(False, "--json", help="one JSON object per source on stdout"),
               model: str = typer.Option("smollm2", help="smollm2, tiny (tests) or a local HF directory"),
               block_tokens: int = typer.Option(256, min=1)) -> None:
        """TTFT of a request whose prefix is cached, per tier, vs recomputing the prefill; restore
        bandwidth vs the raw medium (SmolLM2, one run)."""
        import json

        from rich.console import Console
        from rich.table import Table

        from kvtier.bench.prefix import plot, run
        from kvtier.errors import UserError

        names = tuple(t.strip() for t in tiers.split(",") if t.strip())
        unknown = set(names) - {"dram", "ssd", "mooncake", "redis"}
        if unknown:
            raise UserError(f"unknown tier(s) {', '.join(sorted(unknown))}: use dram, ssd, mooncake, redis")
        urls = {k: v for k, v in (("mooncake", mooncake_url), ("redis", redis_url)) if v}
        console = Console(stderr=as_json)
        rows = run(prefix_tokens, names, repeats, block_tokens, ssd_dir=ssd_dir, pool_urls=urls,
                   progress=lambda msg: console.log(msg), model=model)
        if as_json:
            print(json.dumps([r.to_dict() for r in rows], indent=1))
        title = (f"TTFT with a cached {prefix_tokens}-token prefix (SmolLM2-135M, fp32 KV, raw codec, median "
                 f"(best) of {repeats}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
        table = Table(title=title)
        for col in ("source", "cached tokens", "TTFT", "vs recompute", "restore GB/s", "raw medium GB/s",
                    "restore / raw", "engine arena GB/s", "arena / raw", "target"):
            table.add_column(col)
        for r in rows:
            target = r.target_fraction
            table.add_row(r.tier, str(r.cached_tokens), f"{r.ttft_s * 1000:.1f} ({r.ttft_best_s * 1000:.1f}) ms",
                          f"{r.speedup:.1f}x ({r.speedup_best:.1f}x)",
                          f"{r.restore_gb_s:.2f}" if r.restore_gb_s else "-",
                          (f"{r.raw_gb_s:.2f}" + (f" ({r.copy_threads} threads)" if r.copy_threads > 1 else ""))
                          if r.raw_gb_s else "-",
                          f"{r.restore_fraction:.0%}" if r.raw_gb_s else "-",
                          f"{r.arena_gb_s:.2f}" if r.arena_gb_s else "-",
                          f"{r.arena_fraction:.0%}" if r.raw_gb_s else "-",
                          "-" if target is None else f">={target:.0%}: hf {_met(r.restore_fraction, target)}, "
                                                    f"arena {_met(r.arena_fraction, target)}")
        console.print(table)
        if plot_path:
            plot(rows, plot_path, title)
            console.print(f"plot written to {plot_path}")

    from kvtier.bench.serve import add_command as add_serve_command

    add_serve_command(bench)

    from kvtier.bench.vllm import add_command as add_vllm_command

    add_vllm_command(bench)

    from kvtier.bench.long import add_command as add_long_command

    add_long_command(bench)

    from kvtier.bench.route import add_command as add_route_command

    add_route_command(bench)


def _met(fraction: float, target: float) -> str:
    return "met" if fraction >= target else "NOT met"
