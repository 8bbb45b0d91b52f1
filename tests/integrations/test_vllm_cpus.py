"""Where the connector's threads run beside vLLM's CPU forward (`integrations/vllm/cpus.py`).

The subprocess test reproduces vLLM's binding (OpenMP places one core each, the main thread on the
first): a thread's first torch parallel region would move it onto the master's core; after
`run_torch_here` it stays where it was put. No vLLM needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvtier.integrations.vllm.cpus import omp_env_cpus, partitioned_by_operator, transfer_cpus


def test_transfer_cpus_prefers_the_cores_vllm_reserved():
    # 8 cores, OpenMP on 0-5, 6 and 7 reserved: the connector goes to 6 and 7
    assert transfer_cpus(set(range(8)), set(range(6))) == {6, 7}


def test_transfer_cpus_without_reserved_cores_is_any_core():
    # 2 cores, vLLM reserved none (it wants 2 with a connector): the kernel places the threads
    assert transfer_cpus({0, 1}, {0, 1}) == {0, 1}


def test_transfer_cpus_on_cores_the_operator_partitioned_stay_on_the_worker_s_own():
    # 2 replicas on a 2-core box, VLLM_CPU_OMP_THREADS_BIND=0 and =1: core 1 is the other replica's forward
    assert transfer_cpus({0, 1}, {0}, partitioned=True) == {0}
    assert transfer_cpus({0, 1}, {0}) == {1}  # vLLM's own binding: the core it left is spare
    assert [partitioned_by_operator({"VLLM_CPU_OMP_THREADS_BIND": v}) for v in ("0", "0-3|4-7", "auto", "nobind")] \
        == [True, True, False, False]
    assert not partitioned_by_operator({})


@pytest.mark.parametrize("env, cpus", [
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}, {0, 1}),
    ({"OMP_PLACES": "{0},{1},{2}"}, {0, 1, 2}),
    ({"GOMP_CPU_AFFINITY": "2 3 5"}, {2, 3, 5}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5,6]"}, {4, 5, 6}),
    ({"GOMP_CPU_AFFINITY": "0-3"}, {0, 1, 2, 3}),
    ({}, set()),
])
def test_omp_env_cpus_reads_what_vllm_writes(env, cpus):
    assert omp_env_cpus(env) == cpus


_SCRIPT = textwrap.dedent("""
    import os, threading, torch
    from kvtier.integrations.vllm.cpus import run_torch_here
    x = torch.randn(1 << 22)
    (x * 2).sum()  # the main thread is the OpenMP master, on the first place
    seen = {}
    def job(name, cpus):
        if name == "pinned":
            run_torch_here(cpus)
        else:
            os.sched_setaffinity(0, cpus)
        torch.stack([x * 2, x + 1])  # parallel regions
        seen[name] = sorted(os.sched_getaffinity(0))
    for name in ("pinned", "plain"):
        t = threading.Thread(target=job, args=(name, {0, 1}))
        t.start(); t.join()
    print(seen["pinned"], seen["plain"], sorted(os.sched_getaffinity(0)))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0) & {0, 1}) < 2, reason="needs CPUs 0 and 1")
def test_a_thread_that_runs_torch_here_stays_off_the_masters_core():
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "true"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the plain thread shows the trap (moved onto the master's core 0); ours stays on both cores
    assert out.stdout.split("\n")[0] == "[0, 1] [0] [0]"
