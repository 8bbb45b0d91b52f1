"""The plan as a rich table. Every size is printed with its unit: GiB = 2^30 B, GB = 10^9 B."""

from __future__ import annotations

from kvtier.plan.catalog_links import LINKS
from kvtier.plan.result import OffloadMode, OffloadPlan, PlanResult
from kvtier.units import fmt_bytes


def gib_and_gb(num_bytes: float) -> str:
    """`16.00 GiB (17.18 GB)`: both units, so nobody mistakes one for the other."""
    return f"{fmt_bytes(num_bytes)} ({fmt_bytes(num_bytes, binary=False)})"


def _yes_no(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


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
        ("fits", _yes_no(r.fits)),
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
        ("cluster to hold it all in HBM", _cluster(r)),
    ]


def _cluster(r: PlanResult) -> str:
    if not r.replicas:
        return "none: no tensor-parallel size holds one request's KV beside the weights"
    return (f"{r.replicas} replicas x tp{r.cluster_tp} = {r.gpus} GPUs = {r.nodes} nodes, "
            f"{r.facility_watts[0] / 1e3:.1f}-{r.facility_watts[1] / 1e3:.1f} kW facility")


def _per_mode(o: OffloadPlan, row) -> tuple[str, str]:
    return row(o.exact), row(o.sparse)


def _device_sum(m: OffloadMode, o: OffloadPlan) -> str:
    summaries = f" + summaries {fmt_bytes(m.summary_bytes_per_gpu)}" if m.summary_bytes_per_gpu else ""
    return (f"window KV {fmt_bytes(o.window_bytes_per_gpu)} + fetch area {fmt_bytes(m.fetch_area_bytes_per_gpu)}"
            f"{summaries}; with weights, activations, overhead {gib_and_gb(m.device_bytes_per_gpu)} "
            f"(fits: {_yes_no(m.fits_device)})")


def _fetched(m: OffloadMode) -> str:
    units = m.fetched_tokens_per_request // m.fetch_unit_tokens if m.fetch_unit_tokens else 0
    what = "blocks" if m.name == "exact" else "pages"
    return f"{m.fetched_tokens_per_request:,} ({units:,} {what} of {m.fetch_unit_tokens})"


def _tokens_s(per_request: float, concurrency: int) -> str:
    return f"{per_request:,.2f} tok/s per request, {per_request * concurrency:,.0f} for all {concurrency}"


def _shared_lines(r: PlanResult) -> list[str]:
    """What both modes share: the window and the host room."""
    o = r.offload
    return [f"device window: {o.window_blocks} blocks of {o.block_tokens} = {o.device_tokens_per_request:,} tokens "
            f"per request (sink block + recent); off the device: {o.off_device_blocks_per_request:,} blocks = "
            f"{o.off_device_tokens_per_request:,} tokens per request",
            f"host bytes: {gib_and_gb(o.host_bytes_per_request)} per request, {gib_and_gb(o.host_bytes_total)} for "
            f"all {r.concurrency}, of {gib_and_gb(o.host_kv_capacity_bytes)} host DRAM for KV "
            f"(fits: {_yes_no(o.fits_host)})"]


def _offload_rows(r: PlanResult) -> list[tuple[str, str, str]]:
    o = r.offload
    rows = [
        ("tokens fetched per request, layer and KV head, per decode step", *_per_mode(o, _fetched)),
        ("per GPU on the device", *_per_mode(o, lambda m: _device_sum(m, o))),
        ("bytes over the link per decode step, per GPU", *_per_mode(o, lambda m: gib_and_gb(m.link_bytes_per_step))),
        ("decode bound, HBM alone", *_per_mode(o, lambda m: _tokens_s(m.hbm_tokens_per_s, r.concurrency))),
    ]
    for name, bytes_s in o.link_bytes_s.items():
        rows.append((f"decode bound over {name} ({bytes_s / 1e9:g} GB/s, {LINKS[name].memory})",
                     *_per_mode(o, lambda m: _tokens_s(m.tokens_per_s_by_link[name], r.concurrency))))
    return rows


def _buy_line(r: PlanResult) -> str:
    o = r.offload
    if not o.all_on_device_gpus:
        return "or buy GPUs: no replica fits (weights + activations + overhead exceed the HBM)"
    return (f"or buy {o.gpus_to_buy} more GPUs ({o.all_on_device_gpus} in all) and keep all KV on the device: "
            f"{_tokens_s(o.all_on_device_tokens_per_s, r.concurrency)}, HBM bound")


def _render_offload(console, r: PlanResult) -> None:
    from rich.table import Table

    table = Table(title=f"offload: serve it on this replica (tp{r.tp}) with cold KV blocks off the device")
    table.add_column("item")
    table.add_column("exact (every off-device block, every step)")
    table.add_column(f"{r.offload.sparse.name} (top pages per layer and KV head)")
    for row in _offload_rows(r):
        table.add_row(*row)
    console.print(table)
    for line in _shared_lines(r):
        console.print(line)
    console.print(_buy_line(r))
    console.print("estimate, offload: a step lasts at least max(link bytes / link bandwidth, HBM bytes / HBM "
                  "bandwidth), nominal peaks of one link per GPU; fetch area = one layer of a step's fetches, "
                  "double-buffered; page summaries (key min/max/mean, fp16) stay on the device")
    for note in r.offload.notes:
        console.print(f"note: {note}")


def render(result: PlanResult) -> None:
    from rich.console import Console
    from rich.table import Table

    chosen = " (chosen)" if result.tp_chosen else ""
    table = Table(title=f"kvtier plan: {result.model} on {result.gpu} x tp{result.tp}{chosen}, {result.context:,} "
                        f"tokens x {result.concurrency} requests, KV {result.kv_dtype}, weights {result.weight_dtype}")
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
    if result.offload is not None:
        _render_offload(console, result)
