"""The transfer executor on its own (`kvtier.transfer.executor`): leaves on threads kept for its life, a task submitted
from a worker run there (no worker waits for a task queued behind it), one backpressure point that only holds
submitters from outside, a failing leaf failing its own future (counted), and `close` running what is queued
and joining every thread. The timeouts here only detect a deadlock; nothing is timed."""

from __future__ import annotations

import threading

import pytest

from kvtier.thread_names import os_thread_name
from kvtier.transfer.executor import TransferExecutor

DEADLOCK_S = 60


@pytest.fixture
def executor():
    executor = TransferExecutor(workers=2, max_queued=2)
    yield executor
    executor.close()


def _until(condition) -> None:
    """Wait for `condition()` to hold (a failure detector, not a timing)."""
    done = threading.Event()
    for _ in range(DEADLOCK_S * 1000):
        if condition():
            return
        done.wait(0.001)
    raise AssertionError("condition never held")


def test_leaves_run_on_the_same_threads_batch_after_batch(executor):
    seen: set[int] = set()
    for _ in range(5):
        futures = [executor.submit(lambda: seen.add(threading.get_ident()) or threading.current_thread().name)
                   for _ in range(2)]
        assert all(f.result(DEADLOCK_S).startswith("kvtier-io") for f in futures)
    assert len(seen) <= 2 and executor.num_threads <= 2


def test_every_lane_s_threads_carry_their_names_to_the_os(executor):
    """What `top -H` and `bench.cpu` see: the lane's thread name, not the process's."""
    names: list[str] = []
    assert executor.submit(os_thread_name).result(DEADLOCK_S) == "kvtier-io-0"
    assert executor.ahead(os_thread_name).result(DEADLOCK_S) == "kvtier-ahead-0"
    assert executor.write(lambda: names.append(os_thread_name()))
    executor.close()
    assert names == ["kvtier-writes-0"]


def test_a_task_that_fans_out_and_waits_does_not_deadlock_one_worker():
    executor = TransferExecutor(workers=1, max_queued=1)
    try:
        def fan_out():  # a leaf's map: on a pool that queued it, this would wait for its only worker
            parts = [executor.submit(lambda n=n: (n, threading.get_ident())) for n in range(4)]
            return [f.result() for f in parts], threading.get_ident()

        parts, worker = executor.submit(fan_out).result(DEADLOCK_S)
        assert [n for n, _ in parts] == [0, 1, 2, 3] and {ident for _, ident in parts} == {worker}
    finally:
        executor.close()


def test_a_full_queue_holds_the_submitter_until_a_worker_takes_a_task():
    executor = TransferExecutor(workers=1, max_queued=2)
    release = threading.Event()
    try:
        blocker = executor.submit(release.wait)
        _until(lambda: executor._leaves._idle == 0 and not executor._leaves._tasks)  # the worker holds it
        queued = [executor.submit(lambda n=n: n) for n in range(2)]  # the queue is full now
        third: list = []
        submitter = threading.Thread(target=lambda: third.append(executor.submit(lambda: "third")))
        submitter.start()
        _until(lambda: executor.num_waits == 1)
        assert not third  # held at the backpressure point
        release.set()
        submitter.join(DEADLOCK_S)
        assert blocker.result(DEADLOCK_S) and [f.result(DEADLOCK_S) for f in queued] == [0, 1]
        assert third[0].result(DEADLOCK_S) == "third"
    finally:
        release.set()
        executor.close()


def test_a_failing_leaf_fails_its_own_future_and_is_counted(executor):
    def leaf(n):
        if n == 3:
            raise OSError("a bad sector")
        return n

    futures = [executor.submit(leaf, n) for n in range(6)]
    with pytest.raises(OSError, match="bad sector"):
        futures[3].result(DEADLOCK_S)
    assert [f.result(DEADLOCK_S) for i, f in enumerate(futures) if i != 3] == [0, 1, 2, 4, 5]
    assert executor.num_failed == 1


def test_read_ahead_tasks_wait_for_leaves_without_deadlock_on_one_worker():
    executor = TransferExecutor(workers=1, max_queued=1)
    try:
        def read_ahead(n):  # a coordinator: waits for its leaves, on the read-ahead thread
            return sum(f.result() for f in [executor.submit(lambda i=i: i * n) for i in range(5)])

        aheads = [executor.ahead(read_ahead, n) for n in range(8)]
        assert [f.result(DEADLOCK_S) for f in aheads] == [10 * n for n in range(8)]
        assert executor.num_threads == 2  # one worker, one read-ahead thread
    finally:
        executor.close()


