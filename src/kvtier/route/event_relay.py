"""The replicas' KV event streams on their way to the router's selector (`kvtier route --policy dynamo`): each
replica's stream passed on, with two things vLLM's own events do not say.

**A request's tenant on each of its blocks.** NVIDIA Dynamo's indexer (1.6.1) keys a block under its tenant by
the event's `cache_salt` field and ignores the salt vLLM puts in `extra_keys` (on a request's first block only);
vLLM's device events carry no such field, so two tenants' identical prompts would be one entry of the index and
a salted request would match none of its own device blocks. `Tenants` reads the salt where vLLM puts it and
sets `cache_salt` on that block and on every block chained after it (by parent hash), in every medium. kvtier's
own tier events already carry it (`integrations/vllm/kv_events.py`, `server/kv_events.py`); a batch with no
salted block is passed on byte for byte.

**A shared pool's blocks for every replica on it** (`--shared-pool`). A block one replica put in Mooncake or
Redis is a hit for every replica on that pool, so every one of them announces it. What the consumer offers,
measured against Dynamo 1.6.1's selection service (`docs/benchmarks/route.md`):
- its shared-cache notion (`shared_beyond_device_blocks`, credited by `shared_cache_multiplier`) is fed only by
  its own HiCache client, which reads SGLang's Mooncake metadata from Dynamo's discovery plane and queries the
  pool itself: the runtime-free service has no way to turn it on (`shared_cache.enabled` is false);
- a `medium="SHARED"` block is indexed per worker as a lower tier (`disk_blocks`, credit 0.25), under the
  worker whose stream announced it, and found only as the continuation of that worker's own chain of block
  hashes (vLLM's sha256 prefix hashes, the same on every replica unless PYTHONHASHSEED differs);
- so a block is a hit for replica B once B's stream announces it: an event per replica.

So replica i's relayed stream also carries the `SHARED`-medium `BlockStored` / `BlockRemoved` of every other
replica on the pool. A block the pool evicted or lost is announced removed by a replica that announced it, and
relayed it is a miss for all: Redis says when it evicts (its keyspace notifications, which each replica's Redis
tier hears: `tiers/redis_removals.py`); Mooncake says nothing, so there the replica announces it when it finds
it gone (a lookup or a load: `tiers/pool.py`), and until some replica looks the index still counts it and a
request routed on it recomputes the block. Only a replica can name the block: the pool's key is kvtier's (a
chain over the model, layout, codec, tenant and tokens), the event's hash is vLLM's, and only the replica's
tracker (`events/tracker.py`) joins the two.

The selector subscribes to the relay's endpoints instead of the replicas'. The relay numbers its own batches
(from 0, as vLLM does) and answers replay requests for the last `buffer_steps` of each stream at
`replay_endpoints[i]` (vLLM's protocol: a selector that missed batches asks for them by number).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import zmq

from kvtier.events.publisher import ReplayBuffer
from kvtier.events.wire import decode_batch, encode_batch
from kvtier.ports import free_ports
from kvtier.thread_names import named_thread

log = logging.getLogger("kvtier.route")

SHARED_MEDIUMS = ("SHARED",)
BUFFER_STEPS = 10_000  # batches kept per stream for replay (vLLM's default `buffer_steps`)
MAX_SALTED_BLOCKS = 1 << 18  # per stream: the salted blocks whose children may still come, newest kept
_POLL_MS = 100
REPLAY_TIMEOUT_MS = 1000  # waiting for a replica's replay answer (a gap's batches)
LOGGED_UNREADABLE = 3  # unreadable messages logged one by one; the rest counted


def shared_part(batch) -> list | None:
    """The decoded `batch` (`wire.decode_batch`: ts, events, dp_rank) cut down to its blocks in a shared
    medium; None when it has none."""
    events = [e for e in batch[1] if isinstance(e, dict) and e.get("type") in ("BlockStored", "BlockRemoved")
              and e.get("medium") in SHARED_MEDIUMS]
    if not events:
        return None
    return [batch[0], events, *batch[2:]]


def salt_in(extra_keys, lora_name: str | None) -> str | None:
    """The cache_salt in a first block's `extra_keys` entry (vLLM's untagged order: the LoRA name when
    `lora_name` is set, `(mm_identifier, offset)` pairs, the salt, prompt-embeds digests as bytes)."""
    names = [key for key in extra_keys or () if isinstance(key, str)]
    names = names[1:] if lora_name else names
    return names[0] if names else None


class Tenants:
    """One replica's stream: the tenant (`cache_salt`) of each block, learned from its chain's first block."""

    def __init__(self, max_blocks: int = MAX_SALTED_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._salt_of: OrderedDict = OrderedDict()  # block hash -> salt (salted blocks only)

    def tag(self, batch) -> bool:
        """Set `cache_salt` on the batch's salted `BlockStored` events (in place); whether any was set."""
        changed = False
        for event in batch[1]:
            if not isinstance(event, dict) or event.get("type") != "BlockStored":
                continue
            parent = event.get("parent_block_hash")
            salt = event.get("cache_salt") or self._salt_of.get(parent)
            if parent in self._salt_of:
                self._salt_of.move_to_end(parent)  # a hot prefix (a system prompt) stays known
            extra = event.get("extra_keys") or []
            if parent is None and extra:
                salt = salt or salt_in(extra[0], event.get("lora_name"))
            if salt is None:
                continue
            for block_hash in event.get("block_hashes") or []:
                self._salt_of[block_hash] = salt
                self._salt_of.move_to_end(block_hash)
            while len(self._salt_of) > self.max_blocks:
                self._salt_of.popitem(last=False)
            if event.get("cache_salt") != salt:
                event["cache_salt"] = salt
                changed = True
        return changed


