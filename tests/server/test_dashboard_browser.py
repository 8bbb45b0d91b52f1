"""The live dashboard in headless Chromium (Debian's chromium driven by Playwright): after real
requests, the rendered page shows the same numbers as /dashboard/data, and a screenshot is taken."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest


def _post(url: str, body: dict) -> dict:
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_dashboard_renders_the_live_numbers(tiny_model, tmp_path):
    """A small device budget (24 blocks of 8 tokens), so prefixes spill to the DRAM tier and come
    back from it: the page's tier row then has real hits and occupancy to show."""
    from server_support import running, tiny_app

    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.fail("chromium not found: `make test` installs Debian's chromium")
    with running(tiny_app(tiny_model, num_blocks=24)) as url:
        _render(url, tmp_path)


def _render(url: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    prompts = [f"conversation {i}: the dashboard shows what the tiers hold. " * 2 for i in range(4)]
    for prompt in [*prompts, prompts[0]]:  # the last one finds its prefix evicted to DRAM
        _post(url, {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    data = httpx.get(url + "/dashboard/data").json()
    shot = Path(os.environ.get("KVTIER_SCREENSHOT_DIR", tmp_path)) / "dashboard.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--headless=new"])
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto(url + "/dashboard")
        page.wait_for_selector("#tiers tbody tr")
        page.wait_for_function("document.getElementById('model').textContent.length > 0")
        page.screenshot(path=str(shot), full_page=True)
        tier_row = page.inner_text("#tiers tbody tr").split("\t")
        requests = page.inner_text("#requests")
        browser.close()
    dram = data["tiers"][0]
    assert tier_row[0].strip() == "dram"
    # hits / misses / evictions columns, as served by /dashboard/data at that moment (no traffic since)
    assert [int(c) for c in tier_row[5:8]] == [dram["hits"], dram["misses"], dram["evictions"]]
    assert f"finished\t{data['requests']['finished']}" in requests and data["requests"]["finished"] == 5
    # the browser's own requests (its /favicon.ico) are not request errors: only the API's are counted
    assert "errors\t0" in requests and data["requests"]["errors"] == 0
    assert dram["hits"] > 0 and dram["used_bytes"] > 0 and "dram" in data["engine"]["prefix_hit_tokens_by_tier"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
