"""The HTTP API against a real uvicorn on 127.0.0.1: httpx and the official `openai` client."""

import json
import time

import httpx
import openai
import pytest
from server_support import running, tiny_app


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


def sse_text(url, path, body) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    key = "text" if chunks[0]["object"] == "text_completion" else None
    text = "".join(ch["text"] if key else ch["delta"].get("content", "") for ch in choices)
    return text, chunks


def test_health_models_and_openai_client(tiny_server):
    url, _ = tiny_server
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="To be, or not to be", max_tokens=12, temperature=0)
    assert done.usage.prompt_tokens == 19 and done.usage.completion_tokens == 12
    assert done.choices[0].finish_reason == "length"
    text, chunks = sse_text(url, "/v1/completions", {"model": "tiny", "prompt": "To be, or not to be",
                                                     "max_tokens": 12, "temperature": 0, "stream": True})
    assert text == done.choices[0].text and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_equals_chat_json(tiny_server):
    url, _ = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Speak, Horatio."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 == whole.usage.completion_tokens


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "5"}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), "prompt"),
    (json.dumps({"model": "tiny", "prompt": [1, 999]}).encode(), "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x" * 600}).encode(), "prompt"),
    (json.dumps({"prompt": "x"}).encode(), "model"),
])
def test_bad_completion_requests_get_openai_errors(tiny_server, body, param):
    url, _ = tiny_server
    response = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_too_long_prompt_is_context_length_exceeded(tiny_server):
    url, _ = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 600}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    bad_chat = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"].startswith("messages")
    missing = httpx.get(url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_cache_salt_isolates_prefixes(tiny_server):
    url, _ = tiny_server
    prompt = "Now is the winter of our discontent made glorious summer"  # 56 bytes: 6 full blocks usable
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = post(url, "/v1/completions", {**body, "cache_salt": "alice"}).json()
    again = post(url, "/v1/completions", {**body, "cache_salt": "alice"}).json()
    other = post(url, "/v1/completions", {**body, "cache_salt": "bob"}).json()
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert cached == [0, 48, 0]
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == other["choices"][0]["text"]


def test_metrics_and_dashboard(tiny_server):
    url, _ = tiny_server
    post(url, "/v1/completions", {"model": "tiny", "prompt": "metrics please", "max_tokens": 3, "temperature": 0})
    text = httpx.get(url + "/metrics").text
    for name in ("kvtier_time_to_first_token_seconds_count", "kvtier_inter_token_latency_seconds_bucket",
                 'kvtier_tier_hits_total{tier="dram"}', "kvtier_requests_running", "kvtier_device_blocks_total 96.0",
                 'kvtier_requests_finished_total{finish_reason="length"}', "kvtier_prefix_hit_tokens_total",
                 'kvtier_device_kv_codec{kv_codec="raw"} 1.0', "kvtier_device_block_bytes",
                 "kvtier_requests_waiting_for_kv 0.0", "kvtier_step_tier_io_seconds_total",
                 'kvtier_transfer_seconds_total{direction="load"}', 'kvtier_transfer_seconds_total{direction="store"}'):
        assert name in text, name
    ttft_count = [line for line in text.splitlines() if line.startswith("kvtier_time_to_first_token_seconds_count")]
    assert float(ttft_count[0].split()[-1]) >= 1
    page = httpx.get(url + "/dashboard")
    assert page.status_code == 200 and "dashboard/data" in page.text
    data = httpx.get(url + "/dashboard/data").json()
    assert data["model"] == "tiny" and [t["name"] for t in data["tiers"]] == ["dram"]
    assert data["engine"]["num_device_blocks_total"] == 96 and data["requests"]["finished"] >= 1
    assert data["engine"]["kv_codec"] == "raw" and data["engine"]["device_block_bytes"] > 0


def test_only_api_requests_errors_are_counted(tiny_model):
    """A browser on /dashboard also asks for /favicon.ico (served) and other icons (404): not request errors."""
    with running(tiny_app(tiny_model)) as url:
        for _ in range(2):
            post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        icon = httpx.get(url + "/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
        assert httpx.get(url + "/apple-touch-icon.png").status_code == 404
        assert httpx.post(url + "/dashboard").status_code == 405
        assert httpx.get(url + "/dashboard/data").json()["requests"]["errors"] == 0
        assert httpx.get(url + "/v1/nothing").status_code == 404                          # API paths count
        assert httpx.post(url + "/v1/completions", json={"model": "tiny"}).status_code == 400
        assert httpx.get(url + "/v1/completions").status_code == 405
        data = httpx.get(url + "/dashboard/data").json()["requests"]
        assert (data["finished"], data["errors"]) == (2, 3)
        metrics = httpx.get(url + "/metrics").text
        assert [line for line in metrics.splitlines() if line.startswith("kvtier_request_errors_total")] == [
            'kvtier_request_errors_total{status="400"} 1.0', 'kvtier_request_errors_total{status="404"} 1.0',
            'kvtier_request_errors_total{status="405"} 1.0']


def test_client_disconnect_mid_stream_aborts_only_that_request(tiny_server):
    url, app = tiny_server
    engine = app.state.kvtier.engine.engine
    body = {"model": "tiny", "prompt": "a long answer, please", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        first = next(line for line in response.iter_lines() if line)
        assert first.startswith("data: ")
    for _ in range(500):  # wait (bounded) for the server to notice; not a timing assertion
        if not engine.request_ids():
            break
        time.sleep(0.02)
    assert engine.request_ids() == []
    after = post(url, "/v1/completions", {"model": "tiny", "prompt": "still there?", "max_tokens": 5, "temperature": 0})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
    assert app.state.kvtier.metrics.totals.num_finished_by_reason.get("abort") == 1
    assert engine.stats().num_running == 0


def test_stop_string_cuts_the_text(tiny_server):
    url, _ = tiny_server
    body = {"model": "tiny", "prompt": "Friends, Romans, countrymen", "max_tokens": 40, "temperature": 0}
    full = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    clean = [i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2] not in full[:i]]
    assert clean, full
    stop = full[clean[0]:clean[0] + 2]
    cut = post(url, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == full[:clean[0]] and cut["finish_reason"] == "stop"
    streamed, chunks = sse_text(url, "/v1/completions", {**body, "stop": stop, "stream": True})
    assert streamed == full[:clean[0]] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_without_max_tokens_is_bounded_by_the_budget(tiny_server):
    url, app = tiny_server
    engine = app.state.kvtier.engine.engine
    assert engine.max_request_tokens == 512  # min(context 512, 96 blocks x 8)
    r = post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                           "temperature": 0, "stop": "\n\n\n\n"})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 512


def test_int8_resident_server_answers_like_its_engine(tiny_model):
    from server_support import BLOCK, running, tiny_app

    from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
    from kvtier.engine.arena import arena_block_bytes
    from kvtier.server.tokenizer import ByteTokenizer

    layout = tiny_model.kv_layout(BLOCK)
    prompt = "Now is the winter of our discontent"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    offline = LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=96 * layout.block_bytes, block_tokens=BLOCK,
                                                 kv_codec="int8"))
    tok = ByteTokenizer()
    [expected] = offline.generate([tok.encode(prompt)], SamplingParams(max_tokens=12))
    with running(tiny_app(tiny_model, kv_codec="int8")) as url:
        answer = post(url, "/v1/completions", body).json()
        assert answer["choices"][0]["text"] == tok.decode(expected)
        metrics = httpx.get(url + "/metrics").text
        assert 'kvtier_device_kv_codec{kv_codec="int8"} 1.0' in metrics
        # the raw server's 96 blocks' bytes, cut into int8 block slots: 3.2x as many
        assert f"kvtier_device_blocks_total {96 * layout.block_bytes // arena_block_bytes(layout, 'int8')}.0" in metrics
