"""`kvtier plan`: will it fit, and if not, where does the overflow go."""

from __future__ import annotations

import json
import sys

import typer

from kvtier.config import DEFAULT_OFFLOAD_PAGE_TOKENS
from kvtier.errors import UserError


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        model: str = typer.Option(..., help="catalog name (e.g. llama-3.1-70b), config.json path or .gguf file"),
        context: str = typer.Option("8k", help="context length per request, e.g. 128k (k = 1024)"),
        concurrency: str = typer.Option("1", help="concurrent requests"),
        gpu: str = typer.Option("h100", help="accelerator from the catalog"),
        gpu_mem: str = typer.Option(None, help="memory per GPU for an accelerator not in the catalog, e.g. 96GB "
                                               "(bandwidth, FLOP/s and TDP stay those of --gpu)"),
        kv_dtype: str = typer.Option("bf16", help="fp32, bf16, fp16, fp8, int8, int4"),
        weight_dtype: str = typer.Option("bf16", help="fp32, bf16, fp16, fp8, int8, int4"),
        tp: int = typer.Option(None, help="tensor-parallel ranks (default: the smallest that holds the weights "
                                          "and one request's KV)"),
        gpu_mem_util: float = typer.Option(0.9, help="fraction of HBM the server may use (vLLM's 0.9)"),
        ttft_target: float = typer.Option(1.0, help="seconds within which a cached prefix must be restored"),
        host_mem: str = typer.Option("2TiB", help="host DRAM per node, for the tier plan"),
        offload_window_tokens: str = typer.Option(None, help="offload: tokens per request kept on the device "
                                                  "(sink block + recent window), e.g. 2k; default 1,024 "
                                                  "at 256-token blocks"),
        sparse_fraction: str = typer.Option("1/8", help="offload: share of off-device pages sparse mode fetches, "
                                                        "e.g. 1/8 or 0.125"),
        block_tokens: int = typer.Option(256, help="offload: tokens per KV block"),
        page_tokens: int = typer.Option(DEFAULT_OFFLOAD_PAGE_TOKENS, help="offload: tokens per page sparse mode "
                                        "scores and fetches (divides --block-tokens; more: the block)"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
        plot_path: str = typer.Option(None, "--plot", help="write memory vs context length to this PNG"),
    ) -> None:
        """Will this model, context and concurrency fit; what spills, where, and what it takes; if it does not
        fit, what serving it with cold KV blocks off the device (exact, sparse) needs next to buying GPUs."""
        from kvtier.plan import gpu_spec, model_spec, plan
        from kvtier.plan.catalog_gpus import with_memory
        from kvtier.plan.offload import OffloadOptions, parse_fraction
        from kvtier.units import parse_bytes, parse_count

        spec = model_spec(model)
        accel = gpu_spec(gpu)
        if gpu_mem is not None:
            accel = with_memory(accel, parse_bytes(gpu_mem))
        result = plan(spec, accel, context=parse_count(context), concurrency=parse_count(concurrency),
                      kv_dtype=kv_dtype, weight_dtype=weight_dtype, tp=tp, gpu_mem_util=gpu_mem_util,
                      ttft_target_s=ttft_target, host_mem_bytes_per_node=parse_bytes(host_mem),
                      offload=OffloadOptions(
                          window_tokens=None if offload_window_tokens is None else parse_count(offload_window_tokens),
                          block_tokens=block_tokens, sparse_fraction=parse_fraction(sparse_fraction),
                          page_tokens=page_tokens))
        if plot_path:
            _plot(spec, result, plot_path)
        if json_out:
            json.dump(result.to_dict(), sys.stdout)
            sys.stdout.write("\n")
            return
        from kvtier.plan.report import render

        render(result)
        if plot_path:
            print(f"plot written to {plot_path}")


def _plot(spec, result, path: str) -> None:
    from kvtier.plan.plot import plot

    try:
        plot(spec, result, path)
    except OSError as exc:
        raise UserError(f"cannot write plot {path!r}: {exc.strerror or exc}") from None