def test_a_cancelled_task_never_runs(executor):
    release = threading.Event()
    ran = []
    busy = [executor.submit(release.wait) for _ in range(2)]
    _until(lambda: executor._leaves._idle == 0 and not executor._leaves._tasks)
    later = executor.submit(lambda: ran.append(1))
    assert later.cancel()
    release.set()
    assert all(f.result(DEADLOCK_S) for f in busy)
    executor.close()
    assert ran == [] and later.cancelled()


def test_close_runs_what_is_queued_and_joins_every_thread():
    executor = TransferExecutor(workers=2, max_queued=16)
    release = threading.Event()
    futures = [executor.submit(release.wait) for _ in range(2)] + [executor.submit(lambda n=n: n) for n in range(8)]
    ahead = executor.ahead(lambda: "ahead")
    tasks = executor.tasks()
    counted = [tasks.submit(lambda n=n: n) for n in range(3)]
    release.set()
    tasks.join()
    assert all(f.done() for f in counted)
    executor.close()
    assert executor.num_threads == 0
    assert all(f.done() for f in futures) and ahead.result() == "ahead"
    with pytest.raises(RuntimeError, match="closed"):
        executor.submit(lambda: None)


def test_an_executor_needs_a_worker_and_room():
    with pytest.raises(ValueError):
        TransferExecutor(workers=0)
    with pytest.raises(ValueError):
        TransferExecutor(max_queued=0)


def test_a_forked_child_runs_its_reads_on_an_executor_of_its_own(tmp_path):
    """The parent's workers do not exist in a forked child: a tier made before the fork still reads there."""
    import multiprocessing

    from kvtier.transfer.executor import transfer_executor
    from kvtier.tiers import DiskTier

    tier = DiskTier(tmp_path, 1 << 20)
    tier.put_many([(bytes([n]) * 16, bytes([n]) * 100) for n in range(3)])
    parent = transfer_executor()
    assert tier.get_many([bytes([n]) * 16 for n in range(3)]) == [bytes([n]) * 100 for n in range(3)]
    assert parent.num_threads > 0  # the parent's workers are up

    context = multiprocessing.get_context("fork")
    child = context.Process(target=_read_in_child, args=(tier,))
    child.start()
    child.join(DEADLOCK_S)
    if child.is_alive():  # stuck waiting for threads it does not have
        child.kill()
    assert child.exitcode == 0


def _read_in_child(tier) -> None:
    ok = tier.get_many([bytes([n]) * 16 for n in range(3)]) == [bytes([n]) * 100 for n in range(3)]
    raise SystemExit(0 if ok else 1)


@pytest.mark.parametrize("given", [False, True], ids=["the process's executor", "an executor given"])
def test_a_forked_child_writes_on_a_lane_of_its_own(given):
    """The parent's writes thread is held by a write; a child forked then writes on its own thread, and an owner
    made before the fork forgets the parent's write (its join does not wait for it) and an executor it was given
    (the parent's: no thread of it runs in the child)."""
    import multiprocessing

    from kvtier.transfer.executor import Writes, transfer_executor

    parent = TransferExecutor(workers=2) if given else transfer_executor()
    writes = Writes(4, executor=parent if given else None)
    release = threading.Event()
    try:
        assert writes.write(release.wait)
        _until(lambda: writes.num_queued == 0 and writes.num_pending == 1)  # running on the parent's lane
        child = multiprocessing.get_context("fork").Process(target=_write_in_child, args=(writes, id(parent)))
        child.start()
        child.join(DEADLOCK_S)
        if child.is_alive():  # stuck waiting for the parent's lane or its write
            child.kill()
        assert child.exitcode == 0
    finally:
        release.set()
    writes.join()
    if given:
        parent.close()


def _write_in_child(writes, parent_id: int) -> None:
    from kvtier.transfer.executor import transfer_executor

    ran: list[str] = []
    ok = writes.num_pending == 0 and writes.write(lambda: ran.append(threading.current_thread().name))
    writes.join()
    ok = ok and ran == ["kvtier-writes-0"] and id(transfer_executor()) != parent_id
    raise SystemExit(0 if ok else 1)


# -- the writes lane ------------------------------------------------------------------------------------------
def _held_write(executor: TransferExecutor) -> threading.Event:
    """A write that holds the writes thread until the returned event is set (taken off the lane when this returns)."""
    release = threading.Event()
    assert executor.write(release.wait)
    _until(lambda: not executor._writes._tasks and executor._writes._idle == 0)
    return release


