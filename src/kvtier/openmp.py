"""torch's OpenMP runtime, thread by thread: one team of intra-op threads per process, the forward's.

torch's CPU build (libgomp) gives every thread that opens a parallel region its own team: the thread
plus `torch.get_num_threads() - 1` pool threads, kept until that thread exits. Once the process holds
more such threads than it has cores, libgomp throttles every team's spin-wait: a pool thread then sleeps
between parallel regions instead of spinning, and the master pays a futex wake-up at each of the
hundreds of regions of a forward step. Two teams on the 2-core box are enough: the thread that loaded
the model (its weight copies opened a team) and the engine's loop thread, which runs the forward. A
decode step of one sequence took 54-61 ms on the loop thread against 34 ms on the loading thread
(docs/benchmarks/serve.md). So:

- `release_team()`: the calling thread gives its team back (OpenMP 5's `omp_pause_resource_all`):
  `AsyncEngine.start` calls it, so the forward's team on the loop thread is the only one;
- `one_thread()`: the calling thread's own parallel regions use one thread (the OpenMP setting is per
  thread), so a helper thread that runs torch copies never opens a second team.

Both are no-ops where torch's OpenMP runtime cannot be found (another build, another platform).
(vLLM's CPU worker has the same trap: `kvtier.integrations.vllm.cpus`.)

With one team, its threads spin between regions (libgomp's default: ~300,000 spins, a few ms) — the
speed above on a box the server has to itself (the benchmarked configuration, and vLLM's). Beside another
busy process on the same cores it collapses: a spinning thread keeps its core while its partner waits for a
time slice, at each region (a `kvtier serve` decode step went from 35 ms to 1.4 s beside a test run). There,
start the server with `GOMP_SPINCOUNT=2000` (libgomp's own variable, read when torch loads): measured 73-109
ms a step beside the test run, but 49-52 vs 41-42 ms on a quiet box (docs/benchmarks/serve.md); so it is not
the default.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the calling thread's threads, keep the runtime


def torch_openmp_path(mapped_paths: list[str], torch_dir: str) -> str | None:
    """Of the OpenMP runtimes mapped into this process, torch's own: a process may map more than one
    (vLLM's worker maps sentencepiece's libgomp too), and setting another copy's thread count changes
    nothing for torch. A runtime under torch's directory first, else the only one there is."""
    runtimes = sorted({path for path in mapped_paths if re.search(r"lib(gomp|iomp5?|omp)[-.]", Path(path).name)})
    ours = [path for path in runtimes if path.startswith(torch_dir.rstrip("/") + "/")]
    if ours:
        return ours[0]
    return runtimes[0] if len(runtimes) == 1 else None


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """torch's OpenMP runtime, loaded (already mapped: this only finds it); None where there is none."""
    import torch

    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/" in line]
    except OSError:
        return None
    path = torch_openmp_path(paths, os.path.dirname(torch.__file__))
    return ctypes.CDLL(path) if path is not None else None


def release_team() -> bool:
    """Give the calling thread's OpenMP team back (its pool threads exit); True if the runtime did. A later
    parallel region of this thread starts a new team."""
    omp = runtime()
    if omp is None or not hasattr(omp, "omp_pause_resource_all"):
        return False
    return omp.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def one_thread() -> bool:
    """The calling thread's parallel regions run on itself alone from now on; True if set."""
    omp = runtime()
    if omp is None:
        return False
    omp.omp_set_num_threads(1)
    return True


def team_size() -> int:
    """How many threads the calling thread's next parallel region would use (1 without the runtime)."""
    omp = runtime()
    return omp.omp_get_max_threads() if omp is not None else 1
