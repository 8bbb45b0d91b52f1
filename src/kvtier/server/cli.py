"""`kvtier serve`: the OpenAI-compatible server on the continuous-batching engine."""

from __future__ import annotations

import typer


def build_app(config):
    """Model, tiers, engine and app from a `ServeConfig` (also used by tests and benchmarks)."""
    from kvtier import models
    from kvtier.codecs import get_codec
    from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
    from kvtier.tiers.manager import build_manager
    from kvtier.server.app import create_app
    from kvtier.server.tokenizer import ByteTokenizer
    from kvtier.units import parse_bytes

    loaded = models.load(config.model)
    layout = loaded.kv_layout(config.block_tokens)
    manager = None
    if config.tiers:
        manager = build_manager(config.tiers, slot_bytes=get_codec(config.codec).max_encoded_bytes(layout))
    engine = LLMEngine(loaded, EngineConfig(
        device_kv_budget_bytes=parse_bytes(config.device_kv_budget), block_tokens=config.block_tokens,
        max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
        prefix_caching=config.prefix_caching, codec=config.codec, kv_codec=config.kv_codec,
        tier_writes=config.tier_writes,
        max_model_tokens=config.max_model_tokens), manager)

    def on_shutdown() -> None:
        if manager is not None:
            engine.flush_to_tiers()  # the device's cached prefixes outlive the process in the tiers
            manager.close()

    tokenizer = loaded.tokenizer or ByteTokenizer()
    return create_app(AsyncEngine(engine), tokenizer, config.model_names(loaded.name),
                      manager=manager, on_shutdown=on_shutdown, record_trace=config.record_trace)


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_command(
        config_file: str = typer.Option(None, "--config", help="TOML or YAML file with any of these settings"),
        model: str = typer.Option(None, help="smollm2 (default, embedded), tiny, or a local HF model directory"),
        served_model_name: list[str] = typer.Option(None, help="the model id clients send and /v1/models lists; "
                                                              "repeat for aliases [the model's name]"),
        host: str = typer.Option(None, help="bind address [127.0.0.1]"),
        port: int = typer.Option(None, help="port [8000]"),
        device_kv_budget: str = typer.Option(None, help="device KV arena size, e.g. 512MiB [512MiB]"),
        block_tokens: int = typer.Option(None, help="tokens per KV block [256]"),
        tier: list[str] = typer.Option(None, help="a tier below the device, top first; repeat: --tier dram:1GiB "
                                                  "--tier ssd:/path:4GiB (mooncake://, redis:// too) "
                                                  "[dram:1GiB + ssd under the kvtier cache dir]"),
        no_tiers: bool = typer.Option(False, "--no-tiers", help="device prefix cache only"),
        codec: str = typer.Option(None, help="codec of blocks written to the tiers [raw]"),
        kv_codec: str = typer.Option(None, help="KV format resident on the device: raw, fp8, int8 (per token), "
                                                "int4, int2 (KIVI; the open block stays exact) [raw]"),
        tier_writes: str = typer.Option(None, help="full (each block as soon as it is computed) or evict "
                                                   "(when the device evicts it) [full]"),
        max_num_seqs: int = typer.Option(None, help="running sequences at most [32]"),
        max_prefill_tokens: int = typer.Option(None, help="prompt tokens computed per step (chunked prefill) [512]"),
        max_model_tokens: int = typer.Option(None, help="context limit [the model's]"),
        record_trace: str = typer.Option(None, help="append each finished request to this JSONL in the Mooncake "
                                                    "trace format, for `kvtier simulate`"),
    ) -> None:
        """Serve the OpenAI API (completions, chat, SSE) on a fixed device KV budget with tiered prefixes."""
        import uvicorn

        from kvtier.server.config import ServeConfig

        config = ServeConfig.load(config_file, model=model, served_model_name=served_model_name or None, host=host,
                                  port=port, device_kv_budget=device_kv_budget, block_tokens=block_tokens,
                                  tiers=[] if no_tiers else (list(tier or []) or None), codec=codec, kv_codec=kv_codec,
                                  tier_writes=tier_writes,
                                  max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                                  max_model_tokens=max_model_tokens,
                                  record_trace=record_trace)
        app_ = build_app(config)
        print(f"kvtier serve: http://{config.host}:{config.port}/v1 (dashboard: /dashboard)", flush=True)
        uvicorn.run(app_, host=config.host, port=config.port, log_level="warning")
