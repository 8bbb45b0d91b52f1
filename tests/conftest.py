"""Shared fixtures: data paths, tiny random-weight models, the real SmolLM2, and services."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.models import smollm2, tiny_model, tiny_swa_model  # noqa: E402,F401
from support.services import mooncake_master, redis_server  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("KVTIER_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shakespeare_text() -> str:
    path = SHARED_DATA / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.fail(f"missing shared data file {path}")
    return path.read_text()


@pytest.fixture(scope="session")
def mooncake_trace_path() -> Path:
    path = SHARED_DATA / "mooncake_synthetic_trace.jsonl"
    if not path.is_file():
        pytest.fail(f"missing shared data file {path}")
    return path
