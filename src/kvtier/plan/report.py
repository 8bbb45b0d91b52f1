"""The plan as a rich table. Every size is printed with its unit: GiB = 2^30 B, GB = 10^9 B."""

from __future__ import annotations

from kvtier.plan.sizing import PlanResult
from kvtier.units import fmt_bytes


def gib_and_gb(num_bytes: float) -> str:
    """`16.00 GiB (17.18 GB)`: both units, so nobody mistakes one for the other."""
    return f"{fmt_bytes(num_bytes)} ({fmt_bytes(num_bytes, binary=False)})"


def _rows(r: PlanResult) -> list[tuple[str, str]]:
    tiers = r.tier_plan
    meets = {name: "ok" if tiers[f"{name}_meets_ttft"] else "too slow" for name in ("dram", "pool", "ssd")}
    return [
        ("KV per token (one GPU rank)", f"{r.kv_bytes_per_token:,.0f} B"),
        ("KV per request (all ranks)", gib_and_gb(r.kv_bytes_per_request)),
        ("KV total (all requests, all ranks)", gib_and_gb(r.kv_bytes_total)),
        ("weights (all params / per GPU)", f"{gib_and_gb(r.weights_bytes)} / {gib_and_gb(r.weights_bytes_per_gpu)}"),
        ("per GPU: weights + KV + activations + overhead",
         f"{fmt_bytes(r.weights_bytes_per_gpu)} + {fmt_bytes(r.kv_bytes_per_gpu)} + {fmt_bytes(r.activations_bytes)}"
         f" + {fmt_bytes(r.overhead_bytes)} = {gib_and_gb(r.needed_bytes_per_gpu)}"),
        ("usable HBM per GPU", f"{gib_and_gb(r.usable_bytes)} of {gib_and_gb(r.gpu_mem_bytes)}"),
        ("fits", "[green]yes[/green]" if r.fits else "[red]no[/red]"),
        ("max concurrency at this context", f"{r.max_concurrency:,}"),
        ("max context at this concurrency", f"{r.max_context:,} tokens"),
        ("KV that spills (all ranks)", gib_and_gb(r.spill_bytes)),
        ("tier plan: host DRAM per node / pool / SSD per node",
         f"{gib_and_gb(tiers['host_dram_bytes_per_node'])} / {gib_and_gb(tiers['pool_bytes'])} / "
         f"{gib_and_gb(tiers['ssd_bytes_per_node'])}"),
        (f"restore one prefix within TTFT {r.ttft_target_s:g} s",
         f"{r.restore_bandwidth_bytes_s / 1e9:.2f} GB/s per GPU (dram {meets['dram']}, pool {meets['pool']}, "
         f"ssd {meets['ssd']})"),
        ("restore time of one prefix by tier", ", ".join(f"{k}: {v:.3f} s" for k, v in r.restore_s_by_tier.items())),
        ("decode bound (HBM bandwidth)", f"{r.decode_tokens_per_s:,.0f} tokens/s per replica"),
        ("cluster to hold it all in HBM", f"{r.replicas} replicas x tp{r.tp} = {r.gpus} GPUs = {r.nodes} nodes, "
                                          f"{r.facility_watts[0] / 1e3:.1f}-{r.facility_watts[1] / 1e3:.1f} kW facility"),
    ]


def render(result: PlanResult) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier plan: {result.model} on {result.gpu} x tp{result.tp}, {result.context:,} tokens "
                        f"x {result.concurrency} requests, KV {result.kv_dtype}, weights {result.weight_dtype}")
    table.add_column("item")
    table.add_column("value (GiB = 2^30 B, GB = 10^9 B)")
    for row in _rows(result):
        table.add_row(*row)
    console = Console()
    console.print(table)
    for name, how in result.estimates.items():
        console.print(f"estimate, {name}: {how}")
    for note in result.notes:
        console.print(f"note: {note}")
