"""Local TCP ports: a free one on 127.0.0.1, and waiting for a started process to listen on one
(the disaggregation proxy's thread, `kvtier bench`'s servers and pools, the tests)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections import deque


_GIVEN: deque[int] = deque(maxlen=1024)  # the ports this process handed out last, oldest first
_LOCK = threading.Lock()


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports, none of them one this process handed out in its last 1,024. The kernel may
    hand a just-closed port out again, and a caller often binds its ports later, all at once: a Mooncake
    master given one port for metadata and metrics exited at start (in CI). So every socket is held until
    `n` fresh ports are bound, and ports handed out before are skipped."""
    socks: list[socket.socket] = []
    fresh: list[int] = []
    with _LOCK:
        try:
            while len(fresh) < n:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                if port not in _GIVEN:
                    fresh.append(port)
        finally:
            for s in socks:
                s.close()
        _GIVEN.extend(fresh)
    return fresh


def free_port() -> int:
    return free_ports(1)[0]


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Return once something listens on 127.0.0.1:`port`; raise if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args[0]} did not listen on {port} within {timeout_s} s")
