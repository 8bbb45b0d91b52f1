"""`thread_names`: kvtier's threads named where the OS shows them (what `bench.cpu` groups by)."""

from __future__ import annotations

import sys
import threading

import pytest

from kvtier.thread_names import name_os_thread, named_thread, os_thread_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")


def test_a_thread_takes_its_python_name_at_the_os_level_cut_to_15_bytes():
    seen = {}

    def run():
        seen["before"] = os_thread_name()
        name_os_thread()
        seen["after"] = os_thread_name()
        name_os_thread("kvtier-a-very-long-name")
        seen["long"] = os_thread_name()
        name_os_thread("kvtier-loadX\u00e9\u00e9\u00e9")  # the 15th byte is half of the second \u00e9
        seen["cut"] = os_thread_name()

    thread = threading.Thread(target=run, name="kvtier-load_0")
    thread.start()
    thread.join()
    if sys.version_info < (3, 14):
        assert seen["before"] != "kvtier-load_0"  # Python before 3.14 does not name it
    assert seen["after"] == "kvtier-load_0" and seen["long"] == "kvtier-a-very-l"
    assert seen["cut"] == "kvtier-loadX\u00e9"  # a character cut in two is left out
    assert os_thread_name() != "kvtier-load_0"  # the caller's own name is untouched


def test_named_thread_runs_its_target_under_its_name_at_the_os_level():
    seen = []
    thread = named_thread(lambda: seen.append(os_thread_name()), "kvtier-retry")
    assert thread.daemon and thread.name == "kvtier-retry"
    thread.start()
    thread.join()
    assert seen == ["kvtier-retry"]
