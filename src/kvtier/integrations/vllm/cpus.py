"""Where the connector's threads run in vLLM's CPU worker: not bound to the core of the forward's main thread.

vLLM's CPU worker binds its OpenMP threads one per core (`VLLM_CPU_OMP_THREADS_BIND=auto`): the main
thread, which runs the forward's Python and is the OpenMP master, to the first core, the other OpenMP
threads to the rest. A thread inherits the affinity of the thread that starts it, so every thread the
connector started from the worker's main thread (loads, saves, write-back, prefetch, file reads) ran on
the master's core and took its time slices: each millisecond of tier work was a millisecond of the
forward's own Python and its share of every parallel region, with the other cores waiting at the next
barrier. (LMCache's cache server is a process of its own that the kernel places on any core.)

So the connector starts its threads on `transfer_cpus`: the cores vLLM reserved beside the forward
(those no OpenMP thread is bound to; vLLM's NIXL connector moves its own transfers there too) or, where
the forward holds every core (vLLM reserves none when the machine has no more cores than it wants to
reserve), any core: the kernel then runs them where the forward leaves room (the master's core while
the master waits for a layerwise load, say). Pinning them to the cores beside the master instead was
measured slower (docs/benchmarks/vllm.md): a layerwise load then shared a core with a spinning OpenMP
thread while the master's core sat idle. Threads they start inherit the placement.

Except where the operator partitioned the machine (`VLLM_CPU_OMP_THREADS_BIND` set to a core list, e.g. two
replicas on one core each): the cores outside this worker's list are another server's, not spare ones. The
connector's threads then run on the forward's own cores (a layerwise load runs while the master waits for
it). Measured with `kvtier bench route` (2 replicas, one core each): with each replica's loads and saves on
the other replica's core, beside its spinning forward, a 1.5 MB block took 18-82 ms to load from `shm:`
and 47-200 ms to write, so the next turn often found its prefix not yet written (a miss, recomputed).

One more trap: with `OMP_PROC_BIND=true`, a thread's first torch op that opens an OpenMP parallel
region binds that thread to the first place (the master's core) and starts a team beside it. The
threads that run torch copies (loads, saves) call `run_torch_here(cpus)` first: their own parallel
regions use one thread (OpenMP's thread-count setting is per thread: the forward keeps its team), so
nothing rebinds them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier import openmp
from kvtier.thread_names import name_os_thread

log = logging.getLogger("vllm.kvtier")


def transfer_cpus(allowed: set[int], forward: set[int], *, partitioned: bool = False) -> set[int]:
    """The CPUs for the connector's threads. `allowed`: the CPUs the process may use; `forward`: every
    CPU an OpenMP thread of the forward is bound to; `partitioned`: the operator gave this worker its
    cores (`VLLM_CPU_OMP_THREADS_BIND` a list): those outside `forward` are others' work."""
    if partitioned:
        return (allowed & forward) or set(allowed)
    return (allowed - forward) or set(allowed)


def partitioned_by_operator(env: dict[str, str]) -> bool:
    """`VLLM_CPU_OMP_THREADS_BIND` names cores (`0`, `0-3`, `0-3|4-7` per rank) rather than letting vLLM
    choose (`auto`, its default) or leaving the threads unbound (`nobind`, `all`)."""
    return env.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip() not in ("", "auto", "all", "nobind")


def _allowed_cpus() -> set[int]:
    """The CPUs this process may use: its parent's affinity (vLLM's engine core process does not bind
    itself; the worker's own threads are bound by now), or every CPU where that cannot be read."""
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:
        return set(range(os.cpu_count() or 1))


def omp_env_cpus(env: dict[str, str]) -> set[int]:
    """The cores vLLM bound the worker's OpenMP threads to, as it wrote them into the worker's
    environment (`OMP_PLACES={0,1}`, `GOMP_CPU_AFFINITY=0 1`, `KMP_AFFINITY=...,proclist=[0,1]`): the
    OpenMP threads themselves may not have started yet when the connector is built."""
    text = " ".join(filter(None, (env.get("OMP_PLACES"), env.get("GOMP_CPU_AFFINITY"))))
    if proclist := re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", "")):
        text += " " + proclist.group(1)
    cpus: set[int] = set()
    for first, last in re.findall(r"(\d+)(?:-(\d+))?", text):
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def current_transfer_cpus() -> set[int] | None:
    """`transfer_cpus` for this process now, None where nothing is bound (no change to make)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed, main = _allowed_cpus(), os.sched_getaffinity(0)
    if main >= allowed:
        return None  # the calling thread is not bound: its threads may run anywhere already
    env = dict(os.environ)
    forward = main | omp_env_cpus(env)  # vLLM writes the binding it made into our environment
    return transfer_cpus(allowed, forward, partitioned=partitioned_by_operator(env))


@contextmanager
def threads_started_off_forward() -> Iterator[set[int] | None]:
    """Inside, the calling thread runs on `current_transfer_cpus()`, so every thread started here (and
    every thread those start) runs there; the caller's own affinity comes back at the exit."""
    cpus = current_transfer_cpus()
    if cpus is None:
        yield None
        return
    main = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    log.info("kvtier: connector threads on CPUs %s (the forward's main thread is on %s)", sorted(cpus),
             sorted(main))
    try:
        yield cpus
    finally:
        os.sched_setaffinity(0, main)


def run_torch_here(cpus: set[int] | None) -> None:
    """For a thread that runs torch copies beside vLLM's forward: named at the OS level (`thread_names`:
    its CPU time is the connector's in `bench.cpu`); its parallel regions use one thread (this thread's
    OpenMP setting only), so none rebinds it to the master's core; then it runs on `cpus`."""
    name_os_thread()
    if cpus is None:
        return
    openmp.one_thread()
    os.sched_setaffinity(0, cpus)
