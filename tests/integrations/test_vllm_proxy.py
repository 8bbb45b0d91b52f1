"""kvtier's disaggregation proxy against two stand-in servers (no vLLM): the prefill server gets the prompt
with one token and no stream, the decode server the request unchanged; a dead prefill server fails nothing."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from kvtier.integrations.vllm.proxy import ProxyThread, prefill_body
from kvtier.ports import free_port


class StandIn:
    """A server answering completions with `reply`, recording what it got."""

    def __init__(self, reply: dict) -> None:
        self.got: list[dict] = []
        app = FastAPI()

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> dict:
            self.got.append(await request.json())
            return reply

        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> StandIn:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_the_prefill_gets_one_token_unstreamed():
    body = {"prompt": "x", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1}
    assert prefill_body({"messages": [], "max_completion_tokens": 9}) == \
        {"messages": [], "max_tokens": 1, "max_completion_tokens": 1}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_and_a_dead_prefill_fails_nothing(path):
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    with StandIn({"from": "prefill"}) as prefill, StandIn({"from": "decode"}) as decode:
        with ProxyThread(prefill.url, decode.url) as proxy:
            reply = httpx.post(proxy.url + path, json=body, timeout=30)
            assert reply.status_code == 200 and reply.json() == {"from": "decode"}
            assert prefill.got == [{**body, "max_tokens": 1}] and decode.got == [body]
            prefill.__exit__()  # the producer dies
            reply = httpx.post(proxy.url + path, json=body, timeout=30)
            assert reply.status_code == 200 and reply.json() == {"from": "decode"}
            assert decode.got == [body, body]
            stats = proxy.stats()
            assert (stats["prefills"], stats["prefill_failures"]) == (2, 1)
