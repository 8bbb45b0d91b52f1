"""Read buffers that tiers read blocks straight into: page-aligned anonymous mappings reused across
restores, so the read path allocates nothing (and takes no page faults) once warm. The SSD tier
reads files into them (O_DIRECT wants page alignment); the Mooncake tier has the store write into
them (`batch_get_into`; a transport such as RDMA needs them registered: `on_map` / `on_unmap`)."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Hashable

import numpy as np

PAGE = 4096
POOL_BYTES = 1 << 30  # buffers kept for reuse at most (beyond that, unmapped)


def address(buf: mmap.mmap) -> int:
    """The buffer's address (for a backend that writes into it)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


class ReadBuffers:
    """`take(size)` -> a buffer of at least `size`, rounded up to a page; `give(buf)` puts it back.
    `on_map(buf)` runs for each new mapping, `on_unmap(buf)` before one is unmapped; `close()`
    unmaps the free ones, and a buffer given back after that (a read still out) is unmapped too."""

    def __init__(self, max_bytes: int = POOL_BYTES, *, on_map: Callable[[mmap.mmap], None] | None = None,
                 on_unmap: Callable[[mmap.mmap], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self._on_map = on_map
        self._on_unmap = on_unmap
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._closed = False
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        capacity = -(-max(size, 1) // PAGE) * PAGE
        with self._lock:
            free = self._free.get(capacity)
            if free:
                self._free_bytes -= capacity
                return free.pop()
        buf = mmap.mmap(-1, capacity)
        if self._on_map is not None:
            try:
                self._on_map(buf)
            except BaseException:
                buf.close()
                raise
        return buf

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if not self._closed and self._free_bytes + len(buf) <= self.max_bytes:
                self._free.setdefault(len(buf), []).append(buf)
                self._free_bytes += len(buf)
                return
        self._unmap(buf)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            bufs = [buf for free in self._free.values() for buf in free]
            self._free, self._free_bytes = {}, 0
        for buf in bufs:
            self._unmap(buf)

    def _unmap(self, buf: mmap.mmap) -> None:
        if self._on_unmap is not None:
            self._on_unmap(buf)
        try:
            buf.close()
        except BufferError:  # a view still exists somewhere: the GC unmaps it later
            pass


class Leases:
    """Which buffers (or DRAM slots) a tier has lent out under which key (a key may be out more than
    once at a time)."""

    def __init__(self) -> None:
        self._out: dict[Hashable, list] = {}
        self._lock = threading.Lock()

    def add(self, key: Hashable, buf) -> None:
        with self._lock:
            self._out.setdefault(key, []).append(buf)

    def end(self, keys: list[Hashable]) -> list:
        """One lease of each key ended: the buffers to give back (none for a key not out)."""
        with self._lock:
            bufs = [self._out[key].pop() for key in keys if self._out.get(key)]
            for key in keys:
                if key in self._out and not self._out[key]:
                    del self._out[key]
        return bufs

    def keys(self) -> set[Hashable]:
        """The keys with a lease out now."""
        with self._lock:
            return set(self._out)

    def __len__(self) -> int:
        with self._lock:
            return sum(map(len, self._out.values()))
