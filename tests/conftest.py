"""Shared fixtures: data paths, tiny random-weight models, the real SmolLM2, and services."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.models import smollm2, tiny_model, tiny_swa_model  # noqa: E402,F401
from support.services import mooncake_master, pool_service, redis_server  # noqa: E402,F401

from kvtier.data import MOONCAKE_TRACE, SHAKESPEARE, shared_data_file  # noqa: E402


@pytest.fixture(scope="session")
def shakespeare_text() -> str:
    return shared_data_file(SHAKESPEARE).read_text()


@pytest.fixture(scope="session")
def mooncake_trace_path() -> Path:
    return shared_data_file(MOONCAKE_TRACE)
