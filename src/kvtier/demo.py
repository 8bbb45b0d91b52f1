"""`kvtier demo` (what `make run` starts until `kvtier serve` lands): a real greedy generation
on the embedded SmolLM2, the KV bytes it really held, and the `kvtier plan` answer for it."""

from __future__ import annotations

import time
import typer

from kvtier.data import SHAKESPEARE, shared_data_file

DEFAULT_PROMPT_CHARS = 2500


def _default_prompt() -> str:
    try:
        text = shared_data_file(SHAKESPEARE).read_text()
    except FileNotFoundError:
        return "Explain in two sentences why the KV cache of a language model grows with the context length."
    return text[:DEFAULT_PROMPT_CHARS] + "\n\nSummarise the scene above in one sentence:"


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        prompt: str = typer.Option(None, help="prompt text (default: a Shakespeare scene)"),
        max_new_tokens: int = typer.Option(32, min=1),
        concurrency: int = typer.Option(64, min=1, help="concurrency for the plan report"),
        gpu: str = typer.Option("l40s", help="accelerator for the plan report"),
    ) -> None:
        """Generate on the embedded model, then size its KV cache with `kvtier plan`."""
        import torch
        from rich.console import Console
        from transformers import DynamicCache

        from kvtier import models
        from kvtier.plan import gpu_spec, model_spec, plan
        from kvtier.plan.report import render

        console = Console()
        with console.status("loading SmolLM2-135M-Instruct (converted from its GGUF once, then cached)"):
            loaded = models.load("smollm2")
        text = prompt or _default_prompt()
        ids = loaded.tokenizer(text, return_tensors="pt").input_ids.to(loaded.model.device)
        cache = DynamicCache(config=loaded.config)
        start = time.perf_counter()
        with console.status(f"generating: {ids.shape[1]} prompt tokens, {max_new_tokens} new"), torch.inference_mode():
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                        max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=loaded.tokenizer.eos_token_id)
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1]:]
        console.rule("generation")
        console.print(loaded.tokenizer.decode(new, skip_special_tokens=True))
        measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        cached_tokens = cache.get_seq_length()
        spec = model_spec("smollm2")
        planned = spec.kv_bytes(cached_tokens, "fp32")
        console.rule("KV cache")
        console.print(f"{ids.shape[1]} prompt + {len(new)} new tokens in {seconds:.1f}s; the cache holds "
                      f"{cached_tokens} tokens = {measured:,} bytes measured, {planned:,.0f} bytes by kvtier plan "
                      f"({'exact' if measured == planned else 'MISMATCH'})")
        render(plan(spec, gpu_spec(gpu), context=spec.max_context, concurrency=concurrency, kv_dtype="bf16"))
