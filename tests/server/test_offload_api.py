"""`kvtier serve --kv-offload`: a request longer than the device budget is served (issue 18), exact
mode with the same text as a server whose budget holds it whole; per-request `kv_offload`; host room."""

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_support import running, tiny_app  # noqa: E402

DEVICE_BLOCKS = 12    # 96 tokens of 8, half of it the fetch area: every prompt below is longer
PROMPT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
          "that lour'd upon our house in the deep bosom of the ocean buried. ")  # 158 bytes = 158 tokens


def post(url, body, path="/v1/completions"):
    return httpx.post(url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def servers(tiny_model):
    """(offloading server, whole-on-device reference server)."""
    with running(tiny_app(tiny_model, DEVICE_BLOCKS, kv_offload="exact", offload_fetch_blocks=3)) as url, \
            running(tiny_app(tiny_model, 96)) as ref_url:
        yield url, ref_url


def test_a_request_longer_than_the_device_is_served_exactly(servers):
    url, ref_url = servers
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    got, ref = post(url, body).json(), post(ref_url, body).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    offload = got["choices"][0]["kvtier_offload"]
    assert offload["mode"] == "exact" and offload["host_kv_bytes"] > 0 and offload["fetched_bytes"] > 0
    assert 0 < offload["peak_device_kv_bytes"] <= 3 * 4096  # 1 sink + 2 recent blocks of the tiny layout
    assert "kvtier_offload" not in ref["choices"][0]
    short = post(url, {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}).json()
    assert "kvtier_offload" not in short["choices"][0]  # fits the device: not offloaded


def test_the_next_turn_over_a_long_prompt_reuses_it(servers):
    """A long prompt sent before, then extended (a chat's next turn): the second request finds the first's
    full blocks cached (sink from the device or DRAM, the middle pinned in DRAM) and computes only its
    new tail; the text equals the reference server's."""
    url, ref_url = servers
    post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    body = {"model": "tiny", "prompt": PROMPT + "Grim-visaged war hath smooth'd his wrinkled front.", "max_tokens": 16,
            "temperature": 0}
    got, ref = post(url, body).json(), post(ref_url, body).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) // 8 * 8  # its full blocks
    assert got["choices"][0]["kvtier_offload"]["host_kv_bytes"] > 0


def test_a_restarted_server_reuses_a_long_prompt_from_the_ssd(tiny_model, servers, tmp_path):
    """A server on DRAM + SSD serves a long prompt, stops; a new one on the same SSD directory (empty DRAM)
    gets the same prompt: its prefix comes from the SSD (the host blocks read by the transfer worker into
    DRAM slots), only the tail is computed, and the text equals the whole-on-device reference's."""
    _, ref_url = servers
    tiers = ["dram:4MiB", f"ssd:{tmp_path}:64MiB"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}

    def serve_once():
        with running(tiny_app(tiny_model, DEVICE_BLOCKS, tiers=tiers, kv_offload="exact",
                              offload_fetch_blocks=3)) as url:
            response = post(url, body).json()
            metrics = httpx.get(url + "/metrics").text
        return response, metrics

    first, _ = serve_once()
    second, metrics = serve_once()
    ref = post(ref_url, body).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == ref["choices"][0]["text"]
    cached = (len(PROMPT) - 1) // 8 * 8
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert f'kvtier_prefix_hit_tokens_total{{tier="ssd"}} {float(cached)}' in metrics
    assert second["choices"][0]["kvtier_offload"]["host_kv_bytes"] > 0


def test_streaming_chat_long_request_matches(servers):
    url, ref_url = servers
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0,
            "stream": True}

    def text(base):
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        import json
        return "".join(json.loads(line)["choices"][0]["delta"].get("content", "") for line in lines)
    assert text(url) == text(ref_url)


def test_per_request_kv_offload(servers):
    url, _ = servers
    sparse = post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                        "kv_offload": "sparse:2"}).json()
    assert sparse["choices"][0]["kvtier_offload"]["mode"] == "sparse:2"
    bad = post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "kv_offload": "sometimes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_offload"
    off = post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "kv_offload": "off"})
    assert off.status_code == 400 and off.json()["error"]["code"] == "context_length_exceeded"


def test_offload_on_a_server_without_it_is_refused(servers):
    _, ref_url = servers
    response = post(ref_url, {"model": "tiny", "prompt": "hello", "max_tokens": 4, "kv_offload": "exact"})
    error = response.json()["error"]
    assert response.status_code == 400 and "--kv-offload" in error["message"] and error["param"] == "kv_offload"


def test_metrics_show_offload(servers):
    url, _ = servers
    post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    text = httpx.get(url + "/metrics").text
    assert f"kvtier_device_kv_bytes {float(DEVICE_BLOCKS * 4096)}" in text  # arena + fetch area == the budget here
    assert 'kvtier_kv_offload{mode="exact"} 1.0' in text
    fetched = [line for line in text.splitlines() if line.startswith("kvtier_offload_fetched_bytes_total")]
    assert fetched and float(fetched[0].split()[-1]) > 0
    data = httpx.get(url + "/dashboard/data").json()["engine"]
    assert data["kv_offload"] == "exact" and data["offload_fetched_bytes"] > 0


def test_host_room_too_small_is_a_400(tiny_model):
    with running(tiny_app(tiny_model, DEVICE_BLOCKS, kv_offload="exact", offload_fetch_blocks=3,
                          dram="40KiB")) as url:  # 9 host slots of 4160 B
        response = post(url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 24})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "host_memory_exhausted" and "DRAM tier" in error["message"]
