"""Service fixtures: a Mooncake pool (master + a memory-server client) and a redis-server, each on
127.0.0.1 ports picked free, started here and stopped after the session. `Service.kill()` /
`Service.start()` let fault tests take a backend down mid-run and bring it back."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on {port} within {timeout_s} s")


def _binary(name: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        pytest.fail(f"{name} not found: `make test` installs it (Debian redis-server / mooncake-transfer-engine)")
    return path


class Service:
    """Processes started in order (each waited on its port), stopped in reverse."""

    def __init__(self, commands: list[tuple[list[str], int]], log_dir: Path) -> None:
        self.commands = commands
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        for i, (argv, port) in enumerate(self.commands):
            log = open(self.log_dir / f"{Path(argv[0]).name}-{i}.log", "ab")
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
            _wait_port(port, proc)

    def kill(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()


class MooncakePool(Service):
    def __init__(self, log_dir: Path, segment: str = "512MB") -> None:
        rpc, http, metrics, client = free_port(), free_port(), free_port(), free_port()
        self.master_addr = f"127.0.0.1:{rpc}"
        self.metadata_url = f"http://127.0.0.1:{http}/metadata"
        master = [_binary("mooncake_master"), "--enable_http_metadata_server=true",
                  "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                  f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
                  "--default_kv_lease_ttl=100"]
        memory = [_binary("mooncake_client"), "--host=127.0.0.1", f"--master_server_address={self.master_addr}",
                  f"--metadata_server={self.metadata_url}", f"--global_segment_size={segment}", f"--port={client}"]
        super().__init__([(master, rpc), (memory, client)], log_dir)

    @property
    def spec(self) -> str:
        return f"mooncake://{self.master_addr}?metadata={self.metadata_url}&buffer=64MiB"


class RedisServer(Service):
    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        argv = [_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]
        super().__init__([(argv, self.port)], log_dir)

    @property
    def spec(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _session_service(service: Service):
    service.start()
    try:
        yield service
    finally:
        service.kill()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    yield from _session_service(MooncakePool(tmp_path_factory.mktemp("mooncake")))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    yield from _session_service(RedisServer(tmp_path_factory.mktemp("redis")))


@pytest.fixture(params=["mooncake", "redis"])
def pool_service(request):
    """Each pool backend in turn (the same tests run against both)."""
    return request.getfixturevalue("mooncake_master" if request.param == "mooncake" else "redis_server")
