"""Start a real vLLM OpenAI server (the CPU build in `.venv-vllm`, `make vllm`) in a subprocess, with
or without kvtier's connector, and LMCache's multi-process cache server for the LMCache comparison
(`.venv-lmcache`, `make lmcache`); used by `kvtier bench vllm` / `bench long` and the tests. No vLLM import here.
`DisaggSystem` puts the product's disaggregation proxy (`integrations.vllm.proxy.ProxyThread`) in front of its
two servers: the proxy is product (users run it), this launcher only borrows it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvtier.ports import free_port, free_ports, wait_port

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("KVTIER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
BLOCK_TOKENS = 32  # vLLM's CPU attention wants a multiple of 32
START_TIMEOUT_S = 420
# vLLM + LMCache in an environment of their own: LMCache pins numpy, protobuf, grpcio and
# OpenTelemetry below what `.venv-vllm` has.
LMCACHE_PYTHON = Path(os.environ.get("KVTIER_LMCACHE_PYTHON", ROOT / ".venv-lmcache" / "bin" / "python"))


def kvtier_transfer_config(tiers: list[str], codec: str = "raw", load: str = "layerwise",
                           role: str = "kv_both") -> dict:
    """The `--kv-transfer-config` that loads kvtier's connector on `tiers`; `role`: "kv_both", or
    "kv_producer" / "kv_consumer" for prefill/decode disaggregation (`DisaggSystem`)."""
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tiers": tiers, "codec": codec, "load": load}}


class LmcacheServer:
    """LMCache's multi-process cache server on CPU: a DRAM store (its L1, a shared-memory pool) that
    vLLM's `LMCacheMPConnector` reaches over ZMQ. A CPU worker can only use the engine-driven transfer
    (the worker copies KV into the pool; the server's default, LMCache-driven, reads device memory
    through CUDA IPC), so the server offers that mode."""

    def __init__(self, log_path: Path, *, l1_gib: int = 2, chunk_tokens: int = 64) -> None:
        self.port, self.http_port = free_ports(2)
        self.log_path = log_path
        self.shm_name = f"lmcache_l1_pool_kvtier_{self.port}"
        self.argv = [str(LMCACHE_PYTHON), "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1",
                     "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                     "--chunk-size", str(chunk_tokens), "--l1-size-gb", str(l1_gib), "--no-l1-use-lazy",
                     "--shm-name", self.shm_name, "--supported-transfer-mode", "engine_driven",
                     "--eviction-policy", "LRU"]
        self.proc: subprocess.Popen | None = None

    def transfer_config(self) -> dict:
        """The `--kv-transfer-config` that connects vLLM to this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}}

    def __enter__(self) -> LmcacheServer:
        if not LMCACHE_PYTHON.exists():
            raise FileNotFoundError(f"{LMCACHE_PYTHON} not found: `make lmcache` creates it")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"}, start_new_session=True)
        # the HTTP port opens last, after the ZMQ server and the L1 pool are up
        wait_port(self.http_port, self.proc, timeout_s=START_TIMEOUT_S)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _stop_group(self.proc, timeout_s=30)
        Path("/dev/shm", self.shm_name).unlink(missing_ok=True)  # the pool outlives a killed server


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a local model directory (fp32, eager);
    `python` is the environment's interpreter (`.venv-vllm`, or `.venv-lmcache` for LMCache)."""

    def __init__(self, model_dir: Path, log_path: Path, *, kv_transfer: dict | None = None,
                 extra_args: tuple[str, ...] = (), kv_space_gib: int = 1, max_model_len: int = 2048,
                 python: Path = VLLM_PYTHON, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.kv_space_gib = kv_space_gib
        self.python = python
        self.env = env or {}  # more environment (VLLM_CPU_OMP_THREADS_BIND: the replicas of `bench route`)
        self.argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--served-model-name", "smollm2", "--dtype", "float32", "--block-size", str(BLOCK_TOKENS),
                     "--enforce-eager", "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(self.port),
                     *extra_args]
        if kv_transfer is not None:
            self.argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=600)

    def __enter__(self) -> VllmServer:
        if not self.python.exists():
            raise FileNotFoundError(f"{self.python} not found: `make vllm` (or `make lmcache`) creates it")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib), "PYTHONPATH": str(ROOT / "src"),
               **self.env}
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
        if self.proc is not None:
            _stop_group(self.proc, timeout_s=60)

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


class DisaggSystem:
    """Prefill/decode disaggregation on one host: a `kv_producer` vLLM and a `kv_consumer` vLLM sharing
    `tiers` (a pool, Redis, `shm:`), started one after the other, behind kvtier's proxy (`proxy.py`, in a
    thread of this process). `url`, `complete` and `metrics` are the proxy's (metrics: the consumer's)."""

    def __init__(self, model_dir: Path, log_dir: Path, tiers: list[str], *, extra_args: tuple[str, ...] = (),
                 max_model_len: int = 2048, load: str = "layerwise") -> None:
        def server(role: str) -> VllmServer:
            return VllmServer(model_dir, log_dir / f"{role}.log", extra_args=extra_args, max_model_len=max_model_len,
                              kv_transfer=kvtier_transfer_config(tiers, load=load, role=role))
        self.producer, self.consumer = server("kv_producer"), server("kv_consumer")
        self.proxy = None
        self.client: httpx.Client | None = None
        self.url = ""

    def __enter__(self) -> DisaggSystem:
        from kvtier.integrations.vllm.proxy import ProxyThread

        try:
            self.producer.__enter__()
            self.consumer.__enter__()
            self.proxy = ProxyThread(self.producer.url, self.consumer.url).__enter__()
        except BaseException:
            self.__exit__()
            raise
        self.url = self.proxy.url
        self.client = httpx.Client(base_url=self.url, timeout=600)
        return self

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        if self.proxy is not None:
            self.proxy.__exit__()
        self.consumer.stop()
        self.producer.stop()

    complete = VllmServer.complete

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return self.consumer.metrics()

    metric = VllmServer.metric


def _stop_group(proc: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM a server's process group (it forks workers), SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
