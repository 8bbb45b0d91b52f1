"""NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, PyPI `ai-dynamo-runtime` 1.6.1 in
`.venv-dynamo`, `make dynamo`) for the tests: the consumer of vLLM's KV events, kvtier's tiers among them.

It subscribes to each registered replica's ZMQ event stream (`POST /register`) and answers `POST /query`
(a prompt's token ids -> per replica the matched tokens on the device, `gpu`, and counting its host and
then its disk / shared tiers too, `cpu` and `disk`) and `GET /dump` (every block it holds, per worker and
storage tier). It needs no NATS or etcd. Its HTTP server binds every interface (no option to change it),
so where this process may (root, `unshare`) it runs in a network namespace of its own, with only its own
loopback: the replicas' event sockets are `ipc://` paths, which a namespace does not hide, and the
requests to it enter that namespace (`nsenter`). No vLLM or Dynamo import here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvtier.bench.dynamo import DYNAMO_PYTHON, START_TIMEOUT_S, _can_isolate, start_dynamo
from kvtier.bench.servers import ROOT, _stop_group
from kvtier.ports import free_port

# One HTTP request, run inside the indexer's namespace: prints status and body as JSON.
_REQUEST = """import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() if body else None, headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
"""


class DynamoIndexer:
    def __init__(self, log_path: Path, *, python: Path = DYNAMO_PYTHON, isolate: bool | None = None) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.python = python
        self.isolate = _can_isolate() if isolate is None else isolate
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DynamoIndexer:
        self.proc = start_dynamo(self.python, "dynamo.indexer", self.port, self.log_path, isolate=self.isolate)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Dynamo indexer exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self._request("GET", "/workers")[0] == 200:
                    return self
            except (OSError, RuntimeError):
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the Dynamo indexer did not start within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _stop_group(self.proc, timeout_s=10)
            self.proc = None

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        data = json.dumps(body) if body is not None else ""
        if not self.isolate:
            req = urllib.request.Request(self.url + path, data=data.encode() or None, method=method,
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as reply:
                    return reply.status, reply.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()
        out = subprocess.run(["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", sys.executable, "-c", _REQUEST,
                              self.url + path, data], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"request to the indexer failed: {out.stderr[-1000:]}")
        status, text = json.loads(out.stdout)
        return status, text

    def register(self, instance_id: int, endpoint: str, *, model_name: str, block_size: int,
                 replay_endpoint: str | None = None) -> None:
        """Subscribe to a replica's event stream (a vLLM `--kv-events-config` endpoint)."""
        body = {"instance_id": instance_id, "endpoint": endpoint, "model_name": model_name, "block_size": block_size}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        status, text = self._request("POST", "/register", body)
        if status >= 300:
            raise RuntimeError(f"/register answered {status}: {text}")

    def query(self, token_ids: list[int], *, model_name: str, cache_salt: str | None = None) -> dict[str, dict]:
        """Per replica (instance id as a string): matched tokens `gpu` (device), `cpu` (device + host),
        `disk` (device + host + disk + shared), `longest_matched`, under the tenant `cache_salt` (None: the
        unsalted blocks). A replica that matches nothing is absent."""
        body = {"token_ids": token_ids, "model_name": model_name}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        status, text = self._request("POST", "/query", body)
        if status != 200:
            raise RuntimeError(f"/query answered {status}: {text}")
        return json.loads(text).get("instances", {})

    def dump(self) -> dict:
        """Every block the index holds: {"model:routing_group": {"events": [{worker_id, storage_tier, event}]}}."""
        status, text = self._request("GET", "/dump")
        if status != 200:
            raise RuntimeError(f"/dump answered {status}: {text}")
        return json.loads(text)

    def tier_counts(self, model_name: str, worker_id: int) -> dict[str, int]:
        """How many distinct blocks of `worker_id` the index holds in each storage tier (`device`, `host_pinned`,
        `disk`, ...), from `dump()`."""
        blocks: dict[str, set[int]] = {}
        for entry in self.dump().get(f"{model_name}:default", {}).get("events", []):
            if entry["worker_id"] == worker_id:
                tier = blocks.setdefault(entry["storage_tier"], set())
                tier.update(block["block_hash"] for block in entry["event"]["data"].get("stored", {}).get("blocks", []))
        return {tier: len(hashes) for tier, hashes in blocks.items()}


class KvEventTap:
    """Every KV event batch a vLLM publisher sends, as JSON lines ([seq, ts, events]) in `out_path`: a
    subscriber in `python` (one with pyzmq and msgspec: `.venv-vllm`) beside the indexer."""

    def __init__(self, endpoint: str, out_path: Path, *, python: Path) -> None:
        self.argv = [str(python), "-m", "kvtier.testing.kv_event_tap", endpoint, str(out_path)]
        self.out_path = out_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> KvEventTap:
        self.out_path.touch()
        self.proc = subprocess.Popen(self.argv, start_new_session=True, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            _stop_group(self.proc, timeout_s=5)

    def events(self) -> list[dict]:
        """Every event so far, in order, as decoded maps (`type`, `block_hashes`, `medium`, ...)."""
        out = []
        for line in self.out_path.read_text().splitlines():
            _, _, events = json.loads(line)
            out += events
        return out
