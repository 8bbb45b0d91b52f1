"""A shared pool in the router's index: a block one replica put in Mooncake or Redis is a hit for every
replica on that pool, so every one of them announces it.

What the consumer offers, measured against NVIDIA Dynamo 1.6.1's selection service (`docs/benchmarks/route.md`):
- its shared-cache notion (`shared_beyond_device_blocks`, credited by `shared_cache_multiplier`) is fed only by
  its own HiCache client, which reads SGLang's Mooncake metadata from Dynamo's discovery plane and queries the
  pool itself: the runtime-free service has no way to turn it on (`shared_cache.enabled` is false);
- a `medium="SHARED"` block is indexed per worker as a lower tier (`disk_blocks`, credit 0.25), under the
  worker whose stream announced it, and found only as the continuation of that worker's own chain of block
  hashes (vLLM's sha256 prefix hashes, the same on every replica unless PYTHONHASHSEED differs);
- so a block is a hit for replica B once B's stream announces it: an event per replica.

`PoolEventRelay` does that without touching the replicas: it subscribes to each replica's vLLM KV event
stream (`--kv-events-config`) and publishes, per replica, that stream unchanged plus the `SHARED`-medium
`BlockStored` / `BlockRemoved` of every other replica on the pool. The selector subscribes to the relay's
endpoints instead of the replicas'. A block the pool evicted or lost is announced removed by a replica that
announced it, and relayed it is a miss for all: Redis says when it evicts (its keyspace notifications, which
each replica's Redis tier hears: `tiers/redis_removals.py`); Mooncake says nothing, so there the replica
announces it when it finds it gone (a lookup or a load: `tiers/pool.py`), and until some replica looks the
index still counts it and a request routed on it recomputes the block. Only a replica can name the block:
the pool's key is kvtier's (a chain over the model, layout, codec, tenant and tokens), the event's hash is
vLLM's, and only the replica's tracker (`events/tracker.py`) joins the two. The relay numbers its own
batches (from 0, as vLLM does) and answers replay requests for the last `buffer_steps` of each stream at
`replay_endpoints[i]` (vLLM's protocol: a selector that missed batches asks for them by number).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path

import msgpack
import zmq

from kvtier.events.publisher import ReplayBuffer

log = logging.getLogger("kvtier.route")

SHARED_MEDIUMS = ("SHARED",)
BUFFER_STEPS = 10_000  # batches kept per stream for replay (vLLM's default `buffer_steps`)
_POLL_MS = 100


def shared_part(payload: bytes) -> bytes | None:
    """The batch `payload` (vLLM's msgpack `KVEventBatch`: [ts, events, dp_rank]) cut down to its blocks
    in a shared medium; None when it has none."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    events = [e for e in batch[1] if isinstance(e, dict) and e.get("type") in ("BlockStored", "BlockRemoved")
              and e.get("medium") in SHARED_MEDIUMS]
    if not events:
        return None
    return msgpack.packb([batch[0], events, *batch[2:]], use_bin_type=True)


class PoolEventRelay:
    """Replicas `sources` (their KV event endpoints, in order) share one pool; `endpoints[i]` is replica
    i's stream with the others' shared blocks in it."""

    def __init__(self, sources: list[str], run_dir: str | Path | None = None, *,
                 buffer_steps: int = BUFFER_STEPS) -> None:
        self.sources = list(sources)
        self._own_dir = run_dir is None  # a temporary directory of its own, removed at close
        self._dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="kvtier-route-pool-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self.endpoints = [f"ipc://{self._dir}/replica-{i + 1}.sock" for i in range(len(sources))]
        self.replay_endpoints = [f"ipc://{self._dir}/replica-{i + 1}-replay.sock" for i in range(len(sources))]
        self._buffers = [ReplayBuffer(buffer_steps) for _ in sources]
        self.num_relayed = 0  # shared batches copied into another replica's stream
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvtier-pool-events", daemon=True)

    def start(self) -> PoolEventRelay:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        subs, pubs, replays = [], [], []
        try:
            for source, endpoint, replay_endpoint in zip(self.sources, self.endpoints, self.replay_endpoints):
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.LINGER, 0)
                sub.connect(source)
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.bind(endpoint)
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(replay_endpoint)
                subs.append(sub)
                pubs.append(pub)
                replays.append(replay)
        except BaseException as exc:  # noqa: BLE001 - start() raises it
            self._error = exc
        self._ready.set()
        seqs = [0] * len(pubs)

        def send(i: int, topic: bytes, payload: bytes) -> None:
            pubs[i].send_multipart((topic, seqs[i].to_bytes(8, "big"), payload))
            self._buffers[i].append(seqs[i], payload, topic)
            seqs[i] += 1

        poller = zmq.Poller()
        for sock in subs + replays:
            poller.register(sock, zmq.POLLIN)
        try:
            while self._error is None and not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    if sock in replays:
                        self._buffers[replays.index(sock)].serve(sock)
                        continue
                    i = subs.index(sock)
                    topic, _, payload = sock.recv_multipart()
                    send(i, topic, payload)
                    try:
                        shared = shared_part(payload)
                    except (ValueError, TypeError, IndexError, msgpack.ExtraData) as exc:
                        log.warning("kvtier route: an event batch from replica %d not relayed (%s)", i + 1, exc)
                        continue
                    if shared is None:
                        continue
                    for j in range(len(pubs)):
                        if j != i:
                            send(j, topic, shared)
                            self.num_relayed += 1
        finally:
            for sock in subs + pubs + replays:
                sock.close(0)
