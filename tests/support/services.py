"""Service fixtures: the local pool services of `kvtier.bench.pools`, started once per session on
free 127.0.0.1 ports and stopped after it."""

from __future__ import annotations

import pytest

from kvtier.bench.pools import MooncakePool, RedisServer, Service


def _session_service(service: Service):
    try:
        service.start()
    except (FileNotFoundError, RuntimeError) as exc:
        service.kill()
        pytest.fail(f"cannot start {type(service).__name__}: {exc}")
    try:
        yield service
    finally:
        service.kill()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    yield from _session_service(MooncakePool(tmp_path_factory.mktemp("mooncake")))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    yield from _session_service(RedisServer(tmp_path_factory.mktemp("redis")))


@pytest.fixture(params=["mooncake", "redis"])
def pool_service(request):
    """Each pool backend in turn (the same tests run against both)."""
    return request.getfixturevalue("mooncake_master" if request.param == "mooncake" else "redis_server")
