"""The process's one transfer executor: the threads that run a load's leaf tasks, its one read-ahead lane, and its
one writes lane (every write below the top tier).

A load has two kinds of work. A *leaf* reads a file range, copies a chunk, stamps a file: it never waits
for another task. A *coordinator* (the loader of one request: `TierManager.stream` / `stream_layers` on the
engine's transfer thread, the vLLM worker's load thread, `TieredCache.load_prefix`'s caller) submits
leaves and waits for them. Leaves run here, on `WORKERS` threads kept for the process's life (no thread
started per restore, per SSD tier or per batch); coordinators run on their own threads, and the one kind
of coordinator kvtier hands off (a stream's read-ahead, which waits for its reads) runs on `ahead`'s single
thread, never on a worker. So no worker ever waits for a task queued behind it, and any number of
concurrent loads, more than there are workers, only queue:

- a task submitted from a worker runs there and then (a leaf that fans out waits for nothing queued);
- `submit` from any other thread waits while `max_queued` tasks wait to start (`num_waits` counts the
  times it held a submitter). Only coordinators submit, and leaves never wait for a coordinator, so the
  wait always ends;
- a leaf that raises fails its future (its caller reports that block as not loaded), counted in
  `num_failed`;
- `close()` runs what is queued and joins every thread.

Writes (`write(fn, blocks=n)`): the saves an engine hands off, write-through, demotion and the promotion of
blocks a load fetched from below into DRAM (after the load, off its critical path), for every manager of the
process (`tiers/writeback.py` queues them here through a `Writes` view of its own). They run in submission
order on one thread, `kvtier-writes`. A write never waits: where `max_queued_writes` writes wait to start (or
its owner's share, `Writes.max_queued`), it is dropped, `write` says False and its blocks are counted in
`num_dropped` — the compute path that saves never waits on a slow tier, a loader that submits does. Where the
lanes are full is decided in one place, here: loads wait, writes drop. A write that raises is logged and
counted in `num_failed`; the lane goes on. A write may submit leaves and wait for them (it is a coordinator),
never another write. `after_writes(fn)` runs a task behind every write queued so far that is never dropped (it
carries no bytes): a vLLM worker's deletes, behind the saves queued before them (`DiskStore.delete_behind_writes`).

Where it lives: in `transfer/`, imported by the tiers below it (`tiers/disk.py`'s reads are its leaves,
`tiers/writeback.py` writes on it), so it imports nothing of kvtier above the tiers (only `thread_names`: its
threads carry their lane's name to the OS, where `bench.cpu` counts them), and `kvtier.transfer` imports the
mover (which imports the manager) only on first use.

Threads start on demand from the thread that submits (a thread inherits its starter's CPU placement:
`integrations/vllm/cpus.py`), the writes thread where the first `Writes` is made (a manager's constructor,
as its own writer thread used to start). A forked child has none of its parent's threads: it forgets the parent's
executor and makes its own on first use (a tier or a manager made before the fork reads and writes on the
child's; a `Writes` forgets what its parent had pending).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future

from kvtier.thread_names import named_thread

log = logging.getLogger(__name__)

WORKERS = 8      # 4 SSD reads in flight (queue depth) beside a restore's copy helpers (at most 3)
MAX_QUEUED = 4096  # tasks waiting to start before a submitter waits: a load's pieces fit; a runaway does not
MAX_QUEUED_WRITES = 4096  # writes of every manager waiting to start before one is dropped
WRITES_LANE = "kvtier-writes"


_current = threading.local()  # `lane`: the lane whose worker this thread is


class _Lane:
    """Threads taking tasks from one queue: `max_threads` of them, started as work arrives. Workers wait on
    `_has_work`, submitters held at the bound on `_has_room` (one lock): a wake-up never goes to the wrong side."""

    def __init__(self, name: str, max_threads: int, max_queued: int, on_failure: Callable[[], None]) -> None:
        self.name = name
        self.max_threads = max_threads
        self.max_queued = max_queued
        self.num_waits = 0
        self._on_failure = on_failure
        self._tasks: deque = deque()
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._has_room = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._num_held = 0  # submitters waiting for room
        self._closing = False

    def owns_current_thread(self) -> bool:
        return getattr(_current, "lane", None) is self

    def put(self, future: Future | None, fn, args, kwargs, *, wait: bool = True, bounded: bool = True) -> bool:
        """Queue the task; at the bound, wait for room (`wait`) or queue nothing and return False. `bounded`
        False: queued past the bound (a task that carries no bytes and must not be lost)."""
        with self._lock:
            if bounded and len(self._tasks) >= self.max_queued and not self._closing:
                if not wait:
                    return False
                self.num_waits += 1
                self._num_held += 1
                while len(self._tasks) >= self.max_queued and not self._closing:
                    self._has_room.wait()
                self._num_held -= 1
            if self._closing:
                raise RuntimeError(f"the transfer executor is closed ({self.name})")
            self._tasks.append((future, fn, args, kwargs))
            if self._idle:  # counted down here: the next submit sees the worker woken as busy
                self._idle -= 1
                self._has_work.notify()
            elif len(self._threads) < self.max_threads:
                self._start_thread()
        return True

    def start(self) -> None:
        """Start a thread now if none was (it inherits the caller's CPU placement), to wait for work."""
        with self._lock:
            if not self._threads and not self._closing:
                self._start_thread()

    def _start_thread(self) -> None:
        thread = named_thread(self._work, f"{self.name}-{len(self._threads)}")
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        _current.lane = self
        while True:
            with self._lock:
                while not self._tasks and not self._closing:
                    self._idle += 1  # `put` counts it down as it wakes one
                    self._has_work.wait()
                if not self._tasks:
                    return
                future, fn, args, kwargs = self._tasks.popleft()
                if self._num_held:
                    self._has_room.notify()
            _run(future, fn, args, kwargs, self._on_failure)

    @property
    def num_threads(self) -> int:
        with self._lock:
            return sum(thread.is_alive() for thread in self._threads)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._has_work.notify_all()
            self._has_room.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()


def _run(future: Future | None, fn, args, kwargs, on_failure: Callable[[], None]) -> None:
    if future is not None and not future.set_running_or_notify_cancel():
        return  # cancelled before it started (a ranged read whose lease ended)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the future carries it to whoever waits
        on_failure()
        if future is None:
            log.exception("a transfer task failed")
        else:
            future.set_exception(exc)
        return
    if future is not None:
        future.set_result(result)


class TransferExecutor(Executor):
    """`submit(fn, ...)` / `map` / `spawn(fn)` run leaves on the workers; `ahead(fn, ...)` runs one
    coordinator task (a read-ahead that waits for leaves) on the read-ahead thread; `write(fn, blocks=n)` one
    write on the writes thread, in order, or drops it."""

    def __init__(self, workers: int = WORKERS, max_queued: int = MAX_QUEUED,
                 max_queued_writes: int = MAX_QUEUED_WRITES) -> None:
        if workers < 1 or max_queued < 1 or max_queued_writes < 1:
            raise ValueError(f"a transfer executor needs a worker and room for a task "
                             f"(got {workers}, {max_queued}, {max_queued_writes})")
        self.num_failed = 0
        self.num_dropped = 0  # blocks of the writes dropped at a bound, every owner's
        self._counts_lock = threading.Lock()
        self._leaves = _Lane("kvtier-io", workers, max_queued, self._failed)
        self._ahead = _Lane("kvtier-ahead", 1, max_queued, self._failed)
        self._writes = _Lane(WRITES_LANE, 1, max_queued_writes, self._failed)  # one thread: in order

    def _failed(self) -> None:
        with self._counts_lock:
            self.num_failed += 1

    @property
    def num_waits(self) -> int:
        """Times a submitter waited for room (the backpressure point)."""
        return self._leaves.num_waits + self._ahead.num_waits

    @property
    def num_threads(self) -> int:
        return self._leaves.num_threads + self._ahead.num_threads + self._writes.num_threads

    def on_worker(self) -> bool:
        return self._leaves.owns_current_thread()

    def start_writes(self) -> None:
        """Start the writes thread now, where the caller runs (a manager's constructor: vLLM makes it off the
        forward's core), not where the first write comes from."""
        self._writes.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """Run the leaf `fn(*args, **kwargs)` on a worker (at once, here, when called from one)."""
        future: Future = Future()
        if self.on_worker():
            _run(future, fn, args, kwargs, self._failed)
        else:
            self._leaves.put(future, fn, args, kwargs)
        return future

    def spawn(self, fn: Callable[[], None]) -> None:
        """`submit` without a future, for a leaf that reports on its own (a copy group's helper); an
        exception is logged and counted."""
        if self.on_worker():
            _run(None, fn, (), {}, self._failed)
        else:
            self._leaves.put(None, fn, (), {})

    def ahead(self, fn, /, *args, **kwargs) -> Future:
        """Run the coordinator `fn` (it may wait for leaves, never for another `ahead` task) on the one
        read-ahead thread, in submission order."""
        future: Future = Future()
        self._ahead.put(future, fn, args, kwargs)
        return future

    def write(self, fn: Callable[[], None], /, *, blocks: int = 0, owner: "Writes | None" = None) -> bool:
        """Run the write `fn()` on the writes thread, after every write queued before it. Never waits: False
        where the lane is full, or `owner`'s share of it, and the write is dropped, its `blocks` counted in
        `num_dropped` (and the owner's). An exception is logged and counted (`num_failed`)."""
        admitted = owner is None or owner._admit()
        queued = False
        try:
            queued = admitted and self._writes.put(None, fn if owner is None else owner._wrapped(fn), (), {},
                                                   wait=False)
        finally:
            if admitted and not queued and owner is not None:
                owner._refused()
        if queued:
            return True
        with self._counts_lock:
            self.num_dropped += blocks
        if owner is not None:
            owner._dropped(blocks)
        return False

    def after_writes(self, fn, /, *args, **kwargs) -> Future:
        """Run `fn` on the writes thread after every write queued so far: never dropped (it carries no bytes;
        queued past the bound), never waits. A directory's deletes, behind the writes queued before them
        (`DiskStore.delete_behind_writes`)."""
        future: Future = Future()
        self._writes.put(future, fn, args, kwargs, bounded=False)
        return future

    def tasks(self) -> "Tasks":
        """An executor view that counts what it submitted (`Tasks.join`)."""
        return Tasks(self)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.close()

    def close(self) -> None:
        """Run what is queued, then join every thread (the writes first: one may wait for leaves)."""
        self._writes.close()
        self._ahead.close()
        self._leaves.close()


class _Open:
    """What one owner handed to the executor and has not ended yet, counted under one condition: `join` waits
    until none is open (`Tasks` and `Writes` count theirs)."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._num_open = 0
        self._cond = threading.Condition()

    def _opened(self) -> None:
        with self._cond:
            self._num_open += 1

    def _ended(self, _future: Future | None = None) -> None:
        with self._cond:
            self._num_open -= 1
            self._cond.notify_all()

    def join(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._num_open == 0)


class Tasks(_Open, Executor):
    """The tasks one owner submitted, counted until each ended: `join()` waits for them (a tier's or a manager's
    close).
    `executor` None: the process's at each submit (a tier made before a fork reads on the child's)."""

    def __init__(self, executor: TransferExecutor | None = None) -> None:
        super().__init__()
        self.executor = executor

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self._counted(lambda executor: executor.submit(fn, *args, **kwargs))

    def ahead(self, fn, /, *args, **kwargs) -> Future:
        """`TransferExecutor.ahead`, counted (a manager's read-ahead, waited for at its close)."""
        return self._counted(lambda executor: executor.ahead(fn, *args, **kwargs))

    def after_writes(self, fn, /, *args, **kwargs) -> Future:
        """`TransferExecutor.after_writes`, counted (a directory's deletes, waited for at its close)."""
        return self._counted(lambda executor: executor.after_writes(fn, *args, **kwargs))

    def _counted(self, send) -> Future:
        self._opened()
        try:
            future = send(self.executor or transfer_executor())
        except BaseException:
            self._ended()
            raise
        future.add_done_callback(self._ended)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if wait:
            self.join()


class Writes(_Open):
    """The writes one owner (a manager's write-back) queues on the process's writes lane (`TransferExecutor.write`):
    at most `max_queued` of them waiting to start (its share of the lane: one more is dropped), each counted until
    it ran (`join` waits for this owner's, and so for every write queued before them, not for those after), and
    the blocks of those dropped (`num_dropped`; the executor's counts every owner's).
    `executor` None: the process's at each write (a manager made before a fork writes on the child's)."""

    def __init__(self, max_queued: int, executor: TransferExecutor | None = None) -> None:
        if max_queued < 1:
            raise ValueError(f"a writer needs room for a write (got {max_queued})")
        super().__init__()
        self.max_queued = max_queued
        self.executor = executor
        self.num_dropped = 0
        _all_writes.add(self)
        (executor or transfer_executor()).start_writes()  # here, where the owner is made (`start_writes`)

    def _forget(self) -> None:
        super()._forget()
        self._num_queued = 0  # waiting to start (open: waiting or running)

    def write(self, fn: Callable[[], None], /, *, blocks: int = 0) -> bool:
        """`TransferExecutor.write`, counted: False where it was dropped."""
        return (self.executor or transfer_executor()).write(fn, blocks=blocks, owner=self)

    @property
    def num_pending(self) -> int:
        """Writes queued or running."""
        with self._cond:
            return self._num_open

    @property
    def num_queued(self) -> int:
        """Writes waiting to start."""
        with self._cond:
            return self._num_queued

    def join(self) -> None:
        """Until every write queued so far has run (on the writes lane itself: it would wait for itself)."""
        if on_writes_lane():
            raise RuntimeError("a write cannot wait for the writes queued behind it")
        super().join()

    def _admit(self) -> bool:
        with self._cond:
            if self._num_queued >= self.max_queued:
                return False
            self._num_queued += 1
            self._num_open += 1
            return True

    def _wrapped(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with self._cond:
                self._num_queued -= 1
            try:
                fn()
            finally:
                self._ended()
        return run

    def _refused(self) -> None:  # admitted, then the lane was full
        with self._cond:
            self._num_queued -= 1
        self._ended()

    def _dropped(self, blocks: int) -> None:
        with self._cond:
            self.num_dropped += blocks


def on_writes_lane() -> bool:
    """Whether this thread is a writes lane's (the process's executor's, or one a test made)."""
    lane = getattr(_current, "lane", None)
    return lane is not None and lane.name == WRITES_LANE


_all_writes: "weakref.WeakSet[Writes]" = weakref.WeakSet()
_executor: TransferExecutor | None = None
_executor_lock = threading.Lock()


def transfer_executor() -> TransferExecutor:
    """The process's executor, made on first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = TransferExecutor()
        return _executor


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it makes its own executor on first use, and its
    writers forget the writes their parent had queued (they run, or not, in the parent) and the executor they
    were given (the parent's: its lanes have no thread here)."""
    global _executor, _executor_lock
    _executor, _executor_lock = None, threading.Lock()
    for writes in list(_all_writes):
        writes._forget()
        writes.executor = None


os.register_at_fork(after_in_child=_forget_in_child)


def use_executor(executor: TransferExecutor | None) -> TransferExecutor | None:
    """Make `executor` the process's (None: a fresh one on next use); returns the one it replaces, not closed
    (tests: a small executor to saturate)."""
    global _executor
    with _executor_lock:
        previous, _executor = _executor, executor
    return previous
