"""The `kvtier` command as `python -m kvtier` (what a user without the console script on PATH runs)."""

from __future__ import annotations

import subprocess
import sys


def test_python_dash_m_runs_the_kvtier_command():
    out = subprocess.run([sys.executable, "-m", "kvtier", "plan", "--model", "llama-3.1-8b", "--context", "8k",
                          "--gpu", "h100-80gb"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "llama" in out.stdout.lower()
    bad = subprocess.run([sys.executable, "-m", "kvtier", "plan", "--model", "no-such-model"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "kvtier: error" in bad.stderr
