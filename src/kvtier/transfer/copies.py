"""Host-memory copies spread over a few threads, for a restore that runs alone.

A restore into CPU KV memory that nothing computes beside (`TieredCache.load_prefix`, before its
forward) is a pure memory copy, and one core does not pull all the bandwidth DRAM has: on the 2-core
CI machine a warm 189 MB memcpy runs at 6.3 GB/s on one thread and 12.1 GB/s split over two. So the
restore hands its copies (`dst[...] = src`, numpy views; numpy releases the GIL inside each) to a
`CopyGroup`, whose helpers (leaf tasks on the process's transfer executor, `kvtier.transfer.executor`) take them as
they come while the caller goes on reading and verifying the next blocks, and `finish` takes part in what
is left.

Not for copies that run beside a forward (the engine's transfer worker restores while other
requests compute): there a second copy thread takes a core the forward's intra-op threads wait for.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

from kvtier.transfer.executor import TransferExecutor, transfer_executor

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
    """Copies added as they come, run by up to `threads - 1` helpers on the process's transfer executor
    (`kvtier.transfer.executor`: threads kept for the process's life, none started per restore) and, in `finish`,
    the caller's thread.

        with CopyGroup(copy_threads()) as group:
            for block in stream:          # the helpers copy while the caller reads the next block
                group.add(dst_view, src_view)
            group.finish()                # raises the first copy's error, after every copy ended

    A helper is a leaf task: it copies what is queued and ends when nothing is (the next `add` sends
    another); it never waits. `finish` copies what is left itself and waits only for copies running, never
    for a helper still queued behind other loads' tasks (it will find nothing to do). `threads=1` copies on
    the caller's thread in `add`. Leaving the `with` without `finish` (an error) still waits for the running
    copies, so no copy outlives the memory it reads.
    """

    def __init__(self, threads: int = 1, executor: TransferExecutor | None = None) -> None:
        if threads < 1:
            raise ValueError(f"a copy group needs at least one thread (got {threads})")
        self.threads = threads
        self.num_copies = 0
        self._executor = (executor or transfer_executor()) if threads > 1 else None
        self._tasks: deque[tuple[np.ndarray, np.ndarray]] = deque()  # append / popleft: atomic, no lock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # `finish` waits here for the helpers copying
        self._num_helpers = 0   # helper tasks sent and not ended (queued or copying)
        self._num_active = 0    # helpers started and not ended: they may be copying
        self._error: BaseException | None = None
        self._finished = False

    def add(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy `src` into the view `dst` (same shape), now or soon."""
        self.num_copies += 1
        if self._executor is None:
            np.copyto(dst, src)
            return
        self._tasks.append((dst, src))
        with self._lock:  # against a helper deciding to end: it sees this copy, or this add sees it gone
            send = self._num_helpers < self.threads - 1
            if send:
                self._num_helpers += 1
        if send:  # outside the lock: a submitter may wait for room on the executor
            self._executor.spawn(self._help)

    def add_split(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy `src` into the view `dst` (same shape) as one copy per thread, cut along the first axis (a
        block's layers): each a strided numpy copy in C. A copy per layer and K/V instead (60 per SmolLM2
        block) pays the per-copy Python on both threads and ran at 73% of a memcpy's speed on the 2-core
        box where this runs at 106% (docs/benchmarks/prefix-and-tiers.md)."""
        rows = len(src)
        step = -(-rows // min(self.threads, rows))
        for start in range(0, rows, step):
            self.add(dst[start:start + step], src[start:start + step])

    def finish(self) -> None:
        """Run what is left, wait for every copy; raise the first one's error."""
        if self._finished:
            return
        self._finished = True
        self._drain()
        with self._lock:
            while self._num_active:
                self._idle.wait()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> "CopyGroup":
        return self

    def cancel(self, reason: BaseException) -> None:
        """Skip the copies not started, wait for the running ones; raises nothing (`reason` is the
        error already on its way)."""
        with self._lock:
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

    def _help(self) -> None:
        """A helper: active before its first copy (so `finish` waits for it), ended only once the queue is
        empty under the lock (an `add` then sends another)."""
        with self._lock:
            self._num_active += 1
        while True:
            self._drain()
            with self._lock:
                if self._tasks:
                    continue  # added while it drained: its `add` saw this helper alive
                self._num_helpers -= 1
                self._num_active -= 1
                if not self._num_active:
                    self._idle.notify_all()
                return

    def _drain(self) -> None:
        """Copy queued tasks until none is left (after an error: drop them)."""
        tasks = self._tasks
        while True:
            try:
                dst, src = tasks.popleft()
            except IndexError:
                return
            if self._error is not None:
                continue
            try:
                np.copyto(dst, src)
            except BaseException as exc:  # noqa: BLE001 - raised by `finish`, on the caller's thread
                with self._lock:
                    self._error = self._error or exc
