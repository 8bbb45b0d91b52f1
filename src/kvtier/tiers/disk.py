"""Local SSD tier: one file per block under a directory, an index that survives restarts.

A block is written to a temporary file, fsynced and renamed into place (`os.replace` is atomic),
so a crash never leaves a half-written block under a real name; the header checksum catches
anything else. On open the directory is scanned: yesterday's blocks are found again, in mtime
(LRU) order, and leftover temporary files are removed. A block another live process wrote into
the same directory after our scan is adopted on first lookup. A full (ENOSPC) or read-only disk
marks the tier unhealthy with one warning and turns its puts off; reads of what is there keep
working, and `reconnect()` (the manager's retry) probes with a tiny write.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.index import LRUIndex
from kvtier.tiers.base import TierStats

log = logging.getLogger(__name__)
_TMP_SUFFIX = ".tmp"
_BLOCK_SUFFIX = ".kvb"
_PROBE_NAME = ".kvtier-probe"
READ_THREADS = 4
_DISABLING_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


class DiskTier:
    name = "ssd"

    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._lru = LRUIndex(capacity_bytes)
        self.stats = TierStats()
        self.healthy = True
        self._scan()

    def _path(self, key: bytes) -> Path:
        hex_key = key.hex()
        return self.directory / hex_key[:2] / f"{hex_key}{_BLOCK_SUFFIX}"

    def _scan(self) -> None:
        found = []
        for path in self.directory.glob("*/*"):
            if path.name.endswith(_TMP_SUFFIX):
                path.unlink(missing_ok=True)  # a write that never reached its rename
            elif path.name.endswith(_BLOCK_SUFFIX):
                stat = path.stat()
                found.append((stat.st_mtime_ns, bytes.fromhex(path.name[:-len(_BLOCK_SUFFIX)]), stat.st_size))
        for _, key, size in sorted(found):
            for victim, _ in self._lru.insert(key, size) or []:
                self._path(victim).unlink(missing_ok=True)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        return [key in self._lru or self._adopt(key) for key in keys]

    def _adopt(self, key: bytes) -> bool:
        """A block file another process wrote after our scan: take it into the index."""
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        for victim, _ in self._lru.insert(key, size) or []:
            self._path(victim).unlink(missing_ok=True)
            self.stats.evictions += 1
        return key in self._lru

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Batched reads run READ_THREADS at a time: an SSD serves several outstanding reads faster
        than one at a time (queue depth), and file reads release the GIL."""
        start = time.perf_counter()
        present = [key in self._lru or self._adopt(key) for key in keys]
        paths = [self._path(key) for key, held in zip(keys, present) if held]
        if len(paths) > 1:
            with ThreadPoolExecutor(min(READ_THREADS, len(paths))) as pool:
                datas = iter(list(pool.map(self._read, paths)))
        else:
            datas = iter([self._read(p) for p in paths])
        out: list[bytes | None] = []
        for key, held in zip(keys, present):
            data = next(datas) if held else None
            if held and data is None:  # the file vanished or failed to read
                self._lru.pop(key)
                self.stats.errors += 1
            if data is None:
                self.stats.misses += 1
            else:
                self._lru.touch(key)
                self.stats.hits += 1
                self.stats.bytes_read += len(data)
            out.append(data)
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Write blocks; evicted blocks are deleted (the SSD is the last tier), so none are returned."""
        start = time.perf_counter()
        for key, data in items:
            if not self.healthy:
                break
            if key in self._lru:
                self._lru.touch(key)
                continue
            victims = self._lru.insert(key, len(data))
            if victims is None:
                continue  # larger than the whole tier
            for victim, _ in victims:
                self._path(victim).unlink(missing_ok=True)
                self.stats.evictions += 1
            try:
                self._write(self._path(key), data)
            except OSError as exc:
                self._lru.pop(key)
                self._on_write_error(exc)
                continue
            self.stats.puts += 1
            self.stats.bytes_written += len(data)
        self.stats.write_seconds += time.perf_counter() - start
        return []

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(exist_ok=True)  # shard directory: first two hex digits of the key
        tmp = path.with_name(path.name + _TMP_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _on_write_error(self, exc: OSError) -> None:
        self.stats.errors += 1
        if exc.errno in _DISABLING_ERRNOS:
            self.healthy = False
            log.warning("ssd tier %s: %s; no more writes to this tier until a probe write succeeds",
                        self.directory, exc)

    def reconnect(self) -> bool:
        """Probe with a tiny atomic write; success turns puts back on."""
        if not self.healthy:
            try:
                self._write(self.directory / _PROBE_NAME, b"ok")
                (self.directory / _PROBE_NAME).unlink()
                self.healthy = True
                log.warning("ssd tier %s: writable again", self.directory)
            except OSError:
                pass
        return self.healthy

    def delete(self, key: bytes) -> bool:
        if self._lru.pop(key) is None:
            return False
        self._path(key).unlink(missing_ok=True)
        return True

    def used_bytes(self) -> int:
        return self._lru.used

    def num_blocks(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        pass
