"""Where the project's shared data files live (`../shared/data/` beside the checkout).

Looked up, in order: `$KVTIER_SHARED_DATA`; a `shared/data` folder beside the checkout or any folder
above it (or above the current directory); `/work/shared/data`. The files are read in place, never
copied into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

SHAKESPEARE = "tinyshakespeare.txt"
MOONCAKE_TRACE = "mooncake_synthetic_trace.jsonl"
_FALLBACK = Path("/work/shared/data")


def shared_data_dirs() -> list[Path]:
    dirs: list[Path] = []
    if env := os.environ.get("KVTIER_SHARED_DATA"):
        dirs.append(Path(env))
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        dirs += [parent / "shared" / "data" for parent in start.parents]
    dirs.append(_FALLBACK)
    return list(dict.fromkeys(dirs))


def shared_data_file(name: str) -> Path:
    """The path of shared data file `name`; FileNotFoundError (naming where it looked) if absent."""
    dirs = shared_data_dirs()
    for d in dirs:
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"shared data file {name} not found; looked in $KVTIER_SHARED_DATA and "
                            f"{', '.join(map(str, dirs[:3]))}, …")
