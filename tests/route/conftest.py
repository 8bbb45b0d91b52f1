"""Stub replicas and a stub Dynamo selection service (small FastAPI apps on 127.0.0.1 in threads), and
the router over them (in a thread too), for `kvtier route`'s fast tests."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvtier.route.app import Router, create_app
from kvtier.route.replicas import Replica, ReplicaSet
from kvtier.route.selectors import make_selector
from kvtier.testing.app_thread import AppThread
from kvtier.ports import free_port


def batch(events: list[dict]) -> bytes:
    """vLLM's `KVEventBatch` on the wire: msgpack [ts, events, dp_rank], each event a map tagged `type`."""
    return msgpack.packb([time.time(), events, 0], use_bin_type=True)


def stored_chain(token_ids: list[int], first_hash: int, block_size: int, medium: str) -> list[dict]:
    """vLLM's `BlockStored` for each full block of `token_ids`, hashes first_hash, first_hash + 1, ..."""
    return [{"type": "BlockStored", "block_hashes": [first_hash + i],
             "parent_block_hash": first_hash + i - 1 if i else None,
             "token_ids": token_ids[i * block_size:(i + 1) * block_size], "block_size": block_size, "lora_id": None,
             "medium": medium, "lora_name": None, "extra_keys": None} for i in range(len(token_ids) // block_size)]


class EventPublisher:
    """A replica's KV event stream: a ZMQ PUB socket at `endpoint`, vLLM's frames (topic, sequence, batch)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.seq = 0

    def publish(self, events: list[dict]) -> None:
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big"), batch(events)))
        self.seq += 1


@dataclass
class StubReplica:
    """An OpenAI-ish replica: answers completions (JSON or 3 SSE chunks), 400 on a body it cannot read,
    500 while `failing`. `gate`: a stream waits for it after its first chunk."""

    name: str
    failing: bool = False
    cached_tokens: int = 0
    gate: threading.Event | None = None
    hold_first: dict | None = None  # shared by stubs: the first request any of them gets waits for its "event"
    hold_all: threading.Event | None = None  # every request waits for it before its first byte
    bodies: list[bytes] = field(default_factory=list)

    def sse_chunks(self) -> list[bytes]:
        return [f'data: {{"replica": "{self.name}", "i": {i}}}\n\n'.encode() for i in range(2)] + \
               [b'data: {"usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}}\n\n',
                b"data: [DONE]\n\n"]

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request):
            raw = await request.body()
            self.bodies.append(raw)
            if self.hold_first is not None and not self.hold_first.setdefault("taken", False):
                self.hold_first["taken"] = True
                while not self.hold_first["event"].is_set():
                    await asyncio.sleep(0.01)
            while self.hold_all is not None and not self.hold_all.is_set():
                await asyncio.sleep(0.01)
            if self.failing:
                return JSONResponse({"error": {"message": "engine dead"}}, status_code=500)
            try:
                body = json.loads(raw)
                assert "prompt" in body or "messages" in body
            except (ValueError, AssertionError):
                return JSONResponse({"error": {"message": f"{self.name}: malformed body", "code": 400}},
                                    status_code=400)
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            return {"replica": self.name, "choices": [{"text": "ok"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 1,
                              "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}}

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
        app.add_api_route("/v1/models", lambda: {"data": [{"id": "smollm2", "owned_by": self.name}]},
                          methods=["GET"])
        return app

    async def _stream(self):
        chunks = self.sse_chunks()
        yield chunks[0]
        if self.gate is not None:
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        for chunk in chunks[1:]:
            yield chunk


@dataclass
class StubSelector:
    """Dynamo's selection service API (`/workers`, `/select`, `/reservations...`), answering `/select`
    with `picks` in turn; every call recorded as (method, path)."""

    picks: list[int]
    overlap: dict = field(default_factory=lambda: {"longest_matched": 64, "gpu": 32, "cpu": 64, "disk": 64})
    calls: list[tuple[str, str]] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def any_call(request: Request, path: str):
            self.calls.append((request.method, "/" + path))
            raw = await request.body()
            self.bodies.append(json.loads(raw) if raw else {})
            if path == "select":
                return {"worker_id": self.picks.pop(0), "dp_rank": 0, "overlap": self.overlap}
            if path == "workers":
                return JSONResponse(self.bodies[-1], status_code=201)
            return {"status": "ok"}

        return app


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def dying_replica():
    """A replica that answers 200 with half a body, then drops the connection; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"rep")
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def dead_url() -> str:
    """A 127.0.0.1 URL nothing listens on: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


@contextmanager
def running(*stubs):
    """Each stub's app served in a thread; yields their URLs."""
    threads = [AppThread(stub.app(), name=f"stub-{i}") for i, stub in enumerate(stubs)]
    try:
        for thread in threads:
            thread.__enter__()
        yield [t.url for t in threads]
    finally:
        for thread in threads:
            thread.__exit__()


@contextmanager
def router_over(urls: list[str], policy: str, *, clock=None, tokenizer=None, selector_url: str | None = None,
                kv_events: list[str] | None = None):
    """The router app over `urls` in a thread; yields (its URL, the Router)."""
    replicas = [Replica(i + 1, url, (kv_events or [None] * len(urls))[i]) for i, url in enumerate(urls)]
    selector = make_selector(policy, replicas, selector_url=selector_url, model_name="smollm2", block_size=4)
    replica_set = ReplicaSet(replicas, clock=clock) if clock is not None else ReplicaSet(replicas)
    router = Router(replica_set, selector, tokenizer=tokenizer)
    with AppThread(create_app(router), name="router") as thread:
        yield thread.url, router


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
