"""torch's OpenMP runtime per thread (`kvtier/openmp.py`): one team of intra-op threads, the forward's.

Each test runs in a subprocess: OpenMP teams belong to threads and live as long as they do, and the
pytest process's own threads must not leak into the counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier import openmp
from kvtier.openmp import torch_openmp_path

needs_two_threads = pytest.mark.skipif(openmp.runtime() is None or torch.get_num_threads() < 2,
                                       reason="needs torch's OpenMP runtime and 2 intra-op threads")


def test_the_openmp_runtime_found_is_torchs_own_not_another_packages_copy():
    # what vLLM's CPU worker maps: sentencepiece's libgomp first, then torch's
    site = "/venv/lib/python3.11/site-packages"
    maps = [f"{site}/sentencepiece.libs/libgomp-6a29c32d.so.1.0.0", f"{site}/torch/lib/libtorch_cpu.so",
            f"{site}/torch/lib/libgomp.so.1", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
    assert torch_openmp_path(maps, f"{site}/torch") == f"{site}/torch/lib/libgomp.so.1"
    assert torch_openmp_path(maps[:1], f"{site}/torch") == maps[0]  # the only runtime there is
    assert torch_openmp_path(maps[:1] + ["/opt/libiomp5.so"], f"{site}/torch") is None  # which one? none
    assert torch_openmp_path([f"{site}/torch/lib/libiomp5.so"], f"{site}/torch") == f"{site}/torch/lib/libiomp5.so"


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
    return env | {"OMP_NUM_THREADS": "2"}


def _run(script: str, **env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=120, env=_env() | env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


_COUNT = """
    import os, threading, time, torch
    from kvtier import openmp
    x = torch.randn(1 << 22)
    def threads():
        time.sleep(0.2)  # released pool threads exit right after their last barrier
        return len(os.listdir("/proc/self/task"))
"""


@needs_two_threads
def test_release_team_lets_the_calling_threads_pool_threads_go():
    base, team, released, again = _run(_COUNT + """
    base = threads()
    (x * 2).sum()  # a parallel region: a team of 2, one more thread
    team = threads()
    assert openmp.release_team()
    released = threads()
    (x * 2).sum()  # the next region starts a new team
    print(base, team, released, threads())
    """)
    assert int(team) == int(base) + 1 and int(released) == int(base) and int(again) == int(team)


@needs_two_threads
def test_one_thread_keeps_a_helper_thread_from_starting_a_team():
    sizes = _run(_COUNT + """
    (x * 2).sum()  # the main thread's team
    base = threads()
    seen = []
    def helper(one):
        if one:
            openmp.one_thread()
        seen.append(openmp.team_size())
        torch.stack([x * 2, x + 1])  # parallel regions
        seen.append(threads() - 1)  # this thread itself
    for one in (True, False):
        t = threading.Thread(target=helper, args=(one,)); t.start(); t.join()
    print(base, *seen, openmp.team_size())
    """)
    base, one_size, one_threads, plain_size, plain_threads, main_size = map(int, sizes)
    assert (one_size, one_threads) == (1, base)          # no team of its own
    assert (plain_size, plain_threads) == (2, base + 1)  # the trap: a second team, one more thread
    assert main_size == 2                                # the setting is per thread


@needs_two_threads
def test_async_engine_start_releases_the_callers_team():
    base, loaded, started = _run(_COUNT + """
    from kvtier import models
    from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
    base = threads()
    model = models.load("tiny", device="cpu")
    (x * 2).sum()  # like a real model's load: the caller's team
    loaded = threads()
    engine = AsyncEngine(LLMEngine(model, EngineConfig(device_kv_budget_bytes=1 << 20, block_tokens=8)))
    engine.start()  # + the loop thread, without the caller's pool thread
    print(base, loaded, threads())
    engine.shutdown()
    """)
    assert int(loaded) == int(base) + 1 and int(started) == int(base) + 1


def test_kvtier_serve_leaves_the_spin_wait_to_libgomp_or_the_operator():
    """The benchmarked configuration (and vLLM's) is libgomp's default spin; GOMP_SPINCOUNT, set by whoever
    starts the server on shared cores, reaches libgomp untouched."""
    script = """
    import os, sys
    import kvtier.server.cli as serve_cli
    from kvtier.cli import main

    def build_app(config):  # where the model would load: stop there
        print(os.environ.get("GOMP_SPINCOUNT"))
        raise SystemExit(0)
    serve_cli.build_app = build_app
    main(["serve"])
    """
    assert _run(script) == ["None"]
    assert _run(script, GOMP_SPINCOUNT="2000") == ["2000"]
