"""`kvtier serve`: the OpenAI-compatible server on the continuous-batching engine."""

from __future__ import annotations

import typer

from kvtier.config import command_settings
from kvtier.server.config import ServeConfig


def build_engine(config: ServeConfig):
    """(loaded model, engine, tier manager or None) from a `ServeConfig`: every setting the engine or a tier
    would refuse is a one-line ConfigError before any of them takes memory."""
    from kvtier import models
    from kvtier.codecs import get_codec
    from kvtier.engine import LLMEngine
    from kvtier.engine.limits import check_engine, check_tiers
    from kvtier.tiers.manager import build_manager

    loaded = models.load(config.model)
    layout = loaded.kv_layout(config.engine.block_tokens)
    slot_bytes = get_codec(config.engine.codec).max_encoded_bytes(layout)
    check_tiers(config.tiers, slot_bytes)
    check_engine(layout, config.engine, loaded.model.config.get_text_config(decoder=True),
                 has_host_tier=bool(config.tiers) and config.tiers[0].kind == "dram")
    manager = build_manager(config.tiers, slot_bytes=slot_bytes) if config.tiers else None
    return loaded, LLMEngine(loaded, config.engine, manager), manager


def build_app(config: ServeConfig):
    """Model, tiers, engine and app from a `ServeConfig` (also used by tests and benchmarks)."""
    from kvtier.engine import AsyncEngine
    from kvtier.server.app import create_app
    from kvtier.server.protocol import SamplingDefaults
    from kvtier.server.tokenizer import ByteTokenizer

    loaded, engine, manager = build_engine(config)
    defaults = (SamplingDefaults.from_generation_config(getattr(loaded.model, "generation_config", None))
                if config.generation_config == "auto" else SamplingDefaults())
    publisher = kv_event_counts = None
    if config.kv_events_config is not None and config.kv_events_config.enabled:
        from kvtier.server import kv_events

        publisher, events = kv_events.start(config.kv_events_config, engine, manager)

        def kv_event_counts() -> tuple[int, int]:
            return publisher.num_batches, events.num_dropped

    def on_shutdown() -> None:
        if manager is not None:
            engine.flush_to_tiers()  # the device's cached prefixes outlive the process in the tiers
            manager.close()
        if publisher is not None:
            publisher.close()  # after the tiers: their last writes are announced

    tokenizer = loaded.tokenizer or ByteTokenizer()
    return create_app(AsyncEngine(engine), tokenizer, config.model_names(loaded.name),
                      manager=manager, on_shutdown=on_shutdown, record_trace=config.record_trace,
                      sampling_defaults=defaults, kv_event_counts=kv_event_counts)


def register(app: typer.Typer) -> None:
    @app.command("serve")
    @command_settings(*ServeConfig.settings(), layered=True)
    def serve_command(
        config_file: str = typer.Option(None, "--config", help="TOML or YAML file with any of these settings "
                                                               "(flags win over the file)"),
        no_tiers: bool = typer.Option(False, "--no-tiers", help="device prefix cache only"),
        *, settings: dict,
    ) -> None:
        """Serve the OpenAI API (completions, chat, SSE) on a fixed device KV budget with tiered prefixes."""
        import uvicorn

        config = ServeConfig.load(config_file, **{**settings, **({"tiers": []} if no_tiers else {})})
        app_ = build_app(config)
        print(f"kvtier serve: http://{config.host}:{config.port}/v1 (dashboard: /dashboard)", flush=True)
        uvicorn.run(app_, host=config.host, port=config.port, log_level="warning")