class EventRelay:
    """Replicas `sources` (their KV event endpoints, in order); `endpoints[i]` is replica i's stream with each
    salted block's `cache_salt`, and with `shared_pool` (they share one pool) the others' shared blocks in it.

    `source_replays[i]` (replica i's replay endpoint, optional): batches the relay missed from replica i (a gap in
    its sequence numbers: its socket's queue overflowed) are asked for there, as a selector subscribed to the
    replica would have asked, and relayed late; without one a gap is logged and counted (`num_missed`). `host`:
    the relay publishes on `tcp://host:<port>` (a selector on another machine) instead of ipc sockets in
    `run_dir`. A batch it cannot read is passed on as it came; nothing a replica sends stops the relay."""

    def __init__(self, sources: list[str], run_dir: str | Path | None = None, *, shared_pool: bool = False,
                 source_replays: list[str | None] | None = None, host: str | None = None,
                 buffer_steps: int = BUFFER_STEPS) -> None:
        self.sources = list(sources)
        self.source_replays = list(source_replays or [None] * len(sources))
        if len(self.source_replays) != len(self.sources):
            raise ValueError("one replay endpoint (or None) per source")
        self.shared_pool = shared_pool
        self._own_dir = run_dir is None  # a temporary directory of its own, removed at close
        self._dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="kvtier-route-events-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        if host is None:
            self.endpoints = [f"ipc://{self._dir}/replica-{i + 1}.sock" for i in range(len(sources))]
            self.replay_endpoints = [f"ipc://{self._dir}/replica-{i + 1}-replay.sock" for i in range(len(sources))]
        else:
            ports = free_ports(2 * len(sources))
            self.endpoints = [f"tcp://{host}:{port}" for port in ports[:len(sources)]]
            self.replay_endpoints = [f"tcp://{host}:{port}" for port in ports[len(sources):]]
        self._buffers = [ReplayBuffer(buffer_steps) for _ in sources]
        self._tenants = [Tenants() for _ in sources]
        self._next_seq: list[int | None] = [None] * len(sources)  # each source's next batch number, once seen
        self.num_relayed = 0  # shared batches copied into another replica's stream
        self.num_salted = 0  # batches passed on with a `cache_salt` set
        self.num_missed = 0  # a source's batches neither received nor recovered by replay
        self.num_unreadable = 0  # messages passed on as they came (or dropped: not vLLM's 3 frames)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = named_thread(self._run, "kvtier-route-events")

    def start(self) -> EventRelay:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            self.close()
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
        opened = []
        try:
            for source, endpoint, replay_endpoint in zip(self.sources, self.endpoints, self.replay_endpoints):
                sub, pub, replay = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
                opened += [sub, pub, replay]
                for sock in (sub, pub, replay):
                    sock.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(source)
                pub.bind(endpoint)
                replay.bind(replay_endpoint)
                subs.append(sub)
                pubs.append(pub)
                replays.append(replay)
        except BaseException as exc:  # noqa: BLE001 - start() raises it
            self._error = exc
            for sock in opened:
                sock.close(0)
            self._ready.set()
            return
        self._ready.set()
        self._seqs = [0] * len(pubs)
        self._pubs = pubs
        poller = zmq.Poller()
        for sock in subs + replays:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    try:
                        if sock in replays:
                            self._buffers[replays.index(sock)].serve(sock)
                        else:
                            self._receive(subs.index(sock), sock.recv_multipart())
                    except Exception:  # noqa: BLE001 - one bad message or request, never the relay
                        self.num_unreadable += 1
                        if self.num_unreadable <= LOGGED_UNREADABLE:
                            log.exception("kvtier route: a KV event message or replay request failed "
                                          "(`EventRelay.num_unreadable` counts them)")
        finally:
            for sock in subs + pubs + replays:
                sock.close(0)

    def _send(self, i: int, topic: bytes, payload: bytes) -> None:
        self._pubs[i].send_multipart((topic, self._seqs[i].to_bytes(8, "big"), payload))
        self._buffers[i].append(self._seqs[i], payload, topic)
        self._seqs[i] += 1

    def _receive(self, i: int, frames: list[bytes]) -> None:
        """One message from source `i`: vLLM's (topic, seq, batch); a gap before it is fetched first."""
        if len(frames) != 3:
            raise ValueError(f"replica {i + 1}: a message of {len(frames)} frames, not vLLM's 3")
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        expected = self._next_seq[i]
        if expected is not None and seq > expected:
            for topic_, payload_ in self._recover(i, expected, seq):
                self._relay(i, topic_, payload_)
        self._next_seq[i] = seq + 1  # (a lower number: the replica restarted, counting from 0 again)
        self._relay(i, topic, payload)

    def _recover(self, i: int, start: int, end: int) -> list[tuple[bytes, bytes]]:
        """Source `i`'s batches `start` .. `end - 1`, from its replay endpoint (vLLM's protocol); what it no
        longer has (or no endpoint) is counted as missed and logged."""
        got: dict[int, tuple[bytes, bytes]] = {}
        endpoint = self.source_replays[i]
        if endpoint is not None:
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(endpoint)
                dealer.send_multipart((b"", start.to_bytes(8, "big")))
                while dealer.poll(REPLAY_TIMEOUT_MS):
                    _, topic, seq_bytes, payload = dealer.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                    if seq < 0:
                        break
                    if start <= seq < end:
                        got[seq] = (topic, payload)
            finally:
                dealer.close(0)
        missed = (end - start) - len(got)
        if missed:
            self.num_missed += missed
            log.warning("kvtier route: replica %d's KV event batches %d-%d: %d lost before the relay (%s)",
                        i + 1, start, end - 1, missed, "not in its replay buffer" if endpoint else
                        "no --kv-events-replay to ask")
        return [got[seq] for seq in sorted(got)]

    def _relay(self, i: int, topic: bytes, payload: bytes) -> None:
        """Pass source `i`'s batch on (tagged), and its shared blocks to the pool's other replicas."""
        shared = None
        try:
            batch = decode_batch(payload)
            if self._tenants[i].tag(batch):
                payload = encode_batch(*batch)
                self.num_salted += 1
            shared = shared_part(batch) if self.shared_pool else None
        except Exception as exc:  # noqa: BLE001 - not vLLM's batch: passed on as it came
            self.num_unreadable += 1
            if self.num_unreadable <= LOGGED_UNREADABLE:
                    log.warning("kvtier route: an event batch from replica %d passed on as it came (%s: %s)",
                            i + 1, type(exc).__name__, exc)
        self._send(i, topic, payload)
        if shared is None:
            return
        for j in range(len(self._pubs)):
            if j != i:
                self._send(j, topic, encode_batch(*shared))
                self.num_relayed += 1
