"""`kvtier plan` command."""

from __future__ import annotations

import json
import sys

import typer

from kvtier.errors import UserError


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        model: str = typer.Option(..., help="catalog name, config.json path or .gguf file"),
        context: str = typer.Option("8k", help="context length, e.g. 128k"),
        concurrency: str = typer.Option("1", help="concurrent requests"),
        gpu: str = typer.Option("h100", help="accelerator from the catalog"),
        gpu_mem: str = typer.Option(None, help="HBM per GPU for an accelerator not in the catalog, e.g. 96GB"),
        kv_dtype: str = typer.Option("bf16", help="fp32, bf16, fp16, fp8, int8, int4"),
        weight_dtype: str = typer.Option("bf16", help="fp32, bf16, fp16, fp8, int8, int4"),
        tp: int = typer.Option(1, help="tensor-parallel ranks"),
        gpu_mem_util: float = typer.Option(0.9, help="fraction of HBM the server may use (vLLM's 0.9)"),
        ttft_target: float = typer.Option(1.0, help="seconds within which a cached prefix must be restored"),
        json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
        plot_path: str = typer.Option(None, "--plot", help="write memory vs context to this PNG"),
    ) -> None:
        """Will this model, context and concurrency fit; what spills, where, and what it takes."""
        from dataclasses import replace

        from kvtier.plan import gpu_spec, model_spec, plan
        from kvtier.plan.specs import GPUSpec
        from kvtier.units import parse_bytes, parse_count

        spec = model_spec(model)
        accel = gpu_spec(gpu)
        if gpu_mem:
            accel = replace(accel, name=f"{accel.name} ({gpu_mem})", hbm_bytes=parse_bytes(gpu_mem)) \
                if isinstance(accel, GPUSpec) else accel
        if tp <= 0:
            raise UserError("--tp must be positive")
        result = plan(spec, accel, context=parse_count(context), concurrency=parse_count(concurrency),
                      kv_dtype=kv_dtype, weight_dtype=weight_dtype, tp=tp, gpu_mem_util=gpu_mem_util,
                      ttft_target_s=ttft_target)
        if plot_path:
            from kvtier.plan.report import plot

            plot(spec, accel, result, plot_path)
        if json_out:
            json.dump(result.to_dict(), sys.stdout)
            sys.stdout.write("\n")
        else:
            from kvtier.plan.report import render

            render(result)
            if plot_path:
                print(f"plot written to {plot_path}")
