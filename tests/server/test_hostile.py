"""Hostile requests against a real uvicorn, each sent while a normal stream runs: the stream always
completes with its own text; the hostile request gets a 400 (or its own error, or the greedy text
that its tiny temperature / top_p means). Also: bodies cut short, a client that leaves a
non-streaming request, and max_tokens beyond the context."""

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from server_support import running, tiny_app

PROMPT = "Speak, Horatio."
STREAM_TOKENS = 48
STEP_DELAY_S = 0.01  # every engine step sleeps this long: a 48-token stream outlasts a short request


@pytest.fixture(scope="module")
def server(tiny_model):
    """(url, app, steps): `steps` records the request ids of every engine step."""
    app = tiny_app(tiny_model)
    runner = app.state.kvtier.engine.engine.runner
    run, steps = runner.run, []

    def slow_recording_run(chunks):
        steps.append({chunk.seq.request_id for chunk in chunks})
        time.sleep(STEP_DELAY_S)
        return run(chunks)
    runner.run = slow_recording_run
    with running(app) as url:
        yield url, app, steps


@pytest.fixture(scope="module")
def greedy(server) -> dict[str, str]:
    """The greedy text of the stream's prompt (STREAM_TOKENS) and of PROMPT (8 tokens), each alone."""
    url, _, _ = server
    body = {"model": "tiny", "prompt": "To be, or not to be", "max_tokens": STREAM_TOKENS, "temperature": 0}
    short = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return {"stream": httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"],
            "short": httpx.post(url + "/v1/completions", json=short, timeout=60).json()["choices"][0]["text"]}


def sse(url: str, body: dict) -> tuple[str, list[dict]]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def alongside_a_stream(server, greedy, send):
    """Start a normal greedy stream, call `send()` once it is in the engine, check the stream's text;
    returns (send's result, the stream's request id)."""
    url, app, _ = server
    engine = app.state.kvtier.engine.engine
    got = {}
    body = {"model": "tiny", "prompt": "To be, or not to be", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "stream": True}
    thread = threading.Thread(target=lambda: got.update(zip(("text", "events"), sse(url, body))))
    thread.start()
    for _ in range(1000):  # bounded wait for the stream to be admitted; not a timing assertion
        if engine.request_ids():
            break
        time.sleep(0.005)
    result = send()
    thread.join(timeout=60)
    assert got["text"] == greedy["stream"]
    assert got["events"][-1]["choices"][0]["finish_reason"] == "length"
    return result, got["events"][0]["id"]


def post(url: str, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" escapes
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


SHORT = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8}


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                    {"temperature": 1.0, "top_p": 1e-300}], ids=["t1e-300", "t5e-324", "top_p1e-300"])
def test_tiny_temperature_or_top_p_is_greedy_beside_a_stream(server, greedy, fields):
    url, _, steps = server
    response, stream_id = alongside_a_stream(server, greedy, lambda: post(url, {**SHORT, **fields}))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy["short"]
    # they really shared steps (a response's first choice is engine request "<id>-0-0")
    assert any({stream_id + "-0-0", response.json()["id"] + "-0-0"} <= step for step in steps)


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}
DEEP = b'{"model": "tiny", "prompt": ' + b"[" * 60_000 + b"]" * 60_000 + b"}"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**SHORT, "temperature": 1.0, "seed": 2**64}, "seed"),
    ("/v1/completions", {**SHORT, "temperature": 1.0, "seed": -2**63 - 1}, "seed"),
    ("/v1/completions", {**SHORT, "cache_salt": "\ud800"}, "cache_salt"),
    ("/v1/completions", {**SHORT, "prompt": "to \udc00"}, "prompt"),
    ("/v1/completions", {**SHORT, "stop": "\ud800"}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "cache_salt": "\udfff"}, "cache_salt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": NaN}', "top_p"),
    ("/v1/completions", DEEP, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', None),
], ids=["seed2^64", "seed-2^63-1", "salt", "prompt", "stop", "chat", "chat-salt", "t-nan", "p-nan", "deep",
        "5000digits", "utf8"])
