"""`kvtier route --policy dynamo` against the real NVIDIA Dynamo selection service (`.venv-dynamo`, in a network
namespace of its own where root allows) and stub replicas: the router speaks its 1.6.1 API (register,
select, book, prefill done, free) and the load it books steers the next request."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import StubReplica, router_over, running  # noqa: E402

from kvtier.server.tokenizer import ByteTokenizer  # noqa: E402
from kvtier.testing.dynamo import DYNAMO_PYTHON  # noqa: E402
from kvtier.testing.dynamo_select import DynamoSelectService  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason="no .venv-dynamo (Dynamo's selection service): `make dynamo` creates it "
                              "(`make test` does)"),
]

PROMPT = {"model": "smollm2", "prompt": "the same prompt, long enough for two blocks", "max_tokens": 4}


def test_the_real_selector_books_each_request_s_load_and_frees_it(tmp_path, caplog):
    gate = threading.Event()
    stubs = [StubReplica("a", gate=gate), StubReplica("b", gate=gate)]
    with DynamoSelectService(tmp_path / "select.log") as selector, running(*stubs) as urls, \
            router_over(urls, "dynamo", tokenizer=ByteTokenizer(), selector_url=selector.url,
                        kv_events=[f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock"]) as (url, router):
        workers = httpx.get(selector.url + "/workers").json()
        assert sorted(w["worker_id"] for w in workers) == [1, 2]
        with httpx.stream("POST", url + "/v1/completions", json={**PROMPT, "stream": True}, timeout=10) as held:
            chunks = held.iter_raw()
            first = next(chunks)
            # nothing cached anywhere: the booked load on the first replica sends the same prompt elsewhere
            busy = "a" if b'"replica": "a"' in first else "b"
            reply = httpx.post(url + "/v1/completions", json=PROMPT, timeout=10)
            assert reply.status_code == 200 and reply.json()["replica"] != busy
            gate.set()
            assert b"[DONE]" in b"".join(chunks)
        assert not router.selector_down
        metrics = httpx.get(url + "/metrics").text
    assert 'kvtier_route_requests_total{code="200",policy="dynamo"' in metrics
    assert "kvtier_route_selector_fallbacks_total 0.0" in metrics
