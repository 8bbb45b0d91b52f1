"""`bench.cpu`: a process group's CPU seconds by process and thread name, from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.bench import cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")

# a process whose thread `kvtier-burn_1` spins for ~0.6 s of CPU, then waits (alive) while its main thread sleeps
_CHILD = """
import threading, time
from kvtier.thread_names import name_os_thread
spun, end = threading.Event(), threading.Event()
def burn():
    name_os_thread()
    stop, spins = time.thread_time() + 0.6, 0
    while time.thread_time() < stop:  # busy: CPU time, not sleep
        spins += 1
    spun.set()
    end.wait()
t = threading.Thread(target=burn, name="kvtier-burn_1")
print("ready", flush=True)
input()
t.start(); spun.wait()
print("spun", flush=True)
input()
end.set()
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def test_a_thread_s_cpu_seconds_are_found_under_its_name_without_its_number(child):
    before = cpu.snapshot(child.pid)
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "spun"
    used = cpu.since(before, cpu.snapshot(child.pid), "child")
    burn = {name: s for name, s in used.items() if name.endswith("/kvtier-burn")}
    assert len(burn) == 1 and 0.5 <= next(iter(burn.values())) <= 1.5, used
    assert sum(s for name, s in used.items() if name not in burn) < 0.2, used  # the main thread slept
    process = next(iter(burn)).partition("/")[0]
    assert process.startswith("child:")
    assert cpu.by_process(used) == {process: pytest.approx(sum(used.values()), abs=0.02)}


def test_only_the_session_s_own_threads_are_counted(child):
    threads = cpu.snapshot(child.pid)
    assert {tid for _, _, tid in threads} == {int(tid) for tid in os.listdir(f"/proc/{child.pid}/task")}
    assert cpu.snapshot(2 ** 22 + 7) == {}  # no such session


def test_a_thread_name_in_any_bytes_is_read(tmp_path):
    """A comm with a ')' , spaces and bytes that are not UTF-8 (a name cut mid-character) still parses."""
    stat = tmp_path / "stat"
    stat.write_bytes(b"42 (a) b \xe2\x82) S 1 42 42 0 -1 4194304 0 0 0 0 250 50 0 0 20 0 1 0 0 0 0")
    comm, fields = cpu._stat(stat)
    assert comm == "a) b \ufffd" and fields[3] == "42" and (fields[11], fields[12]) == ("250", "50")


def test_bench_vllm_adds_the_trees_one_label_names_and_keeps_the_others_apart(child):
    from kvtier.bench.vllm import cpu_since

    sessions = [("vllm", child.pid), ("pool", child.pid), ("pool", child.pid)]
    before = [cpu.snapshot(session) for _, session in sessions]
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "spun"
    used = cpu_since(sessions, before)
    burn = {name.partition(":")[0]: s for name, s in used.items() if name.endswith("/kvtier-burn")}
    assert set(burn) == {"vllm", "pool"} and burn["pool"] == pytest.approx(2 * burn["vllm"], abs=0.05)
