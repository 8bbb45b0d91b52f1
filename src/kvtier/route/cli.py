"""`kvtier route`: the OpenAI-compatible front door over N replicas."""

from __future__ import annotations

import typer

from kvtier.errors import UserError


def build_router(replica_urls: list[str], policy: str, *, tokenizer_path: str | None = None,
                 selector_url: str | None = None, kv_events: list[str] | None = None,
                 kv_events_replay: list[str] | None = None, model_name: str = "smollm2", block_size: int = 32,
                 shared_pool: bool = False, events_host: str | None = None):
    """A `Router` from the command's settings (also used by tests). The selector reads the replicas' KV events
    (`kv_events`) through `event_relay.EventRelay`: each block with its tenant, and with `shared_pool` (the
    replicas share one Mooncake / Redis pool) the others' pool blocks in each replica's stream; a gap in a
    replica's stream is asked for at its `kv_events_replay` endpoint. `events_host`: the relay publishes on TCP
    there (a selector on another machine), not on ipc sockets."""
    from kvtier.route.app import Router
    from kvtier.route.prompts import load_tokenizer
    from kvtier.route.replicas import Replica, ReplicaSet

    kv_events, kv_events_replay = kv_events or [], kv_events_replay or []
    if kv_events and len(kv_events) != len(replica_urls):
        raise UserError(f"--kv-events: one per --replica, in the same order ({len(kv_events)} for "
                        f"{len(replica_urls)} replicas)")
    if kv_events_replay and len(kv_events_replay) != len(replica_urls):
        raise UserError("--kv-events-replay: one per --replica, in the same order")
    relay = None
    if kv_events:
        from kvtier.route.event_relay import EventRelay

        relay = EventRelay(kv_events, shared_pool=shared_pool, source_replays=kv_events_replay or None,
                           host=events_host).start()
        kv_events, kv_events_replay = relay.endpoints, relay.replay_endpoints  # the relay numbers its own streams
    replicas = [Replica(i + 1, url, kv_events[i] if kv_events else None,
                        kv_events_replay[i] if kv_events_replay else None) for i, url in enumerate(replica_urls)]
    try:
        selector = _selector(policy, replicas, selector_url=selector_url, model_name=model_name,
                             block_size=block_size, tokenizer_path=tokenizer_path)
    except UserError:
        if relay is not None:
            relay.close()
        raise
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    router = Router(ReplicaSet(replicas), selector, tokenizer=tokenizer)
    router.event_relay = relay
    return router


def _selector(policy: str, replicas, *, selector_url: str | None, model_name: str, block_size: int,
              tokenizer_path: str | None):
    from kvtier.route.selectors import make_selector

    try:
        selector = make_selector(policy, replicas, selector_url=selector_url, model_name=model_name,
                                 block_size=block_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if policy == "dynamo" and not all(r.kv_events_endpoint for r in replicas):  # Dynamo 1.6.1 requires them
        raise UserError("the dynamo policy needs --kv-events ENDPOINT per replica (each one's --kv-events-config "
                        "endpoint): Dynamo's selector schedules only workers whose KV events it reads")
    if policy == "dynamo" and tokenizer_path is None:
        raise UserError("the dynamo policy needs --tokenizer MODEL_DIR (the replicas' model): it matches token ids")
    return selector


def register(app: typer.Typer) -> None:
    @app.command("route")
    def route_command(
        replica: list[str] = typer.Option(..., "--replica", help="a replica's base URL (repeat: one per replica), "
                                                                 "e.g. http://127.0.0.1:8001"),
        policy: str = typer.Option("round-robin", help="round-robin | least-loaded | dynamo"),
        host: str = typer.Option("127.0.0.1"),
        port: int = typer.Option(8000),
        tokenizer: str = typer.Option(None, help="the replicas' model directory (its tokenizer and chat "
                                                 "template); needed by the dynamo policy"),
        selector: str = typer.Option(None, help="dynamo: NVIDIA Dynamo's selection service "
                                                "(python -m dynamo.select_service), e.g. http://127.0.0.1:8092"),
        kv_events: list[str] = typer.Option(None, "--kv-events", help="dynamo: each replica's KV event endpoint "
                                            "(its --kv-events-config endpoint), in --replica order"),
        kv_events_replay: list[str] = typer.Option(None, "--kv-events-replay",
                                                   help="dynamo: each replica's replay endpoint, in order"),
        model: str = typer.Option("smollm2", help="the model name the replicas serve"),
        block_size: int = typer.Option(32, help="the replicas' KV block size in tokens (vLLM --block-size)"),
        shared_pool: bool = typer.Option(False, "--shared-pool", help="dynamo: the replicas share one Mooncake / "
                                         "Redis pool: a block one of them put there counts for all"),
        events_host: str = typer.Option(None, "--events-host", help="dynamo: the selector reads the replicas' KV "
                                        "events from kvtier's relay on tcp://HOST:<port> (a selector on another "
                                        "machine); default: ipc sockets on this one"),
    ) -> None:
        """Route OpenAI requests over replicas (vLLM + kvtier, or kvtier serve) by a policy."""
        import logging

        import uvicorn

        from kvtier.route.app import create_app

        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        router = build_router(replica, policy, tokenizer_path=tokenizer, selector_url=selector,
                              kv_events=kv_events, kv_events_replay=kv_events_replay, model_name=model,
                              block_size=block_size, shared_pool=shared_pool, events_host=events_host)
        print(f"kvtier route: http://{host}:{port}/v1 over {len(replica)} replicas ({policy}; /metrics)",
              flush=True)
        uvicorn.run(create_app(router), host=host, port=port, log_level="warning")
