"""Building kvtier's C++ CPU kernels (the paged attention, the few-rows linear) once per CPU and torch.

`torch.utils.cpp_extension.load_inline` compiles a source into `$TORCH_EXTENSIONS_DIR` the first time (a few tens
of seconds) and loads it from there afterwards. The name carries a digest of the source, torch's version and the CPU
capability: the build is `-march=native`, so a cache shared by two machines never hands one the other's code.
"""

from __future__ import annotations

import hashlib
import logging

import torch

log = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-mprefer-vector-width=512"]


def build(prefix: str, source: str, what: str) -> bool:
    """Compile and load `source` (its `TORCH_LIBRARY` ops then live under `torch.ops`); False, logged once by the
    caller's `what`, where it cannot be built (no compiler, no ninja)."""
    from torch.utils.cpp_extension import load_inline

    cpu = torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha256(f"{source}{torch.__version__}{cpu}".encode()).hexdigest()[:12]
    try:
        load_inline(f"{prefix}_{digest}", cpp_sources=source, is_python_module=False, extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 — no compiler, no ninja: the caller keeps its torch path
        log.warning("%s could not be built (%s); torch's own path is used instead", what, exc)
        return False
    return True
