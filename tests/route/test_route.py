"""`kvtier route` against stub replicas: each policy's choices, SSE passed through as it arrives, failed
replicas retried elsewhere with back-off, the selector down, a malformed body, /metrics."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import StubReplica, StubSelector, dead_url, dying_replica, router_over, running  # noqa: E402

from kvtier.route.app import REPLICA_HEADER  # noqa: E402
from kvtier.route.prompts import chat_token_ids, prompt_token_ids  # noqa: E402
from kvtier.server.tokenizer import ByteTokenizer  # noqa: E402
from kvtier.testing.app_thread import AppThread  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "smollm2", "prompt": "hello", "max_tokens": 4}


def _post(url: str, body=BODY, path: str = "/v1/completions") -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(url + path, timeout=10, **kwargs)


def _answered_by(url: str, num_requests: int, body=BODY) -> list[str]:
    replies = [_post(url, body) for _ in range(num_requests)]
    assert [r.status_code for r in replies] == [200] * num_requests
    return [r.json()["replica"] for r in replies]


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        match = re.match(r"([^{\s#]+)(\{[^}]*\})?\s+(\S+)$", line)
        if match:
            out[(match.group(1), tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))))] = \
                float(match.group(3))
    return out


def test_round_robin_takes_the_replicas_in_turn():
    stubs = [StubReplica("a"), StubReplica("b"), StubReplica("c")]
    with running(*stubs) as urls, router_over(urls, "round-robin") as (url, _):
        assert _answered_by(url, 7) == ["a", "b", "c", "a", "b", "c", "a"]


def test_least_loaded_sends_to_the_replica_with_the_fewest_in_flight():
    gate = threading.Event()
    stubs = [StubReplica("a", gate=gate), StubReplica("b")]
    with running(*stubs) as urls, router_over(urls, "least-loaded") as (url, router):
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as held:
            chunks = held.iter_raw()  # held: a dropped iterator closes the stream
            assert b'"replica": "a"' in next(chunks)  # a tie: the first replica; now it has one in flight
            assert [r.num_in_flight for r in router.replicas.replicas] == [1, 0]
            assert _answered_by(url, 2) == ["b", "b"]
            gate.set()
            assert b"[DONE]" in b"".join(chunks)
        # nothing in flight: the one sent fewer requests (a: 1, b: 2), a tie to the first
        assert _answered_by(url, 4) == ["a", "a", "b", "a"]
        assert [r.num_in_flight for r in router.replicas.replicas] == [0, 0]


def test_dynamo_selects_a_tenant_s_request_under_its_cache_salt():
    """A request's `cache_salt` goes into the selection (Dynamo matches a tenant's blocks under its salt
    only); a request without one selects unsalted; the body reaches the replica as it came."""
    stubs = [StubReplica("a"), StubReplica("b")]
    selector = StubSelector(picks=[1, 2])
    salted = {"model": "smollm2", "prompt": "hello", "cache_salt": "tenant-a"}
    with running(*stubs, selector) as (url_a, url_b, selector_url), \
            router_over([url_a, url_b], "dynamo", tokenizer=ByteTokenizer(), selector_url=selector_url,
                        kv_events=["ipc:///tmp/a.sock", "ipc:///tmp/b.sock"]) as (url, _):
        assert _post(url, salted).json()["replica"] == "a"
        assert _post(url, {"model": "smollm2", "prompt": "hello"}).json()["replica"] == "b"
    selects = [b for (m, p), b in zip(selector.calls, selector.bodies) if p == "/select"]
    assert selects[0]["cache_salt"] == "tenant-a" and "cache_salt" not in selects[1]
    assert selects[0]["token_ids"] == selects[1]["token_ids"] == list(b"hello")
    assert json.loads(stubs[0].bodies[0]) == salted


def test_dynamo_sends_where_the_selector_says_and_books_the_load_there():
    stubs = [StubReplica("a"), StubReplica("b")]
    selector = StubSelector(picks=[2, 2, 1])
    with running(*stubs, selector) as (url_a, url_b, selector_url), \
            router_over([url_a, url_b], "dynamo", tokenizer=ByteTokenizer(), selector_url=selector_url,
                        kv_events=["ipc:///tmp/a.sock", "ipc:///tmp/b.sock"]) as (url, _):
        assert _answered_by(url, 3) == ["b", "b", "a"]
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
        selector.picks.append(1)
        assert _post(url, chat, "/v1/chat/completions").json()["replica"] == "a"
        metrics = _metrics(url)
    # both replicas registered once, each with its KV event endpoint; then per request: select, book,
    # prefill done (first bytes), free
    assert selector.calls[:2] == [("POST", "/workers")] * 2
    assert [b["kv_events_endpoints"] for b in selector.bodies[:2]] == [{"0": "ipc:///tmp/a.sock"},
                                                                       {"0": "ipc:///tmp/b.sock"}]
    per_request = [(m, re.sub(r"[0-9a-f]{32}", "{id}", p)) for m, p in selector.calls[2:]]
    assert per_request == [("POST", "/select"), ("POST", "/reservations"),
                           ("POST", "/reservations/{id}/prefill_complete"), ("DELETE", "/reservations/{id}")] * 4
    ids = {b["selection_id"] for b in selector.bodies[2:] if b}
    assert len(ids) == 4  # one selection id per request, booked under the id it was selected with
    assert all(p.split("/")[2] in ids for _, p in selector.calls[2:] if p.count("/") >= 2)
    selects = [b for (m, p), b in zip(selector.calls, selector.bodies) if p == "/select"]
    # the token ids the replicas compute: the prompt's bytes (the byte tokenizer), the chat template's
    assert selects[0]["token_ids"] == list(b"hello")
    assert selects[3]["token_ids"] == list(b"<user>hi\n<assistant>")
    assert metrics[("kvtier_route_selector_matched_tokens_total",
                    (("policy", "dynamo"), ("replica", stub_name(url_b)), ("tier", "cpu")))] == 2 * 64


def stub_name(url: str) -> str:
    return url.removeprefix("http://")


def test_a_stream_is_passed_through_as_it_arrives():
    gate = threading.Event()
    stub = StubReplica("a", gate=gate)
    with running(stub) as urls, router_over(urls, "round-robin") as (url, _):
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert reply.headers[REPLICA_HEADER] == stub_name(urls[0])
            chunks = reply.iter_raw()
            received = next(chunks)
            assert received == stub.sse_chunks()[0]  # before the replica has sent the rest
            gate.set()
            received += b"".join(chunks)
        assert received == b"".join(stub.sse_chunks())
        metrics = _metrics(url)
    labels = (("policy", "round-robin"), ("replica", stub_name(urls[0])))
    assert metrics[("kvtier_route_cached_tokens_total", labels)] == 5  # from the stream's usage chunk
    assert metrics[("kvtier_route_prompt_tokens_total", labels)] == 7


def test_a_replica_answering_500_is_taken_out_and_retried_with_back_off(clock):
    stubs = [StubReplica("a", failing=True), StubReplica("b")]
    with running(*stubs) as urls, router_over(urls, "round-robin", clock=clock) as (url, router):
        assert _answered_by(url, 4) == ["b", "b", "b", "b"]  # none lost
        assert len(stubs[0].bodies) == 1  # tried once, then out for 1 s
        clock.now += 1.0
        assert _answered_by(url, 2) == ["b", "b"]  # back-off over: retried once, failed, out for 2 s
        assert len(stubs[0].bodies) == 2
        clock.now += 1.5
        assert _answered_by(url, 2) == ["b", "b"] and len(stubs[0].bodies) == 2  # still out
        stubs[0].failing = False
        clock.now += 0.5
        assert _answered_by(url, 4) == ["a", "b", "a", "b"]  # back in service
        metrics = _metrics(url)
    name_a = stub_name(urls[0])
    assert metrics[("kvtier_route_retries_total", (("reason", "answered 500"), ("replica", name_a)))] == 2
    assert metrics[("kvtier_route_replica_up", (("replica", name_a),))] == 1
    assert [r.num_failures for r in router.replicas.replicas] == [0, 0]


def test_a_replica_refusing_connections_loses_no_request(clock):
    stub = StubReplica("b")
    with running(stub) as (url_b,):
        down = dead_url()
        with router_over([down, url_b], "least-loaded", clock=clock) as (url, router):
            assert _answered_by(url, 5) == ["b"] * 5
            first, _ = router.replicas.replicas
            assert router.replicas.is_out(first) and first.num_failures == 1 and first.num_requests == 1
            clock.now += 1.0
            assert _answered_by(url, 1) == ["b"]  # retried after 1 s, refused again: out for 2 s
            assert first.num_failures == 2 and first.out_until == clock.now + 2.0
            metrics = _metrics(url)
    assert metrics[("kvtier_route_retries_total", (("reason", "unreachable: ConnectError"),
                                                   ("replica", stub_name(down))))] == 2
    assert metrics[("kvtier_route_requests_total", (("code", "200"), ("policy", "least-loaded"),
                                                    ("replica", stub_name(url_b))))] == 6


def test_a_replica_dropping_the_connection_mid_reply_loses_no_request(clock):
    stub = StubReplica("b")
    with running(stub) as (url_b,), dying_replica() as dying, \
            router_over([dying, url_b], "round-robin", clock=clock) as (url, router):
        assert _answered_by(url, 3) == ["b", "b", "b"]
        assert router.replicas.replicas[0].num_failures == 1


def test_every_replica_failing_passes_the_last_5xx_through_and_none_in_service_is_a_503(clock):
    stubs = [StubReplica("a", failing=True), StubReplica("b", failing=True)]
    with running(*stubs) as urls, router_over(urls, "round-robin", clock=clock) as (url, _):
        reply = _post(url)
        assert reply.status_code == 500 and reply.json() == {"error": {"message": "engine dead"}}
        assert [len(s.bodies) for s in stubs] == [1, 1]
        reply = _post(url)
        assert reply.status_code == 503 and "no replica is in service" in reply.json()["error"]["message"]


def test_a_selector_that_is_down_falls_back_to_least_loaded_logged_once(caplog):
    stubs = [StubReplica("a"), StubReplica("b")]
    with caplog.at_level(logging.WARNING, logger="kvtier.route"), running(*stubs) as urls, \
            router_over(urls, "dynamo", tokenizer=ByteTokenizer(), selector_url=dead_url()) as (url, _):
        assert _answered_by(url, 4) == ["a", "b", "a", "b"]
        metrics = _metrics(url)
    down = [r for r in caplog.records if "selector is unavailable" in r.getMessage()]
    assert len(down) == 1
    assert metrics[("kvtier_route_selector_fallbacks_total", ())] == 4
    assert metrics[("kvtier_route_requests_total", (("code", "200"), ("policy", "least-loaded"),
                                                    ("replica", stub_name(urls[0]))))] == 2


def test_a_selector_back_up_chooses_again_logged_once_each_way(caplog):
    stubs = [StubReplica("a"), StubReplica("b")]
    selector = StubSelector(picks=[2, 2])
    selector_thread = AppThread(selector.app(), name="selector")  # its port is known; it starts later
    with caplog.at_level(logging.WARNING, logger="kvtier.route"), running(*stubs) as urls, \
            router_over(urls, "dynamo", tokenizer=ByteTokenizer(), selector_url=selector_thread.url,
                        kv_events=["ipc:///tmp/a.sock", "ipc:///tmp/b.sock"]) as (url, _):
        assert _answered_by(url, 2) == ["a", "b"]  # least-loaded meanwhile
        with selector_thread:
            assert _answered_by(url, 2) == ["b", "b"]  # registered at its first answer, then its picks
        metrics = _metrics(url)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("selector is unavailable" in m for m in messages) == 1
    assert sum("selector answers again" in m for m in messages) == 1
    assert selector.calls[:3] == [("POST", "/workers"), ("POST", "/workers"), ("POST", "/select")]
    assert metrics[("kvtier_route_selector_fallbacks_total", ())] == 2


def test_a_stream_refused_with_500_is_streamed_by_another_replica(clock):
    stubs = [StubReplica("a", failing=True), StubReplica("b")]
    with running(*stubs) as urls, router_over(urls, "round-robin", clock=clock) as (url, _):
        reply = _post(url, {**BODY, "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.content == b"".join(stubs[1].sse_chunks())
    assert [len(s.bodies) for s in stubs] == [1, 1]


@pytest.mark.parametrize("policy", ["round-robin", "dynamo"])
@pytest.mark.parametrize("body", [b"{not json", b'{"model": "smollm2"}'])
def test_a_malformed_body_is_the_replica_s_400(policy, body):
    stub = StubReplica("a")
    selector = StubSelector(picks=[])
    with running(stub, selector) as (url_a, selector_url), \
            router_over([url_a], policy, tokenizer=ByteTokenizer(), selector_url=selector_url) as (url, _):
        reply = _post(url, body)
        metrics = _metrics(url)
    assert reply.status_code == 400 and reply.json() == {"error": {"message": "a: malformed body", "code": 400}}
    assert stub.bodies == [body]  # forwarded as it came
    assert ("POST", "/select") not in selector.calls  # no tokens: nothing asked of the selector
    policy_label = "least-loaded" if policy == "dynamo" else policy
    assert metrics[("kvtier_route_requests_total", (("code", "400"), ("policy", policy_label),
                                                    ("replica", stub_name(url_a))))] == 1


def test_metrics_count_requests_and_cached_tokens_per_replica_and_policy():
    stubs = [StubReplica("a", cached_tokens=3), StubReplica("b", cached_tokens=8)]
    with running(*stubs) as urls, router_over(urls, "round-robin") as (url, _):
        _answered_by(url, 5)
        assert httpx.get(url + "/v1/models").json()["data"][0]["owned_by"] in ("a", "b")
        metrics = _metrics(url)
    a, b = (stub_name(u) for u in urls)
    assert metrics[("kvtier_route_requests_total", (("code", "200"), ("policy", "round-robin"), ("replica", a)))] == 3
    assert metrics[("kvtier_route_requests_total", (("code", "200"), ("policy", "round-robin"), ("replica", b)))] == 3
    assert metrics[("kvtier_route_cached_tokens_total", (("policy", "round-robin"), ("replica", a)))] == 3 * 3
    assert metrics[("kvtier_route_cached_tokens_total", (("policy", "round-robin"), ("replica", b)))] == 2 * 8
    assert metrics[("kvtier_route_in_flight", (("replica", a),))] == 0


def test_token_ids_are_the_replicas_own():
    tok = ByteTokenizer()
    assert prompt_token_ids(tok, "/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids(tok, "/v1/completions", {"prompt": ["ab", "cd"]}) == [97, 98]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert chat_token_ids(tok, parts) == list(b"<user>a\nb\n<assistant>")
    assert chat_token_ids(tok, {**parts, "add_generation_prompt": False}) == list(b"<user>a\nb\n")
    assert prompt_token_ids(tok, "/v1/chat/completions", {"messages": "nope"}) is None
    assert prompt_token_ids(None, "/v1/completions", BODY) is None


@pytest.mark.parametrize(("args", "message"), [
    ([], "needs --selector URL"),
    (["--selector", "http://127.0.0.1:1"], "needs --kv-events ENDPOINT per replica"),
    (["--selector", "http://127.0.0.1:1", "--kv-events", "ipc:///tmp/a", "--kv-events", "ipc:///tmp/b"],
     "--kv-events: one per --replica"),
    (["--selector", "http://127.0.0.1:1", "--kv-events", "ipc:///tmp/a"], "needs --tokenizer"),
])
def test_the_dynamo_policy_without_what_it_needs_is_a_one_line_error(capsys, args, message):
    from kvtier.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["route", "--replica", "http://127.0.0.1:1", "--policy", "dynamo", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1
