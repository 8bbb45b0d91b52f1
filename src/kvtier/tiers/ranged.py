"""Ranged reads of one block file, layer by layer (`DiskTier.lease_layers`): a layerwise load hands out
layer 0 of every block before the last layer of any is read.

A layered block (`codecs/header.py`: header | L layer slices | layer table) is read in page-aligned pieces
that never overlap (no byte of the buffer is written twice, so a slice proven once stays proven): first the
head (the header and layer 0) and the tail (the layer table), then the remaining layers in pieces of 1, 2,
4, ... layers. Any other block (an older format, zstd, a quantized codec) is read whole after its head.
Reads use the page-aligned buffer at the file's own offsets, so O_DIRECT works piece by piece. Each
piece is first asked of the page cache without waiting for the device (`RWF_NOWAIT`: a block written or
read lately is in memory, and one memcpy away); what the cache lacks comes from the device (O_DIRECT
where the file system has it: no copy through the page cache).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

from kvtier.codecs.header import HEADER_BYTES, peek_layers, table_bytes
from kvtier.tiers.buffers import PAGE

HEAD_BYTES = 64 * 1024  # the first read: the header and, for layers this small, layer 0 with it
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _down(offset: int) -> int:
    return offset // PAGE * PAGE


def _up(offset: int) -> int:
    return -(-offset // PAGE) * PAGE


def plan_pieces(size: int, head: bytes | memoryview) -> list[tuple[int, int]]:
    """The pieces [start, stop) of a file of `size` bytes read after its head (`head`: its first
    `min(size, HEAD_BYTES)` bytes), in read order: the layer table's first; together with the head they
    cover the file once. A file that is not a layered block of that size: the rest, whole."""
    first = min(size, HEAD_BYTES)
    geometry = peek_layers(head)
    if geometry is None or size != HEADER_BYTES + geometry[0] + table_bytes(geometry[1]):
        return [(first, size)] if first < size else []  # `verify` decides what it is
    payload_bytes, num_layers = geometry
    layer_bytes = payload_bytes // num_layers
    if not layer_bytes:  # not a block any codec writes (`verify` refuses it): read whole, in one piece
        return [(first, size)] if first < size else []
    tail = max(first, _down(HEADER_BYTES + payload_bytes))
    pieces = [(tail, size)] if tail < size else []
    covered, layers, group = first, max(0, (first - HEADER_BYTES) // layer_bytes), 1
    while covered < tail:  # 1, 2, 4, ... layers a piece
        layers = min(num_layers, layers + group)
        stop = tail if layers == num_layers else min(tail, _up(HEADER_BYTES + layers * layer_bytes))
        if stop > covered:
            pieces.append((covered, stop))
            covered = stop
        group *= 2
    return pieces


class RangedRead:
    """One file being read into `buf` in pieces (`plan_pieces`), each a leaf task on the process's transfer
    executor (`kvtier.transfer.executor`).
    `wait(stop)`: every byte before `stop`, and the tail, is in (False: a read failed: a miss).
    `fd`: the file, opened plainly (page-cache reads); `open_device()` opens it for the device reads
    (O_DIRECT: offsets and buffer pages aligned), on the first piece the page cache lacks."""

    def __init__(self, fd: int, buf, size: int, open_device: Callable[[], tuple[int, bool]]) -> None:
        self.fd = fd
        self.buf = buf
        self.size = size
        self.pieces: list[tuple[int, int, Future]] = []  # (start, stop, its read) on the readers
        self.rest: list[tuple[int, int]] = []  # the pieces still to submit (`DiskTier.lease_layers`)
        self.failed = False
        self._next = 0  # `wait`: the pieces before this one have landed
        self._open_device = open_device
        self._device: tuple[int, bool] | None = None  # (fd, O_DIRECT)
        self._device_lock = threading.Lock()

    def view(self) -> memoryview:
        return memoryview(self.buf)[:self.size].toreadonly()

    def read(self, start: int, stop: int) -> None:
        """Read file bytes [start, stop) into the buffer at the same offsets: from the page cache what it
        holds, the rest from the device."""
        done = self._read_cached(start, stop)
        if done >= stop:
            return
        fd, direct = self._device_fd()
        done = _down(done) if direct else done
        end = min(len(self.buf), _up(stop)) if direct else stop
        while done < stop:  # O_DIRECT reads whole pages; the last one comes back short at EOF
            n = os.preadv(fd, [memoryview(self.buf)[done:end]], done)
            if n <= 0:
                raise OSError(errno.EIO, "short read")
            done += n

    def _read_cached(self, start: int, stop: int) -> int:
        """Bytes from `start` on the page cache gave without waiting for the device: where to go on from."""
        done = start
        if not _NOWAIT:
            return done
        try:
            while done < stop:
                n = os.preadv(self.fd, [memoryview(self.buf)[done:stop]], done, _NOWAIT)
                if n <= 0:
                    break
                done += n
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a file system without it
            pass
        return done

    def _device_fd(self) -> tuple[int, bool]:
        with self._device_lock:
            if self._device is None:
                self._device = self._open_device()
            return self._device

    def submit(self, readers: Executor, pieces: list[tuple[int, int]]) -> None:
        for start, stop in pieces:
            self.pieces.append((start, stop, readers.submit(self.read, start, stop)))

    def wait(self, stop: int) -> bool:
        """Every piece holding bytes before `stop`, and the file's last bytes (a layer table), has landed
        (those read before the pieces were submitted — the head, the table — are in already). A piece that
        raised (an I/O error, or any other: a leaf's failure is this block's, never the load's) fails the
        read: the block is a miss from there."""
        pieces = self.pieces  # in `plan_pieces`' order: the tail (the layer table) first, then file order
        while not self.failed and self._next < len(pieces) and (pieces[self._next][0] < stop
                                                                or pieces[self._next][1] == self.size):
            try:
                pieces[self._next][2].result()
            except Exception:  # noqa: BLE001 - counted by the executor; the reader recomputes the block
                self.failed = True
            self._next += 1  # each piece waited for once, not again at every later layer
        return not self.failed

    def close(self) -> None:
        """Cancel the pieces not started, wait for the running ones (the buffer is then free), close the file."""
        for _, _, future in self.pieces:
            if not future.cancel():
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - the read is over; its error changes nothing now
                    pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._device is not None and self._device[0] >= 0:
            os.close(self._device[0])
            self._device = (-1, False)
