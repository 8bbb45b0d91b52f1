"""`kvtier simulate`: how much HBM, DRAM, pool and SSD buys how much prefix-hit rate, for a trace."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

from kvtier.errors import UserError

if TYPE_CHECKING:
    from kvtier.sim.cluster import ClusterConfig
    from kvtier.sim.trace import Request


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_command(
        trace: str = typer.Argument(..., help="Mooncake-format JSONL trace (timestamp, input_length, "
                                              "output_length, hash_ids of 512-token blocks)"),
        model: str = typer.Option("llama-3.1-8b", help="model from the plan catalog (KV bytes and FLOPs per token)"),
        gpu: str = typer.Option("h100", help="accelerator from the plan catalog (HBM, FLOP/s)"),
        nodes: int = typer.Option(1, help="prefill nodes"),
        gpus_per_node: int = typer.Option(8, help="GPUs per node, serving the model as one TP group"),
        hbm_kv_tokens: str = typer.Option("auto", help="KV tokens of HBM per node, e.g. 2M; auto: what "
                                                       "`kvtier plan` leaves for KV"),
        dram_tokens: str = typer.Option("0", help="host DRAM cache per node, in tokens (e.g. 8M)"),
        pool_tokens: str = typer.Option("0", help="pooled cache shared by all nodes, in tokens"),
        ssd_tokens: str = typer.Option("0", help="SSD cache per node, in tokens"),
        router: str = typer.Option("round-robin", help="round-robin, least-loaded, best-prefix "
                                                       "(= best-prefix-match), cache-aware (SGLang's router) "
                                                       "or dynamo"),
        write_policy: str = typer.Option("through", help="through (new blocks go to every tier) or back "
                                                        "(evictions cascade one tier down)"),
        kv_dtype: str = typer.Option("bf16", help="KV dtype for the HBM budget and bytes moved"),
        mfu: float = typer.Option(0.4, help="prefill model-FLOPs utilisation for the TTFT estimate"),
        sweep_spec: str = typer.Option(None, "--sweep", help="sweep the DRAM-class cache per cluster, per-node "
                                                            "vs pooled: 'auto' or capacities like 1M,4M,16M"),
        plot_path: str = typer.Option(None, "--plot", help="with --sweep: write hit rate vs capacity to this PNG"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Replay a request trace through a cluster's KV tiers: hit rate per tier, compute saved, TTFT."""
        if plot_path and not sweep_spec:
            raise UserError("--plot draws the sweep: add --sweep auto (or --sweep 1M,4M,...)")
        from kvtier.sim.trace import read_trace

        config = _config(model, gpu, nodes, gpus_per_node, hbm_kv_tokens, dram_tokens, pool_tokens, ssd_tokens,
                         write_policy, kv_dtype, mfu)
        requests = read_trace(trace, config.block_tokens)
        if not requests:
            raise UserError(f"trace {trace} holds no requests")
        summary, sweep_result = _run(requests, config, router, sweep_spec, show_progress=not json_out)
        if plot_path:
            _plot(sweep_result, plot_path)
        if json_out:
            if sweep_result is not None:
                summary["sweep"] = sweep_result
            json.dump(summary, sys.stdout)
            sys.stdout.write("\n")
            return
        from kvtier.sim.report import render, render_sweep

        render(summary)
        if sweep_result is not None:
            render_sweep(sweep_result)
        if plot_path:
            print(f"plot written to {plot_path}")


def _config(model: str, gpu: str, nodes: int, gpus_per_node: int, hbm: str, dram: str, pool: str, ssd: str,
            write_policy: str, kv_dtype: str, mfu: float) -> ClusterConfig:
    from kvtier.sim.cluster import ClusterConfig, node_spec
    from kvtier.units import parse_count

    if gpus_per_node <= 0:
        raise UserError(f"--gpus-per-node must be positive, got {gpus_per_node}")
    spec = node_spec(model, gpu, gpus_per_node, kv_dtype)
    hbm_tokens = spec.hbm_tokens if hbm.strip().lower() == "auto" else parse_count(hbm)
    return ClusterConfig(num_nodes=nodes, gpus_per_node=gpus_per_node, hbm_tokens=hbm_tokens,
                         dram_tokens=parse_count(dram), pool_tokens=parse_count(pool), ssd_tokens=parse_count(ssd),
                         write_policy=write_policy, kv_bytes_per_token=spec.kv_bytes_per_token,
                         flops_per_token=spec.flops_per_token, gpu_flops=spec.gpu_flops, mfu=mfu,
                         model=model, gpu=gpu)


def _capacities(spec: str) -> list[int] | None:
    """'auto' -> None (doubling steps up to the trace's footprint); '1M,4M' -> [1048576, 4194304]."""
    from kvtier.units import parse_count

    if spec.strip().lower() == "auto":
        return None
    capacities = sorted({parse_count(part) for part in spec.split(",") if part.strip()})
    if not capacities or capacities[0] <= 0:
        raise UserError(f"--sweep wants 'auto' or positive capacities like 1M,4M,16M, got {spec!r}")
    return capacities


def _run(requests: list[Request], config: ClusterConfig, router: str, sweep_spec: str | None, *,
         show_progress: bool) -> tuple[dict, dict | None]:
    """The replay of `config`, its local-vs-global comparison (several nodes with a DRAM-class cache),
    and the sweep if asked; one rich progress bar over all of it on a terminal."""
    from kvtier.sim import sweep as sw
    from kvtier.sim.replay import replay
    from kvtier.sim.report import summarize
    from kvtier.sim.router import make_router

    make_router(router)   # an unknown name fails before any work
    capacities = None
    if sweep_spec is not None:
        capacities = _capacities(sweep_spec) or sw.default_capacities(requests, config.block_tokens)
    compare = config.num_nodes > 1 and config.dram_tokens + config.pool_tokens > 0
    num_requests = len(requests) * (1 + 2 * compare + (sw.num_sweep_replays(router, capacities) if capacities else 0))
    with _progress(num_requests, show_progress) as advance:
        result = replay(requests, config, router, progress=advance)
        comparison = None
        if compare:
            comparison = sw.local_vs_global(requests, config, router)
            advance(2 * len(requests))
        sweep_result = None
        if capacities:
            sweep_result = sw.sweep(requests, config, capacities, router, on_result=lambda r: advance(r.num_requests))
    return summarize(result, comparison), sweep_result


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Yields `advance(num_requests_done_since_last_call)`; a no-op off a terminal or with --json."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not (enabled and console.is_terminal):
        yield lambda n: None
        return
    with Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("replay", total=total)
        yield lambda n: progress.advance(task, n)


def _plot(sweep_result: dict, path: str) -> None:
    from kvtier.sim.report import plot_sweep

    try:
        plot_sweep(sweep_result, path)
    except OSError as exc:
        raise UserError(f"cannot write plot {path!r}: {exc.strerror or exc}") from None
