"""Summaries of a replay: the JSON object, the rich table, and the sweep's table and PNG."""

from __future__ import annotations

import math
from dataclasses import asdict

from kvtier.sim.cluster import TIERS
from kvtier.sim.replay import SimResult
from kvtier.units import fmt_bytes


def fmt_tokens(num: float) -> str:
    """Token counts in the binary units `parse_count` reads: 3145728 -> 3M, 4489735 -> 4.28M."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if abs(num) >= div:
            return f"{num / div:.2f}".rstrip("0").rstrip(".") + unit
    return f"{num:.0f}"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an unsorted list; 0 for an empty one."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def summarize(result: SimResult, local_vs_global: dict | None = None) -> dict:
    """The JSON object of one replay. Rates are token-weighted fractions of all input tokens
    (`hit_rate_by_tier` sums to `hit_rate`); bytes are KV bytes of all TP ranks;
    `bytes_read_by_tier` is what each lower tier sends to HBM for its hits (HBM hits move nothing)."""
    c = result.config
    saved_flops = result.hit_tokens * c.flops_per_token
    return {
        "requests": result.num_requests,
        "router": result.router,
        "input_tokens": result.input_tokens,
        "hit_tokens": result.hit_tokens,
        "hit_rate": result.hit_rate,
        "max_hit_rate": result.max_hit_rate,
        "hit_rate_by_tier": result.hit_rate_by_tier(),
        "hit_tokens_by_tier": dict(result.hit_tokens_by_tier),
        "prefill_flops_saved": saved_flops,
        "prefill_gpu_seconds_saved": saved_flops / (c.gpu_flops * c.mfu),
        "bytes_read_by_tier": {t: 0.0 if t == "hbm" else result.hit_tokens_by_tier[t] * c.kv_bytes_per_token
                               for t in TIERS},
        "bytes_written_by_tier": {t: result.written_tokens_by_tier[t] * c.kv_bytes_per_token for t in TIERS},
        "ttft_p50_s": percentile(result.ttft_s, 50),
        "ttft_p99_s": percentile(result.ttft_s, 99),
        "prefill_p50_s": percentile(result.prefill_s, 50),
        "prefill_p99_s": percentile(result.prefill_s, 99),
        "requests_by_node": result.requests_by_node,
        "requests_per_s": result.requests_per_s,
        "config": asdict(c),
        **({"local_vs_global": local_vs_global} if local_vs_global is not None else {}),
    }


def render(summary: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = summary["config"]
    table = Table(title=f"kvtier simulate: {summary['requests']} requests, {c['num_nodes']} nodes x "
                        f"{c['gpus_per_node']} {c['gpu']}, {c['model']}, router {summary['router']}, "
                        f"write-{c['write_policy']}")
    for col in ("tier", "capacity (tokens)", "hit rate", "read into HBM", "written"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for t in TIERS:
        scope = "cluster" if t == "pool" else "per node"
        table.add_row(t, f"{fmt_tokens(c[f'{t}_tokens'])} {scope}", f"{summary['hit_rate_by_tier'][t]:.1%}",
                      fmt_bytes(summary["bytes_read_by_tier"][t], binary=False),
                      fmt_bytes(summary["bytes_written_by_tier"][t], binary=False))
    table.add_row("all", "", f"{summary['hit_rate']:.1%}", "", "", style="bold")
    table.add_row("max (infinite)", "", f"{summary['max_hit_rate']:.1%}", "", "")
    console.print(table)
    console.print(f"prefill compute saved: {summary['prefill_flops_saved']:.3g} FLOP "
                  f"({summary['prefill_gpu_seconds_saved']:.1f} GPU-s at MFU {c['mfu']})")
    console.print(f"estimated TTFT p50 {summary['ttft_p50_s'] * 1e3:.1f} ms, p99 {summary['ttft_p99_s'] * 1e3:.1f} ms "
                  f"(prefill alone p50 {summary['prefill_p50_s'] * 1e3:.1f} ms, p99 "
                  f"{summary['prefill_p99_s'] * 1e3:.1f} ms; FCFS queue per node)")
    if "local_vs_global" in summary:
        lg = summary["local_vs_global"]
        ratio = f"{lg['ratio']:.2f}x" if lg["ratio"] is not None else "per-node caches hit nothing"
        console.print(f"local vs global at {fmt_tokens(lg['capacity_tokens'])} tokens of DRAM-class cache "
                      f"({lg['router']}): per-node DRAM {lg['local_hit_rate']:.1%}, one pool "
                      f"{lg['global_hit_rate']:.1%} ({ratio})")
    console.print(f"simulator: {summary['requests_per_s']:.0f} requests/s")


def render_sweep(sweep: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"hit rate vs {sweep['axis']} (max {sweep['max_hit_rate']:.1%})")
    table.add_column("capacity (tokens)", justify="right")
    for name in sweep["curves"]:
        table.add_column(name, justify="right")
    table.add_column("global / per-node", justify="right")
    for i, cap in enumerate(sweep["capacities_tokens"]):
        ratio = sweep["global_over_local"][i]
        table.add_row(fmt_tokens(cap), *(f"{curve[i]:.1%}" for curve in sweep["curves"].values()),
                      f"{ratio:.2f}x" if ratio is not None else "-")
    table.add_row("90% of max at", *(fmt_tokens(v) if v is not None else "-" for v in sweep["knee_tokens"].values()),
                  "", style="bold")
    console.print(table)


def plot_sweep(sweep: dict, path: str) -> None:
    """Hit rate vs capacity, one line per configuration, each knee (90% of max) starred and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    caps = sweep["capacities_tokens"]
    for name, curve in sweep["curves"].items():
        (line,) = ax.plot(caps, [100 * v for v in curve], marker="o", label=name)
        knee = sweep["knee_tokens"][name]
        if knee is not None:
            y = 100 * curve[caps.index(knee)]
            ax.axvline(knee, color=line.get_color(), linestyle=":", alpha=0.6)
            ax.plot([knee], [y], marker="*", markersize=16, color=line.get_color(), markeredgecolor="black", zorder=5)
            ax.annotate(f"90% at {fmt_tokens(knee)}", (knee, y), textcoords="offset points", xytext=(6, -16),
                        color=line.get_color(), fontsize=9, fontweight="bold")
    ax.axhline(100 * sweep["max_hit_rate"], color="black", linestyle="--", label="max (infinite cache)")
    ax.axhline(90 * sweep["max_hit_rate"], color="gray", linestyle=":", label="90% of max")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_tokens(x)))
    ax.set_xlabel(f"{sweep['axis']} (tokens)")
    ax.set_ylabel("token hit rate, all tiers (%)")
    ax.set_ylim(0, max(5.0, 105 * sweep["max_hit_rate"]))
    ax.set_title(sweep["title"], fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
