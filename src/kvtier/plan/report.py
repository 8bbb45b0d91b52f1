"""The plan as a rich table, and the memory-vs-context plot."""

from __future__ import annotations

from kvtier.plan.sizing import GIB, MAX_BATCHED_TOKENS, PlanResult
from kvtier.plan.specs import GPUSpec, ModelSpec
from kvtier.units import fmt_bytes


def _gib_gb(num_bytes: float) -> str:
    return f"{fmt_bytes(num_bytes)} ({num_bytes / 1e9:.2f} GB)"


def render(result: PlanResult) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier plan: {result.model} on {result.gpu} x tp{result.tp}, "
                        f"{result.context} tokens x {result.concurrency} requests, KV {result.kv_dtype}")
    table.add_column("item")
    table.add_column("value (GiB = 2^30 B; GB = 10^9 B)")
    rows = [
        ("KV per token (per GPU)", f"{result.kv_bytes_per_token:,.0f} B"),
        ("KV per request (all ranks)", _gib_gb(result.kv_bytes_per_request)),
        ("KV total (all requests, all ranks)", _gib_gb(result.kv_bytes_total)),
        ("weights (all params, per GPU)", f"{_gib_gb(result.weights_bytes)}, {_gib_gb(result.weights_bytes_per_gpu)}"),
        ("per GPU: weights + KV + activations + overhead",
         f"{fmt_bytes(result.weights_bytes_per_gpu)} + {fmt_bytes(result.kv_bytes_per_gpu)} + "
         f"{fmt_bytes(result.activations_bytes)} + {fmt_bytes(result.overhead_bytes)} = {fmt_bytes(result.needed_bytes_per_gpu)}"),
        ("usable HBM per GPU", f"{_gib_gb(result.usable_bytes)} of {_gib_gb(result.gpu_mem_bytes)}"),
        ("fits", "[green]yes[/green]" if result.fits else "[red]no[/red]"),
        ("max concurrency at this context", str(result.max_concurrency)),
        ("max context at this concurrency", f"{result.max_context:,} tokens"),
        ("KV that spills", _gib_gb(result.spill_bytes)),
        ("spill: host DRAM per node / pool / SSD per node",
         f"{fmt_bytes(result.tier_plan['host_dram_bytes_per_node'])} / {fmt_bytes(result.tier_plan['pool_bytes'])} / "
         f"{fmt_bytes(result.tier_plan['ssd_bytes_per_node'])}"),
        (f"restore bandwidth for TTFT {result.ttft_target_s:g}s (per GPU)", f"{result.restore_bandwidth_bytes_s / 1e9:.2f} GB/s"),
        ("restore time of one prefix by tier", ", ".join(f"{k}: {v:.3f}s" for k, v in result.restore_s_by_tier.items())),
        ("decode bound (HBM bandwidth)", f"{result.decode_tokens_per_s:,.0f} tokens/s per replica"),
        ("cluster for this concurrency", f"{result.replicas} replicas = {result.gpus} GPUs = {result.nodes} nodes, "
                                         f"{result.facility_watts[0] / 1e3:.1f}-{result.facility_watts[1] / 1e3:.1f} kW facility"),
    ]
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"estimates: activations = one {MAX_BATCHED_TOKENS}-token prefill chunk (4*hidden + 2*intermediate/tp "
                  f"bf16 values per token) + fp32 logits per sequence; overhead = {fmt_bytes(GIB)} per GPU.")
    for note in result.notes:
        console.print(f"note: {note}")


def plot(model: ModelSpec, gpu: GPUSpec, result: PlanResult, path: str) -> None:
    """Memory per GPU against context length at the plan's concurrency, with the HBM line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    contexts = np.unique(np.linspace(1, max(result.context * 2, model.max_context), 400).astype(int))
    fixed = result.weights_bytes_per_gpu + result.activations_bytes + result.overhead_bytes
    totals = [(fixed + model.kv_bytes(int(c), result.kv_dtype, result.tp) * result.concurrency) / GIB for c in contexts]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(contexts, totals, label=f"weights + KV + act. + overhead ({result.concurrency} requests)")
    ax.axhline(fixed / GIB, color="gray", ls=":", label="weights + activations + overhead")
    ax.axhline(result.gpu_mem_bytes / GIB, color="red", label=f"{gpu.name} HBM {gpu.hbm_bytes / GIB:.1f} GiB")
    ax.axhline(result.usable_bytes / GIB, color="red", ls="--", label="usable (utilisation)")
    ax.axvline(result.context, color="black", ls="--", lw=0.8, label=f"context {result.context}")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("memory per GPU (GiB)")
    ax.set_title(f"{model.name}, KV {result.kv_dtype}, tp {result.tp}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
