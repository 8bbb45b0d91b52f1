"""`CopyGroup`: copies handed to helpers on the transfer executor as they come, the caller joining in at
`finish`; every copy lands, the first error is raised after all ended, and no copy runs after `finish`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvtier.transfer.executor import TransferExecutor
from kvtier.transfer.copies import MAX_COPY_THREADS, CopyGroup, copy_threads, split_copy


def _copies_running(group: CopyGroup) -> int:
    return group._num_active  # helpers that may be copying


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_copy_lands_in_its_strided_view(threads):
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 255, (40, 2, 3, 16, 8), dtype=np.uint8)  # 40 blocks [L=2, H=3, T=16, D=8]
    dst = np.zeros((2, 3, 40 * 16, 8), dtype=np.uint8)               # per-layer [H, capacity, D]
    with CopyGroup(threads) as group:
        for block in range(40):
            for layer in range(2):
                group.add(dst[layer, :, block * 16:(block + 1) * 16], src[block, layer])
        group.finish()
    assert group.num_copies == 80
    assert np.array_equal(dst, src.transpose(1, 2, 0, 3, 4).reshape(2, 3, 40 * 16, 8))
    assert _copies_running(group) == 0


@pytest.mark.parametrize("threads, rows, copies", [(1, 30, 1), (2, 30, 2), (3, 30, 3), (4, 3, 3), (2, 7, 2)])
def test_a_split_copy_is_one_strided_copy_per_thread_over_the_first_axis(threads, rows, copies):
    rng = np.random.default_rng(rows)
    src = rng.integers(0, 255, (rows, 2, 3, 16, 8), dtype=np.uint8)  # a block [L, 2, H, T, D]
    dst = np.zeros((rows, 2, 3, 64, 8), dtype=np.uint8)              # joined layers [L, 2, H, capacity, D]
    with CopyGroup(threads) as group:
        group.add_split(dst[:, :, :, 16:32], src)
    assert group.num_copies == copies
    assert np.array_equal(dst[:, :, :, 16:32], src)
    assert not dst[:, :, :, :16].any() and not dst[:, :, :, 32:].any()


def test_one_thread_copies_on_the_callers_thread_at_once():
    src, dst = np.arange(10, dtype=np.uint8), np.zeros(10, dtype=np.uint8)
    group = CopyGroup(1)
    group.add(dst, src)
    assert np.array_equal(dst, src)  # before finish
    group.finish()


def test_a_failed_copy_is_raised_by_finish_after_the_others_ended():
    dst = [np.zeros(1000, dtype=np.uint8) for _ in range(20)]
    src = np.full(1000, 7, dtype=np.uint8)
    group = CopyGroup(3)
    for i, d in enumerate(dst):
        group.add(d, src if i != 5 else src.reshape(10, 100))  # a shape that cannot go into its view
    with pytest.raises(ValueError):
        group.finish()
    assert _copies_running(group) == 0
    # the copies before the bad one ran; those after it may be skipped, never half-written
    assert all(d.sum() in (0, 7 * 1000) for d in dst) and dst[0].sum() == 7 * 1000


def test_an_error_in_the_with_waits_for_the_helpers_and_propagates():
    group = None
    with pytest.raises(KeyError):
        with CopyGroup(2) as group:
            group.add(np.zeros(10, np.uint8), np.ones(10, np.uint8))
            raise KeyError("the stream failed")
    assert _copies_running(group) == 0


def test_split_copy_covers_sizes_that_do_not_divide():
    src = np.random.default_rng(0).integers(0, 255, 1001, dtype=np.uint8)
    for threads in (1, 2, 3, 4):
        dst = np.zeros_like(src)
        split_copy(dst, src, threads)
        assert np.array_equal(dst, src)


def test_copy_threads_follow_torchs_thread_budget():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert copy_threads() == 1
        torch.set_num_threads(MAX_COPY_THREADS + 4)
        assert copy_threads() == MAX_COPY_THREADS
    finally:
        torch.set_num_threads(before)


def test_a_group_needs_a_thread():
    with pytest.raises(ValueError, match="at least one thread"):
        CopyGroup(0)


def test_finish_never_waits_for_a_helper_still_queued_behind_other_work():
    """Every worker busy (another load's reads): the helpers this group sent are queued; `finish` copies all
    itself and returns, and the helpers that start later find nothing to do."""
    executor = TransferExecutor(workers=1, max_queued=8)
    release = threading.Event()
    try:
        busy = executor.submit(release.wait)
        src = np.arange(100, dtype=np.uint8)
        dst = [np.zeros(100, dtype=np.uint8) for _ in range(10)]
        group = CopyGroup(3, executor)
        for d in dst:
            group.add(d, src)
        finished = threading.Thread(target=group.finish, daemon=True)
        finished.start()
        finished.join(60)  # a failure detector: finish waiting for the busy worker would never return
        assert not finished.is_alive() and all(np.array_equal(d, src) for d in dst)
        release.set()
        assert busy.result(60)
    finally:
        release.set()
        executor.close()
    assert executor.num_threads == 0