def test_hostile_values_get_a_400_beside_a_stream(server, greedy, path, body, param):
    url, _, _ = server
    response, _ = alongside_a_stream(server, greedy, lambda: post(url, body, path))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_seeds_torch_accepts_are_served(server):
    url, _, _ = server
    for seed in (2**64 - 1, -2**63):
        bodies = [post(url, {**SHORT, "temperature": 1.0, "seed": seed}).json() for _ in range(2)]
        assert bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**SHORT, "max_tokens": 10_000}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10_000}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10_000}, "max_completion_tokens"),
])
def test_max_tokens_beyond_the_context_is_rejected_not_clamped(server, path, body, param):
    url, _, _ = server
    response = post(url, body, path)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert "context is 512 tokens" in error["message"] and "Rejected, not clamped" in error["message"]
    room = int(error["message"].rsplit("at most ", 1)[1].split()[0])
    fits = post(url, {**body, param: room}, path)
    assert fits.status_code == 200


def test_a_request_the_sampler_fails_gets_its_own_error(server, greedy, monkeypatch):
    import kvtier.engine.model_runner as model_runner

    real_sample = model_runner.sample

    def fragile(logits, temperatures, top_ps, generators, **filters):
        if bool((top_ps == 0.25).any()):  # the marked request's row
            raise RuntimeError("sampler exploded")
        return real_sample(logits, temperatures, top_ps, generators, **filters)
    monkeypatch.setattr(model_runner, "sample", fragile)
    url, app, _ = server
    marked = {**SHORT, "temperature": 1.0, "top_p": 0.25}
    response, _ = alongside_a_stream(server, greedy, lambda: post(url, marked))
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "sampling failed: sampler exploded", "type": "server_error",
                                         "param": None, "code": None}
    (text, events), _ = alongside_a_stream(server, greedy, lambda: sse(url, {**marked, "stream": True}))
    assert text == "" and events[-1]["error"]["message"] == "sampling failed: sampler exploded"
    assert app.state.kvtier.metrics.totals.num_finished_by_reason["error"] == 2


def test_a_non_streaming_client_that_leaves_aborts_its_request(server):
    url, app, _ = server
    engine, totals = app.state.kvtier.engine.engine, app.state.kvtier.metrics.totals
    aborted, tokens = totals.num_finished_by_reason.get("abort", 0), totals.num_generation_tokens
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s and closes the connection
        httpx.post(url + "/v1/completions", json={**SHORT, "max_tokens": 400, "temperature": 0}, timeout=0.3)
    for _ in range(1000):  # bounded wait for the server to notice and the engine to drop it
        if totals.num_finished_by_reason.get("abort", 0) > aborted and not engine.request_ids():
            break
        time.sleep(0.01)
    assert totals.num_finished_by_reason.get("abort", 0) == aborted + 1
    assert engine.request_ids() == []
    generated = totals.num_generation_tokens - tokens
    assert generated < 400 // 2, generated  # 400 tokens take >= 4 s of STEP_DELAY_S alone


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _send_raw(url: str, data: bytes) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        while sock.recv(4096):  # drain until the server closes
            continue


def test_truncated_bodies_and_bad_chunking_are_dropped_quietly(server):
    url, app, _ = server
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)  # uvicorn configured its loggers at start
    errors = app.state.kvtier.metrics.totals.num_errors_by_status
    before = errors.get("499", 0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    try:
        _send_raw(url, head + b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", "pro')      # cut short
        _send_raw(url, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nZZ\r\nxx")  # bad chunk size
        _send_raw(url, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod")                # chunked, cut short
        for _ in range(1000):  # bounded wait until the app saw all three go
            if errors.get("499", 0) == before + 3:
                break
            time.sleep(0.01)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert errors.get("499", 0) == before + 3
    assert not [m for m in records.messages if "Exception in ASGI application" in m], records.messages
    assert post(url, {**SHORT, "temperature": 0}).json()["choices"][0]["text"]
