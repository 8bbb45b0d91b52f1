"""Start a real vLLM OpenAI server (the CPU build in `.venv-vllm`, `make vllm`) in a subprocess, with
or without kvtier's connector; used by `kvtier bench vllm` and the tests. No vLLM import here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvtier.services import free_port

ROOT = Path(__file__).resolve().parents[4]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
BLOCK_TOKENS = 32  # vLLM's CPU attention wants a multiple of 32
START_TIMEOUT_S = 420


def kvtier_transfer_config(tiers: list[str], codec: str = "raw", load: str = "layerwise") -> dict:
    """The `--kv-transfer-config` that loads kvtier's connector on `tiers`."""
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": tiers, "codec": codec, "load": load}}


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a local model directory (fp32, eager)."""

    def __init__(self, model_dir: Path, log_path: Path, *, kv_transfer: dict | None = None,
                 extra_args: tuple[str, ...] = (), kv_space_gib: int = 1, max_model_len: int = 2048) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.kv_space_gib = kv_space_gib
        self.argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", "smollm2", "--dtype", "float32", "--block-size", str(BLOCK_TOKENS),
                     "--enforce-eager", "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(self.port),
                     *extra_args]
        if kv_transfer is not None:
            self.argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=600)

    def __enter__(self) -> VllmServer:
        if not VLLM_PYTHON.exists():
            raise FileNotFoundError(f"{VLLM_PYTHON} not found: `make vllm` creates it")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib), "PYTHONPATH": str(ROOT / "src")}
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
        self.client.close()
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

    def complete(self, prompt: str | list[int], *, max_tokens: int = 16, cache_salt: str | None = None) -> dict:
        """One greedy completion: text, token ids, prompt token ids, and kvtier's hits by tier."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        reply = self.client.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"vLLM answered {reply.status_code}: {reply.text}")
        data = reply.json()
        choice = data["choices"][0]
        params = data.get("kv_transfer_params") or {}
        return {"text": choice["text"], "token_ids": choice.get("token_ids"),
                "prompt_token_ids": choice.get("prompt_token_ids"),
                "kvtier_hit_tokens": params.get("kvtier_hit_tokens", {})}

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every Prometheus sample: (name, sorted labels) -> value."""
        out = {}
        for line in self.client.get("/metrics").text.splitlines():
            match = re.match(r"([^{\s#]+)(\{[^}]*\})?\s+(\S+)$", line)
            if match:
                labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")))
                out[(match.group(1), labels)] = float(match.group(3))
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a sample over the series whose labels include `labels`."""
        return sum(value for (found, found_labels), value in self.metrics().items()
                   if found == name and all((k, v) in found_labels for k, v in labels.items()))
