"""NVIDIA Dynamo's services, launched for `kvtier bench route` and the tests (PyPI `ai-dynamo-runtime` 1.6.1 in
`.venv-dynamo`, `make dynamo`): `start_dynamo` starts `python -m dynamo.<module>` (the standalone KV indexer, the
runtime-free selection service; no NATS or etcd), `DynamoSelectService` is the selection service that
`kvtier route --policy dynamo` asks (the bench starts one per routed run).

Both bind every interface (no option to change it), so where this process may (root, `unshare`) they run in a network
namespace of their own, with only their own loopback; the replicas' event sockets are `ipc://` paths, which a
namespace does not hide. The selection service's HTTP port is then reached through `NetnsBridge`: a listener on this
namespace's 127.0.0.1 whose connections are made from a thread that joined the service's namespace (`setns` moves
only the calling thread), so the router gets a plain URL. No Dynamo import here.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvtier.bench.servers import ROOT, _stop_group
from kvtier.ports import free_port

_CLONE_NEWNET = 0x40000000

DYNAMO_PYTHON = Path(os.environ.get("KVTIER_DYNAMO_PYTHON", ROOT / ".venv-dynamo" / "bin" / "python"))
START_TIMEOUT_S = 60

# Brings the namespace's loopback up (SIOCGIFFLAGS / SIOCSIFFLAGS, IFF_UP), then becomes the indexer.
_LO_UP_THEN_EXEC = """import fcntl, os, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
os.execv(sys.argv[1], sys.argv[1:])
"""


def _can_isolate() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("nsenter") is not None


def start_dynamo(python: Path, module: str, port: int, log_path: Path, *, isolate: bool,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m <module> --port <port> --threads 1` from `.venv-dynamo` (the indexer, the selection
    service), in a network namespace of its own with only its loopback where `isolate`; `env` adds to the
    environment (Dynamo's router reads its settings from `DYN_ROUTER_*` variables)."""
    if not python.exists():
        raise FileNotFoundError(f"{python} not found: `make dynamo` creates it")
    argv = [str(python), "-m", module, "--port", str(port), "--threads", "1"]
    if isolate:
        argv = ["unshare", "--net", sys.executable, "-c", _LO_UP_THEN_EXEC, *argv]
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info"), **(env or {})})



class NetnsBridge:
    """TCP from 127.0.0.1:`port` here to 127.0.0.1:`target_port` in the network namespace of `pid`."""

    def __init__(self, pid: int, target_port: int) -> None:
        self.pid, self.target_port = pid, target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.closed = False
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="netns-bridge", daemon=True)

    def __enter__(self) -> NetnsBridge:
        self.thread.start()
        self.ready.wait(5)
        if self.error is not None:
            raise RuntimeError(f"cannot join the namespace of {self.pid}: {self.error}")
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True
        self.thread.join(timeout=5)
        self.listener.close()

    def _serve(self) -> None:
        try:
            fd = os.open(f"/proc/{self.pid}/ns/net", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 — reported by __enter__
            self.error = exc
        self.ready.set()
        while not self.closed and self.error is None:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)  # in its namespace
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _wait_own_namespace(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Until `unshare` has moved `proc` out of this network namespace (joining it earlier joins ours)."""
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout_s
    while os.readlink(f"/proc/{proc.pid}/ns/net") == ours:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the Dynamo selection service did not get a network namespace of its own")
        time.sleep(0.02)


class DynamoSelectService:
    """`python -m dynamo.select_service` on a free port; `url` reaches it from this process."""

    def __init__(self, log_path: Path, *, python: Path = DYNAMO_PYTHON, isolate: bool | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.env = env
        self.log_path = log_path
        self.python = python
        self.isolate = _can_isolate() if isolate is None else isolate
        self.proc: subprocess.Popen | None = None
        self.bridge: NetnsBridge | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DynamoSelectService:
        self.proc = start_dynamo(self.python, "dynamo.select_service", self.port, self.log_path, isolate=self.isolate,
                                 env=self.env)
        try:
            if self.isolate:
                _wait_own_namespace(self.proc)
                self.bridge = NetnsBridge(self.proc.pid, self.port).__enter__()
                self.url = f"http://127.0.0.1:{self.bridge.port}"
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Dynamo selection service exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the Dynamo selection service did not start within {START_TIMEOUT_S} s")

    def __exit__(self, *exc) -> None:
        if self.bridge is not None:
            self.bridge.__exit__()
            self.bridge = None
        if self.proc is not None:
            _stop_group(self.proc, timeout_s=10)
            self.proc = None

    def overlap(self, token_ids: list[int], *, model_name: str) -> dict[int, dict]:
        """Per worker, the blocks the selector's index holds for `token_ids` (`/overlap_scores`):
        `device_blocks`, `host_pinned_blocks`, `disk_blocks`, ..."""
        reply = httpx.post(self.url + "/overlap_scores", json={"model_name": model_name, "token_ids": token_ids},
                           timeout=10)
        reply.raise_for_status()
        return {w["worker_id"]: w for w in reply.json().get("workers", [])}
