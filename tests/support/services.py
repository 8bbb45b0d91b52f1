"""Service fixtures: a Mooncake master and a redis-server on 127.0.0.1, started and stopped here.

(Filled in by the tiers work: see docs/ARCHITECTURE.md.)
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mooncake_master():
    pytest.fail("mooncake_master fixture not written yet")


@pytest.fixture(scope="session")
def redis_server():
    pytest.fail("redis_server fixture not written yet")
