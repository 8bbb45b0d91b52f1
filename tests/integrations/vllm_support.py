"""A real vLLM OpenAI server (the CPU build in `.venv-vllm`, made by `make vllm`) in a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvtier import models
from kvtier.services import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK_TOKENS = 32  # the CPU attention backend wants a multiple of 32
START_TIMEOUT_S = 420


def kv_transfer_config(tiers: list[str], codec: str = "raw") -> str:
    return json.dumps({"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"tiers": tiers, "codec": codec}})


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on the converted SmolLM2, fp32, 1 GiB of KV."""

    def __init__(self, log_path: Path, tiers: list[str] | None = None) -> None:
        self.port = free_port()
        self.log_path = log_path
        model_dir = models.cache_dir() / "smollm2-135m-instruct"
        self.argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", "smollm2", "--dtype", "float32", "--block-size", str(BLOCK_TOKENS),
                     "--enforce-eager", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(self.port)]
        if tiers is not None:
            self.argv += ["--kv-transfer-config", kv_transfer_config(tiers)]
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)

    def __enter__(self) -> VllmServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT / "src")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM did not start within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def complete(self, prompt: str, *, max_tokens: int = 16, cache_salt: str | None = None) -> dict:
        """One greedy completion: {"text", "token_ids", "kvtier_hit_tokens" (by tier)}."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        reply = self.client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        choice = data["choices"][0]
        params = data.get("kv_transfer_params") or {}
        return {"text": choice["text"], "token_ids": choice.get("token_ids"),
                "prompt_token_ids": choice.get("prompt_token_ids"),
                "kvtier_hit_tokens": params.get("kvtier_hit_tokens", {})}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample over the series whose labels include `labels`."""
        total = 0.0
        for line in self.client.get("/metrics").text.splitlines():
            match = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not match or match.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
        return total


def wait_stable_count(directory: Path, min_count: int, timeout_s: float = 60) -> int:
    """Waits until `directory` holds at least `min_count` block files and their number stops growing."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        count = sum(1 for p in directory.rglob("*") if p.is_file())
        if count >= min_count and count == last:
            return count
        last = count
        time.sleep(1.0)
    return last
