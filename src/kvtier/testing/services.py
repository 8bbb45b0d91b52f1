"""The tests' names for the local pool services and ports, which the product owns (`kvtier bench` starts them):
`kvtier.bench.pools` and `kvtier.ports`."""

from kvtier.bench.pools import MooncakePool, RedisServer, Service, start_pool
from kvtier.ports import free_port, wait_port

__all__ = ["MooncakePool", "RedisServer", "Service", "free_port", "start_pool", "wait_port"]
