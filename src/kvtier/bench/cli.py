"""`kvtier bench` subcommands."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="benchmarks; figures land in docs/BENCHMARKS.md", no_args_is_help=True)
    app.add_typer(bench, name="bench")

    @bench.command("prefix")
    def prefix(prefix_tokens: int = typer.Option(4096), tiers: str = typer.Option("dram,ssd"),
               repeats: int = typer.Option(3, min=1)) -> None:
        """TTFT of a request whose prefix is cached, per tier, against recomputing the prefill (SmolLM2)."""
        from rich.console import Console
        from rich.table import Table

        from kvtier.bench.prefix import run

        rows = run(prefix_tokens, tuple(t.strip() for t in tiers.split(",")), repeats)
        table = Table(title=f"TTFT with a cached {prefix_tokens}-token prefix (SmolLM2-135M, fp32 KV, median of {repeats})")
        for col in ("source", "cached tokens", "TTFT", "speed-up vs recompute", "restore GB/s (load_prefix)"):
            table.add_column(col)
        for r in rows:
            table.add_row(r.tier, str(r.cached_tokens), f"{r.ttft_s * 1000:.1f} ms", f"{r.speedup:.1f}x",
                          f"{r.restore_gb_s:.2f}" if r.restore_gb_s else "-")
        Console().print(table)