def test_writes_run_in_submission_order_on_one_thread(executor):
    release = _held_write(executor)
    ran: list[tuple[int, str]] = []
    try:
        for n in range(20):  # all queued behind the held one
            assert executor.write(lambda n=n: ran.append((n, threading.current_thread().name)))
    finally:
        release.set()
    executor.close()
    assert ran == [(n, "kvtier-writes-0") for n in range(20)]
    assert executor.num_dropped == 0


def test_a_full_writes_lane_drops_the_write_and_counts_its_blocks_without_waiting():
    executor = TransferExecutor(workers=1, max_queued_writes=2)
    release = _held_write(executor)
    try:
        ran: list[int] = []
        assert executor.write(lambda: ran.append(1), blocks=3) and executor.write(lambda: ran.append(2), blocks=4)
        answers: list[bool] = []
        writer = threading.Thread(target=lambda: answers.append(executor.write(lambda: ran.append(3), blocks=5)),
                                  daemon=True)
        writer.start()
        writer.join(DEADLOCK_S)  # a submitter held at the bound would still be alive: a write never waits
        assert answers == [False] and executor.num_dropped == 5
        assert not executor.write(lambda: ran.append(4))  # no blocks: dropped, nothing counted
        assert executor.num_dropped == 5 and executor.num_waits == 0
        release.set()
        executor.close()
        assert ran == [1, 2]
    finally:
        release.set()
        executor.close()


def test_a_task_after_the_writes_is_queued_past_a_full_lane_and_runs_after_them():
    """`after_writes` (a vLLM worker's deletes): never dropped, never waits, runs behind every write
    queued before it."""
    executor = TransferExecutor(workers=1, max_queued_writes=2)
    release = _held_write(executor)
    try:
        ran: list[int] = []
        assert executor.write(lambda: ran.append(1)) and executor.write(lambda: ran.append(2))
        futures = []
        submitter = threading.Thread(target=lambda: futures.append(executor.after_writes(ran.append, 3)), daemon=True)
        submitter.start()
        submitter.join(DEADLOCK_S)
        assert len(futures) == 1 and executor.num_dropped == 0 and executor.num_waits == 0
        release.set()
        futures[0].result(timeout=DEADLOCK_S)
        assert ran == [1, 2, 3]
    finally:
        release.set()
        executor.close()


def test_a_raising_write_is_logged_and_the_lane_goes_on(executor, caplog):
    def fails():
        raise OSError("the pool went away")

    ran: list[int] = []
    assert executor.write(fails) and executor.write(lambda: ran.append(1))
    executor.close()
    assert ran == [1] and executor.num_failed == 1
    assert "the pool went away" in caplog.text


def test_writes_counts_its_own_share_and_joins_only_its_own_writes(executor):
    """Two owners on one lane: each is bound by its own share and counts its own drops (the executor both);
    one owner's join does not wait for the other's write still running."""
    from kvtier.transfer.executor import Writes

    mine, theirs = Writes(1, executor), Writes(8, executor)
    ran: list[str] = []
    release = threading.Event()
    try:
        assert mine.write(lambda: ran.append("mine"), blocks=1)
        assert theirs.write(release.wait, blocks=1)  # holds the lane behind mine
        _until(lambda: ran == ["mine"] and theirs.num_queued == 0)
        joined = threading.Thread(target=mine.join, daemon=True)
        joined.start()
        joined.join(DEADLOCK_S)
        assert not joined.is_alive() and theirs.num_pending == 1  # mine ran; theirs is still running
        assert mine.write(lambda: ran.append("mine 2"), blocks=2)  # queued behind theirs: mine's one place
        assert not mine.write(lambda: ran.append("mine 3"), blocks=3)  # its share is full, the lane is not
        assert (mine.num_dropped, theirs.num_dropped, executor.num_dropped) == (3, 0, 3)
    finally:
        release.set()
    mine.join()
    assert ran == ["mine", "mine 2"] and mine.num_pending == theirs.num_pending == 0


def test_a_write_cannot_wait_for_the_writes_behind_it(executor):
    from kvtier.transfer.executor import Writes

    writes = Writes(4, executor)
    errors: list[BaseException] = []

    def join_from_the_lane():
        try:
            writes.join()
        except RuntimeError as exc:
            errors.append(exc)

    assert writes.write(join_from_the_lane)
    writes.join()
    assert len(errors) == 1
