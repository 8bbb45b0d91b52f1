"""A kvtier thread's name where the OS shows it (`/proc/<pid>/task/<tid>/comm`, `top -H`, `perf`, py-spy's
native view): Python 3.11 keeps a thread's name to itself, so every thread a server starts is called after
its process there. `bench.cpu` finds the connector's share of a vLLM worker's CPU by these names."""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15  # prctl(2): the calling thread's name, 15 bytes and a NUL
_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's prctl
    except OSError:
        _libc = None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (default: its Python name) at the OS level, cut to 15 bytes on a
    character's boundary. A no-op off Linux."""
    if _libc is None:
        return
    text = (name or threading.current_thread().name).encode(errors="replace")[:15]
    text = text.decode(errors="ignore").encode()  # a character cut in two is left out
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0)


def os_thread_name() -> str:
    """The calling thread's OS-level name ('' off Linux)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def named_thread(target, name: str, *, daemon: bool = True) -> threading.Thread:
    """A `threading.Thread` running `target` under `name`, in Python and at the OS level (not started)."""
    def run() -> None:
        name_os_thread(name)
        target()

    return threading.Thread(target=run, name=name, daemon=daemon)
