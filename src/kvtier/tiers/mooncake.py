"""The Mooncake Store pool tier (`mooncake-transfer-engine-non-cuda`; TCP here, RDMA where the NICs exist).

A pool is one `mooncake_master` plus the memory segments its clients contribute. Start one on a
host that every server can reach:

    mooncake_master --enable_http_metadata_server=true --http_metadata_server_host=0.0.0.0 \\
        --http_metadata_server_port=8080 --rpc_port=50051
    mooncake_client --master_server_address=HOST:50051 --metadata_server=http://HOST:8080/metadata \\
        --global_segment_size=64GB --host=HOST        # a memory server: the pool outlives any one kvtier

Tier spec: `mooncake://HOST:50051[?metadata=URL&segment=SIZE&buffer=SIZE&protocol=tcp|rdma&device=mlx5_0]`
(`mooncake:HOST:50051` works too). `metadata` defaults to `http://HOST:8080/metadata`; `segment` is
the memory this process contributes to the pool (default 0: a `mooncake_client` memory server holds
the pool, so blocks outlive the process); `buffer` is the client's transfer buffer (default 256MiB).
The store client takes concurrent calls (it releases the GIL), but a get and a put in flight
together share that buffer — a put that does not fit is refused (-600) and a get that does not fit
comes back empty — so each side moves at most half of it per call. The master evicts when its
segments fill.

Restores (`lease`) have the store write each block straight into a buffer of our own
(`batch_get_into`): page-aligned, registered with the store once (RDMA needs that), reused, so a
restore neither allocates nor copies out of the transfer buffer — twice the speed of `get_batch`,
which returns fresh `bytes`, on a local pool here.
"""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlsplit

from kvtier.errors import UserError
from kvtier.tiers.buffers import ReadBuffers, address
from kvtier.tiers.pool import PoolError, PoolFullError, PoolTier
from kvtier.tiers.spec import TierSpec
from kvtier.units import parse_bytes

log = logging.getLogger(__name__)
RPC_FAIL = -900          # the master is unreachable
OBJECT_NOT_FOUND = -704  # batch_get_into: no such key (a miss); other codes: read it with get_batch
DEFAULT_BUFFER = 256 << 20
PROBE_TIMEOUT_S = 1.0
KEY_PROBE = "kvtier:probe"  # looked up after setup: a master that answers is a live pool


