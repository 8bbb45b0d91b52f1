"""`kvtier eval`: the quality cost of each lossy KV lever (quantization, eviction, sparse offload) on a real model."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import typer

from kvtier.config import EngineConfig, Setting, command_settings, pick, settings_of, sparse_page_tokens
from kvtier.errors import UserError



class ByteTokenizer:
    """UTF-8 bytes as token ids, for the tokenizer-less tiny test model (vocab 256)."""

    class _Encoded:
        def __init__(self, ids: list[int], as_tensor: bool) -> None:
            import torch

            self.input_ids = torch.tensor([ids]) if as_tensor else ids

    def __call__(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = True):
        return self._Encoded(list(text.encode()), return_tensors == "pt")

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")


def _layout_settings() -> list[Setting]:
    """The sparse offload layout's options: the engine's settings (`kvtier serve`'s defaults and help), the
    block size as --offload-block-tokens."""
    block, sink, recent, page = pick(settings_of(EngineConfig), "block_tokens", "offload_sink_blocks",
                                     "offload_recent_blocks", "offload_page_tokens")
    return [replace(s, help=f"sparse offload: {s.help} (the engine's --{s.flag})", flag=flag)
            for s, flag in ((block, "offload-block-tokens"), (sink, sink.flag), (recent, recent.flag),
                            (page, page.flag))]


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @command_settings(*_layout_settings(), layered=False)
    def eval_command(
        methods: str = typer.Option(None, help="comma-separated methods [every codec, eviction policy and "
                                               "transformers peer; raw is always the reference]; 'sparse' is "
                                               "the engine's sparse offload at each --offload-budgets, "
                                               "'sparse:1/8' one budget"),
        keep: str = typer.Option("0.25,0.5,0.75", help="eviction budgets: fractions of the tokens kept (0.125 or 1/8)"),
        offload_budgets: str = typer.Option("1/32,1/16,1/8,1/4", help="sparse offload fetch budgets: fractions of "
                                                                       "the host pages, or numbers of pages"),
        context: str = typer.Option("2048", help="perplexity window length(s) in tokens, e.g. 2048,4096 "
                                                 "('' to skip perplexity)"),
        windows: int = typer.Option(2, help="perplexity windows per context length"),
        chunk: int = typer.Option(128, help="tokens per teacher-forced scoring chunk (sparse offload: 1, its "
                                            "decode steps)"),
        score_tokens: int = typer.Option(None, help="perplexity: score the last N tokens of each window, the rest "
                                                    "prefilled [half the window]"),
        passkey_lengths: str = typer.Option("1024,2048", help="passkey prompt lengths ('' to skip)"),
        passkey_depths: str = typer.Option("0.1,0.3,0.5,0.7,0.9", help="needle depths"),
        snapkv_window: str = typer.Option(None, help="SnapKV observation window: tokens at the end of the prompt, "
                                                     "or 'question' (the passkey question's tokens; 32 on "
                                                     "plain text) [question]"),
        model: str = typer.Option("smollm2", help="smollm2, tiny, or a local HF model directory"),
        text: Path = typer.Option(None, help="text for perplexity (default: the shared tinyshakespeare.txt)"),
        json_out: bool = typer.Option(False, "--json", help="print the rows as one JSON list"),
        plot_path: Path = typer.Option(None, "--plot", help="write quality vs compression to this PNG"),
        *, settings: dict,
    ) -> None:
        """Perplexity and passkey retrieval of every KV codec and eviction policy vs the full cache."""
        from rich.console import Console

        from kvtier.evals import report, runner

        methods = methods if methods is not None else ",".join(_default_methods())
        # SnapKV's observation window is the prompt's closing instruction: the passkey question there,
        # the last 32 tokens (eviction.DEFAULT_SNAPKV_WINDOW_TOKENS) on plain text
        snapkv_window = snapkv_window if snapkv_window is not None else "question"
        config = _config(runner, methods, keep, context, windows, chunk, passkey_lengths, passkey_depths,
                         snapkv_window, offload_budgets, score_tokens, settings["block_tokens"],
                         settings["offload_sink_blocks"], settings["offload_recent_blocks"],
                         settings["offload_page_tokens"])
        if text is None:
            from kvtier.data import SHAKESPEARE, shared_data_file

            text = shared_data_file(SHAKESPEARE)
        if not text.is_file():
            raise UserError(f"text file {text} not found")
        err = Console(stderr=True)
        started = time.monotonic()
        loaded = _load(model)
        tokenizer = loaded.tokenizer or ByteTokenizer()
        loaded.tokenizer = tokenizer
        token_ids = tokenizer(text.read_text(), return_tensors="pt").input_ids[0] if config.context_tokens else None
        rows = runner.run_eval(loaded, config, token_ids,
                               progress=lambda msg: err.log(f"[{time.monotonic() - started:6.0f}s] {msg}"))
        title = f"kvtier eval · {loaded.name} · " + _protocol(config)
        if plot_path:
            report.plot(rows, plot_path, title)
        if json_out:
            json.dump(report.rows_to_json(rows), sys.stdout)
            sys.stdout.write("\n")
            return
        console = Console() if sys.stdout.isatty() else Console(width=150)
        console.print(report.table(rows, title))
        for check in report.check_targets(rows):
            console.print(f"{'MET' if check.met else 'NOT MET'}: {check.name} ({check.detail})")
        if plot_path:
            console.print(f"plot written to {plot_path}")


def _default_methods() -> tuple[str, ...]:
    from kvtier.evals.runner import DEFAULT_METHODS

    return tuple(m for m in DEFAULT_METHODS if m != "raw")


def _protocol(config) -> str:
    scored = f"last {config.score_tokens} tokens" if config.score_tokens else "second half"
    ppl = (f"ppl: {config.num_windows}×{config.context_tokens} tokens ({scored} scored in "
           f"{config.chunk_tokens}-token chunks)") if config.context_tokens else "no ppl"
    passkey = (f"passkey: {len(config.passkey_depths)} depths × {config.passkey_lengths} tokens"
               if config.passkey_lengths else "no passkey")
    return f"{ppl} · {passkey}"


def _config(runner, methods, keep, context, windows, chunk, passkey_lengths, passkey_depths, snapkv_window,
            offload_budgets, score_tokens, block_tokens, sink_blocks, recent_blocks, page_tokens):
    if str(snapkv_window) != "question":
        try:
            snapkv_window = int(snapkv_window)
        except ValueError:
            raise UserError(f"--snapkv-window takes a token count or 'question', got {snapkv_window!r}") from None
        if snapkv_window < 1:
            raise UserError("--snapkv-window must be positive")
    if windows < 1 or chunk < 1 or block_tokens < 1 or recent_blocks < 1:
        raise UserError("--windows, --chunk, --offload-block-tokens and --offload-recent-blocks must be positive")
    if sink_blocks < 0:
        raise UserError("--offload-sink-blocks must be >= 0")
    try:
        sparse_page_tokens(page_tokens, block_tokens)
    except ValueError as exc:
        raise UserError(f"--offload-page-tokens: {exc}") from None
    contexts = runner.parse_ints(context, "--context")
    if score_tokens is not None and not all(0 < score_tokens < ctx for ctx in contexts):
        raise UserError("--score-tokens must be positive and shorter than every --context")
    depths = runner.parse_floats(passkey_depths, "--passkey-depths")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise UserError("--passkey-depths must be fractions in [0, 1]")
    return runner.EvalConfig(
        methods=runner.parse_methods(methods, keep, snapkv_window, offload_budgets, block_tokens, sink_blocks,
                                     recent_blocks, page_tokens),
        context_tokens=contexts, num_windows=windows, chunk_tokens=chunk, score_tokens=score_tokens,
        passkey_lengths=runner.parse_ints(passkey_lengths, "--passkey-lengths") if passkey_lengths.strip() else [],
        passkey_depths=depths)


def _load(spec: str):
    from kvtier import models

    return models.load(spec, device="cpu" if spec.startswith("tiny") else None)
