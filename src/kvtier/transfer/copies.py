"""Host-memory copies spread over a few threads, for a restore that runs alone.

A restore into CPU KV memory that nothing computes beside (`TieredCache.load_prefix`, before its
forward) is a pure memory copy, and one core does not pull all the bandwidth DRAM has: on the 2-core
CI machine a warm 189 MB memcpy runs at 6.3 GB/s on one thread and 12.1 GB/s split over two. So the
restore hands its copies (`dst[...] = src`, numpy views; numpy releases the GIL inside each) to a
`CopyGroup`, whose threads take them as they come while the caller goes on reading and verifying the
next blocks, and `finish` takes part in what is left.

Not for copies that run beside a forward (the engine's transfer worker restores while other
requests compute): there a second copy thread takes a core the forward's intra-op threads wait for.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

MAX_COPY_THREADS = 4  # DRAM bandwidth is reached by a few cores; more only contend


def copy_threads() -> int:
    """How many threads a lone restore copies with: torch's intra-op threads (the CPU budget the
    process was given, `torch.set_num_threads`), at most `MAX_COPY_THREADS`."""
    return max(1, min(MAX_COPY_THREADS, torch.get_num_threads()))


def split_copy(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    """One flat copy of `src` into `dst` (1-D, same size) cut into `threads` parts run at once: the
    reference a `CopyGroup` of as many threads is measured against."""
    with CopyGroup(threads) as group:
        step = -(-len(src) // threads)
        for start in range(0, len(src), step):
            group.add(dst[start:start + step], src[start:start + step])


class CopyGroup:
    """Copies added as they come, run by `threads - 1` helper threads and, in `finish`, the caller's.

        with CopyGroup(copy_threads()) as group:
            for block in stream:          # the helpers copy while the caller reads the next block
                group.add(dst_view, src_view)
            group.finish()                # raises the first copy's error, after every copy ended

    `threads=1` copies on the caller's thread in `add`. Leaving the `with` without `finish` (an
    error) still waits for the helpers, so no copy outlives the memory it reads.
    """

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"a copy group needs at least one thread (got {threads})")
        self.threads = threads
        self.num_copies = 0
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._helpers = [threading.Thread(target=self._drain, name="kvtier-copy", daemon=True)
                         for _ in range(threads - 1)]
        for helper in self._helpers:
            helper.start()
        self._finished = False

    def add(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy `src` into the view `dst` (same shape), now or soon."""
        self.num_copies += 1
        if not self._helpers:
            np.copyto(dst, src)
            return
        self._tasks.put((dst, src))

    def finish(self) -> None:
        """Run what is left, wait for every copy; raise the first one's error."""
        if self._finished:
            return
        self._finished = True
        for _ in self._helpers:
            self._tasks.put(None)
        self._tasks.put(None)
        self._drain()
        for helper in self._helpers:
            helper.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> "CopyGroup":
        return self

    def cancel(self, reason: BaseException) -> None:
        """Skip the copies not started, wait for the running ones; raises nothing (`reason` is the
        error already on its way)."""
        self._error = self._error or reason
        try:
            self.finish()
        except BaseException:  # noqa: BLE001 - the error already propagating is the one to see
            pass

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.cancel(exc)

    def _drain(self) -> None:
        while (task := self._tasks.get()) is not None:
            if self._error is not None:
                continue
            try:
                np.copyto(*task)
            except BaseException as exc:  # noqa: BLE001 - raised by `finish`, on the caller's thread
                self._error = exc