def _reachable(host: str, port: int) -> bool:
    """A TCP connect first: the store's own setup against a dead master retries for about a minute."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _chunks(items: list[tuple[str, bytes]], budget_bytes: int) -> list[list[tuple[str, bytes]]]:
    """Consecutive runs of items of at most `budget_bytes` together (an item larger than that alone)."""
    chunks: list[list[tuple[str, bytes]]] = []
    size = 0
    for item in items:
        if not chunks or size + len(item[1]) > budget_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += len(item[1])
    return chunks


class MooncakeBackend:
    def __init__(self, master: str, metadata: str, *, segment_bytes: int = 0, buffer_bytes: int = DEFAULT_BUFFER,
                 protocol: str = "tcp", device: str = "", local_hostname: str | None = None) -> None:
        self.master = master
        self.metadata = metadata
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.protocol = protocol
        self.device = device
        self.local_hostname = local_hostname or master.rpartition(":")[0]
        self._store = None
        self._block_hint = 0  # largest block seen: sizes batched gets to the transfer buffer
        self._buffers: ReadBuffers | None = None  # lease()'s, registered with the current store

    def _live(self):
        if self._store is None:
            raise PoolError("not connected")
        return self._store

    def connect(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        metadata = urlsplit(self.metadata)
        for host, port, what in ((*self.master.rsplit(":", 1), "master"),
                                 (metadata.hostname, metadata.port or 80, "metadata server")):
            if not _reachable(host, int(port)):
                raise PoolError(f"mooncake {what} {host}:{port} is not reachable")
        store = MooncakeDistributedStore()
        rc = store.setup(self.local_hostname, self.metadata, self.segment_bytes, self.buffer_bytes,
                         self.protocol, self.device, self.master)
        if rc != 0:
            raise PoolError(f"setup against master {self.master} failed with code {rc}")
        if store.is_exist(KEY_PROBE) < 0:
            store.close()
            raise PoolError(f"master {self.master} does not answer")
        self._store = store
        self._buffers = ReadBuffers(on_map=lambda buf: self._register(store, buf),
                                    on_unmap=lambda buf: self._unregister(store, buf))

    @staticmethod
    def _register(store, buf) -> None:
        rc = store.register_buffer(address(buf), len(buf))
        if rc != 0:
            raise PoolError(f"register_buffer failed with code {rc}")

    def _unregister(self, store, buf) -> None:
        if store is self._store:  # a closed store has forgotten its buffers (and must not be called)
            store.unregister_buffer(address(buf))

    def exists(self, names: list[str]) -> list[bool]:
        codes = self._live().batch_is_exist(names)
        if any(c < 0 for c in codes):
            raise PoolError(f"batch_is_exist failed with code {min(codes)}")
        return [c == 1 for c in codes]

    def get(self, names: list[str]) -> list[bytes | None]:
        store = self._live()
        if not self._block_hint and names:
            self._block_hint = max(store.get_size(names[0]), 1)
        per_call = max(1, self.buffer_bytes // 2 // max(self._block_hint, 1))
        out: list[bytes | None] = []
        for i in range(0, len(names), per_call):
            for data in store.get_batch(names[i:i + per_call]):
                out.append(data if data else None)
                self._block_hint = max(self._block_hint, len(data))
        return out

    def lease(self, names: list[str]) -> list[tuple[memoryview, tuple[ReadBuffers | None, object]] | None]:
        """Each block read straight into one of our registered buffers (`batch_get_into`): a
        read-only view of it and what `release` needs to give the buffer back. A block larger than
        the buffers (sized to the largest block seen), or refused for another reason, is read with
        `get_batch` instead; so is everything when no buffer can be registered."""
        store, buffers = self._live(), self._buffers
        if not names:
            return []
        if not self._block_hint:
            self._block_hint = max(store.get_size(names[0]), 1)
        bufs: list = []
        try:
            bufs.extend(buffers.take(self._block_hint) for _ in names)
        except PoolError as exc:  # registration refused (RDMA memory limits): the copying read
            log.warning("mooncake: no read buffer (%s); reading with get_batch", exc)
            self.release([(buffers, buf) for buf in bufs])
            return self._copied(names)
        codes = store.batch_get_into(names, [address(buf) for buf in bufs], [len(buf) for buf in bufs])
        if codes and all(code == RPC_FAIL for code in codes):
            self.release([(buffers, buf) for buf in bufs])
            raise PoolError(f"batch_get_into failed: master {self.master} unreachable")
        out: list = []
        retry: list[int] = []
        for i, (buf, code) in enumerate(zip(bufs, codes)):
            if code >= 0:
                out.append((memoryview(buf)[:code].toreadonly(), (buffers, buf)))
                continue
            buffers.give(buf)
            out.append(None)
            if code != OBJECT_NOT_FOUND:
                retry.append(i)
        if retry:
            try:
                for i, item in zip(retry, self._copied([names[i] for i in retry])):
                    out[i] = item
            except PoolError:
                self.release([item[1] for item in out if item is not None])
                raise
        return out

    def _copied(self, names: list[str]) -> list:
        """`get`'s blocks in `lease`'s form: nothing to give back."""
        return [None if data is None else (memoryview(data), (None, data)) for data in self.get(names)]

    def release(self, leased: list[tuple[ReadBuffers | None, object]]) -> None:
        """Give back the buffers of `lease` (each to the pool it came from: a buffer of a store since
        closed is unmapped)."""
        for buffers, buf in leased:
            if buffers is not None:
                buffers.give(buf)

    def put(self, items: list[tuple[str, bytes]]) -> None:
        self._block_hint = max([self._block_hint, *(len(d) for _, d in items)])
        for chunk in _chunks(items, self.buffer_bytes // 2):
            rc = self._live().put_batch([n for n, _ in chunk], [d for _, d in chunk])
            if rc == RPC_FAIL:
                raise PoolError(f"put failed: master {self.master} unreachable")
            if rc < 0:
                raise PoolFullError(f"put refused with code {rc}")

    def remove(self, name: str) -> bool:
        rc = self._live().remove(name, True)
        if rc == RPC_FAIL:
            raise PoolError(f"remove failed: master {self.master} unreachable")
        return rc == 0

    def used_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        if self._buffers is not None:
            buffers, self._buffers = self._buffers, None
            buffers.close()
        if self._store is not None:
            store, self._store = self._store, None
            store.close()


def parse_spec(spec: str | TierSpec) -> MooncakeBackend:
    """`mooncake://HOST:PORT?...` or `mooncake:HOST:PORT?...` -> a backend (not yet connected)."""
    spec = TierSpec.parse(spec)
    if spec.kind != "mooncake":
        raise UserError(f"not a mooncake tier spec: {spec.text!r}")
    options, host = spec.options, spec.url.rpartition(":")[0]
    return MooncakeBackend(
        spec.url, options.get("metadata", f"http://{host}:8080/metadata"),
        segment_bytes=parse_bytes(options.get("segment", "0")),
        buffer_bytes=parse_bytes(options.get("buffer", "256MiB")),
        protocol=options.get("protocol", "tcp"), device=options.get("device", ""), local_hostname=options.get("local"))


def mooncake_tier(spec: str | TierSpec, *, connect: bool = True) -> PoolTier:
    return PoolTier("mooncake", parse_spec(spec), connect=connect)
