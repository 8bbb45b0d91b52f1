"""Where a server's CPU time goes: the CPU seconds (user + system) of every thread of a process group, from
`/proc`, grouped by process and thread name. A benchmark takes one snapshot before its measured part and one
after (`since`): on a box whose cores the forward already fills, a connector's cost is the CPU its threads
and hooks take from it, wherever they run (the engine core, the worker, a cache server of its own).

Names are `<label>:<process>/<thread>`: the label says which process tree (a system may start several: vLLM
and LMCache's cache server, a disaggregated pair, a pool), thread names are grouped without their numbers
(`kvtier-load_0` and `kvtier-load_1` are `kvtier-load`). A thread that ended between the snapshots is missing
from the second (its time is lost, so the long-lived threads of a server are what this measures). Linux
only: elsewhere a snapshot is empty."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NUMBERED = re.compile(r"[-_:.]?\d+$")

Snapshot = dict[tuple[str, str, int], float]  # (process name, thread name, thread id) -> CPU seconds


def _stat(path: Path) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a `/proc/.../stat`, None if it is gone."""
    try:
        text = path.read_bytes().decode(errors="replace")  # a thread may name itself in any bytes
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    return head.partition("(")[2], rest.split()


def snapshot(session: int) -> Snapshot:
    """Every thread of every process in `session` (a server started with `start_new_session`: its pid)."""
    out: Snapshot = {}
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return out
    for pid in pids:
        stat = _stat(Path(f"/proc/{pid}/stat"))
        if stat is None or int(stat[1][3]) != session:  # fields after comm: state, ppid, pgrp, session, ...
            continue
        process = stat[0]
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            thread = _stat(Path(f"/proc/{pid}/task/{tid}/stat"))
            if thread is not None:
                utime, stime = int(thread[1][11]), int(thread[1][12])
                out[(process, thread[0], int(tid))] = (utime + stime) / _TICKS
    return out


def since(before: Snapshot, after: Snapshot, label: str) -> dict[str, float]:
    """CPU seconds between two snapshots of one session, by `label:process/thread` (numbers stripped),
    largest first."""
    used: Counter = Counter()
    for key, seconds in after.items():
        process, thread, _ = key
        used[f"{label}:{process}/{_NUMBERED.sub('', thread)}"] += seconds - before.get(key, 0.0)
    return {name: round(seconds, 2) for name, seconds in used.most_common() if seconds > 0}


def by_process(used: dict[str, float]) -> dict[str, float]:
    """`since`'s figures summed per `label:process`."""
    out: Counter = Counter()
    for name, seconds in used.items():
        out[name.partition("/")[0]] += seconds
    return {name: round(seconds, 2) for name, seconds in out.most_common()}
