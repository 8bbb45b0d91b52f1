"""Local pool services for `kvtier bench` and the tests: a Mooncake pool (master + a memory-server client)
and a redis-server, on free 127.0.0.1 ports. `start()` / `kill()` (fault tests take a backend
down mid-run and bring it back). Production pools are started by their operators (see
`tiers.mooncake` / `tiers.redis` for the commands)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from kvtier.ports import free_port, free_ports, wait_port

BIN = Path(sys.executable).parent


def _binary(name: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        raise FileNotFoundError(f"{name} not found: `make setup` installs it (Debian redis-server / "
                                "mooncake-transfer-engine-non-cuda)")
    return path


def _tail(path: str, lines: int = 15) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


class Service:
    """Processes started in order (each waited on its port), stopped in reverse. A start that fails
    part-way stops what it had started; `with Service(...) as service:` stops it all at the end."""

    def __init__(self, commands: list[tuple[list[str], int]], log_dir: Path) -> None:
        self.commands = commands
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        try:
            for i, (argv, port) in enumerate(self.commands):
                with open(self.log_dir / f"{Path(argv[0]).name}-{i}.log", "ab") as log:
                    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                self.procs.append(proc)
                try:
                    wait_port(port, proc)
                except RuntimeError as e:
                    raise RuntimeError(f"{e}; the end of its log:\n{_tail(log.name)}") from e
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait(timeout=10)
        self.procs.clear()

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class MooncakePool(Service):
    def __init__(self, log_dir: Path, segment: str = "512MB", buffer: str = "64MiB") -> None:
        self.buffer = buffer
        rpc, http, metrics, client = free_ports(4)
        self.master_addr = f"127.0.0.1:{rpc}"
        self.metadata_url = f"http://127.0.0.1:{http}/metadata"
        master = [_binary("mooncake_master"), "--enable_http_metadata_server=true",
                  "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                  f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}"]
        # (the default kv lease, 5 s, must outlast a whole batched get: a 100 ms lease expires in the
        # middle of moving a 4k-token prefix and every get fails with LEASE_EXPIRED)
        memory = [_binary("mooncake_client"), "--host=127.0.0.1", f"--master_server_address={self.master_addr}",
                  f"--metadata_server={self.metadata_url}", f"--global_segment_size={segment}", f"--port={client}"]
        super().__init__([(master, rpc), (memory, client)], log_dir)

    @property
    def spec(self) -> str:
        return f"mooncake://{self.master_addr}?metadata={self.metadata_url}&buffer={self.buffer}"

    def kill_master(self) -> None:
        """Kill the master alone (the memory server lives on, unreachable): the pool is dead to its clients."""
        master = self.procs[0]
        master.kill()
        master.wait(timeout=10)


class RedisServer(Service):
    def __init__(self, log_dir: Path, maxmemory: str = "256mb") -> None:
        self.port = free_port()
        argv = [_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        super().__init__([(argv, self.port)], log_dir)

    @property
    def spec(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_pool(kind: str, log_dir: Path) -> Service:
    """A started local pool service, `kind` "mooncake" or "redis"."""
    service = MooncakePool(log_dir) if kind == "mooncake" else RedisServer(log_dir)
    service.start()
    return service
