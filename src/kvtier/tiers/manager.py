"""The tier stack: lookup across tiers, verified reads, promotion, write-through and demotion.

Tiers are ordered top (fastest) first. `put_many` writes the top tier synchronously and the
lower tiers on one worker thread (write-through, so a second process on the same SSD or pool sees
the blocks); blocks the top tier evicts are demoted to the next tier. Reads are batched per tier.
Every block read is checked with `codecs.header.verify(data, key)` — intact, and the block its key
names: a corrupt or substituted block is deleted, counted, and ends the prefix there — the caller
recomputes from that point.

Health (`tiers.health`): each tier is readable and writable, or not. Reads skip a tier that is not
readable, writes one that is not writable (a full disk still serves reads); a tier that raises is
turned off both ways. One retry thread probes each tier that is down (`reconnect()`) when its
back-off has passed — whether or not requests arrive — with the back-off growing while probes fail
and across quick relapses. Each tier has a read lock and a write lock: a slow pool put on the
writer thread never holds up a lookup on the compute path. The manager never calls up into its
callers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

from kvtier.codecs.header import CorruptBlockError, Header, verify
from kvtier.tiers import Backoff, Tier, TierHealth, TierStats, make_tier
from kvtier.tiers.host import HostTier

log = logging.getLogger(__name__)

STREAM_CHUNK_BLOCKS = 4  # stream() fetches this many blocks per batched get, one chunk ahead


@dataclass(slots=True)
class PrefixMatch:
    """The longest cached prefix of some keys: which tier holds each of its blocks (ids, no data)."""

    keys: list[bytes]
    tier_indices: list[int]   # into TierManager.tiers
    tiers: list[str]          # the same, by name

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class Prefix:
    """Blocks read for a match, each verified to be the block its key names; possibly shorter than
    the match (a block evicted meanwhile, or bad). `headers` let callers decode without a second check.
    Read with `lease=True`, payloads may be views of a tier's own memory (DRAM slots, pinned): the
    caller copies what it needs, then calls `release()` (idempotent; a no-op otherwise)."""

    payloads: list[bytes | memoryview]
    headers: list[Header]
    tiers: list[str]          # the tier each block came from
    leases: list[tuple[Tier, list[bytes]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.payloads)

    def release(self) -> None:
        leases, self.leases = self.leases, []
        for tier, keys in leases:
            _release(tier, keys)


@dataclass(frozen=True, slots=True)
class VerifiedBlock:
    """One block of `TierManager.stream`: proven to be the block `key` names."""

    key: bytes
    header: Header
    payload: bytes | memoryview
    tier: str


def _name_apart(tiers: list[Tier]) -> None:
    """Two tiers of one kind (two SSDs, two pools) become `ssd` and `ssd2`: stats, metrics and the
    per-tier hit counts are keyed by name and would otherwise merge them."""
    taken: set[str] = set()
    for tier in tiers:
        name, n = tier.name, 1
        while name in taken:
            n += 1
            name = f"{tier.name}{n}"
        taken.add(name)
        tier.name = tier.health.name = name


def _release(tier: Tier, keys: list[bytes]) -> None:
    try:
        tier.release(keys)
    except Exception:  # noqa: BLE001 - bookkeeping only; a tier bug must not fail the reader
        log.exception("%s tier: release raised", tier.name)


class TierManager:
    def __init__(self, tiers: list[Tier], *, async_writes: bool = True, max_pending_writes: int = 1024,
                 backoff: Backoff | None = None) -> None:
        if not tiers:
            raise ValueError("a TierManager needs at least one tier")
        _name_apart(tiers)
        self.tiers = tiers
        self.num_dropped_writes = 0
        if backoff is not None:
            for tier in tiers:
                tier.health.backoff = backoff
        # A tier serves one reader and one writer at a time (tiers/base.py): per tier and per side, so
        # a slow pool or SSD write on the worker thread never holds up a read on the compute path.
        self._read_locks = {id(tier): threading.Lock() for tier in tiers}
        self._write_locks = {id(tier): threading.Lock() for tier in tiers}
        self._queue: queue.Queue | None = None
        if async_writes and len(tiers) > 1:
            self._queue = queue.Queue(max_pending_writes)
            self._worker = threading.Thread(target=self._drain, name="kvtier-writes", daemon=True)
            self._worker.start()
        self._prefetcher: ThreadPoolExecutor | None = None  # stream()'s read-ahead, started on first use
        self._prefetch_lock = threading.Lock()
        self._closed = False
        self._wake = threading.Event()  # set by an outage (TierHealth.watch) and by close()
        for tier in tiers:
            tier.health.watch(self._wake)
        self._retrier = threading.Thread(target=self._retry_loop, name="kvtier-retry", daemon=True)
        self._retrier.start()

    # -- health ----------------------------------------------------------------------------------
    def _usable(self) -> list[bool]:
        """Which tiers reads may use now (the retry thread brings the others back)."""
        return [tier.health.readable for tier in self.tiers]

    def _retry_loop(self) -> None:
        """The one retry thread: probes each tier that is down once its back-off has passed, and
        sleeps while every tier is up."""
        while True:
            self._wake.wait(self._retry_wait_s())
            self._wake.clear()
            for tier in self.tiers:
                if self._closed:
                    return
                if tier.health.retry_due(time.monotonic()):
                    self._probe(tier)

    def _retry_wait_s(self) -> float | None:
        """Until the next probe is due; None (until woken) while every tier is up."""
        now = time.monotonic()
        due = [tier.health.retry_at - now for tier in self.tiers if not tier.health.healthy]
        return max(0.0, min(due)) if due else None

    def _probe(self, tier: Tier) -> None:
        health = tier.health
        with ExitStack() as held:  # the lock of each side that is down: reconnect() may rebuild it
            if not health.readable:
                held.enter_context(self._read_locks[id(tier)])
            held.enter_context(self._write_locks[id(tier)])
            try:
                tier.reconnect()  # on success the tier calls health.recover()
            except Exception:  # noqa: BLE001 - a tier's probe must not kill the retry thread
                log.exception("%s tier: reconnect raised", tier.name)
        if not health.healthy:
            health.probe_failed()

    def _guarded(self, tier: Tier, what: str, fn, fallback, *, writing: bool = False):
        """Call a tier on one side — reads under its read lock, writes under its write lock — unless
        that side is down. An exception (a tier bug, an unexpected backend error) turns the tier off
        both ways until a probe succeeds."""
        health = tier.health
        if not (health.writable if writing else health.readable):
            return fallback
        try:
            with (self._write_locks if writing else self._read_locks)[id(tier)]:
                return fn()
        except Exception as exc:  # noqa: BLE001
            tier.stats.errors += 1
            health.fail(f"{what} raised {type(exc).__name__}: {exc}")
            return fallback

    # -- reads -----------------------------------------------------------------------------------
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether some usable tier holds each key (asked top-down, each tier only for what is missing)."""
        return [holder is not None for holder in self._holder_of_each(keys)]

    def _holders(self, keys: list[bytes]) -> list[int]:
        """For the longest prefix of `keys` held anywhere: the index of the top tier holding each.

        Tiers are asked top-down, each only for the keys the tiers above do not hold, so a prefix
        that is all in DRAM never touches (or waits for) the SSD or the pool."""
        holder = self._holder_of_each(keys)
        end = holder.index(None) if None in holder else len(keys)
        return holder[:end]

    def _holder_of_each(self, keys: list[bytes]) -> list[int | None]:
        usable = self._usable()
        holder: list[int | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for idx, (tier, ok) in enumerate(zip(self.tiers, usable)):
            if not missing:
                break
            if not ok:
                continue
            ks = [keys[i] for i in missing]
            flags = self._guarded(tier, "contains", lambda t=tier: t.contains_many(ks), [False] * len(ks))
            for i, held in zip(missing, flags):
                if held:
                    holder[i] = idx
            missing = [i for i in missing if holder[i] is None]
        return holder

    def match(self, keys: list[bytes]) -> PrefixMatch:
        """Which tier holds each block of the longest prefix of `keys` held anywhere: one batched
        contains per tier, top-down. Nothing is read yet; `read(match)` fetches and verifies."""
        holders = self._holders(keys)
        return PrefixMatch(keys[:len(holders)], holders, [self.tiers[t].name for t in holders])

    def lookup(self, keys: list[bytes]) -> list[str]:
        """Tier name of each block of the longest prefix of `keys` held anywhere."""
        return self.match(keys).tiers

    def read(self, match: PrefixMatch, *, lease: bool = False) -> Prefix:
        """Fetch a match's blocks (one batched get per tier) and prove each is the block its key
        names (`codecs.header.verify(data, key)`: intact, and written for that key). The prefix ends
        at the first block that is missing after all (evicted meanwhile) or bad; every bad block of
        the run is deleted from its tier at once (not one per request) and counted as corrupt, not as
        a hit. Verified lower-tier blocks of the prefix are promoted to the top tier. `lease=True`:
        a tier that can (DRAM) hands out views of its memory instead of copies, pinned until
        `Prefix.release()` — one copy fewer on the restore path."""
        fetched, leased = self._fetch(match, lease)
        prefix = Prefix([], [], [])
        for i, hdr in self._verified_run(match, fetched):
            prefix.payloads.append(fetched[i])
            prefix.headers.append(hdr)
            prefix.tiers.append(match.tiers[i])
        prefix.leases = self._settle(match, fetched, leased, len(prefix))
        return prefix

    def stream(self, match: PrefixMatch, *, lease: bool = True) -> Iterator[VerifiedBlock]:
        """`read`, block by block, for a caller that copies each block somewhere: every block is
        verified just before it is yielded, so the copy reads it from cache, not memory (the restore
        then costs about one memcpy, not a checksum pass plus a memcpy). The blocks are fetched
        `STREAM_CHUNK_BLOCKS` at a time, the next chunk on the prefetch thread while the caller copies
        this one, so an SSD or pool read overlaps the copies. A yielded payload may view a tier's
        memory and is valid until the next block is pulled; the leases end, the promotions and the
        deletion of bad blocks (among those fetched) happen when the iteration ends or the generator is
        closed. Past the end of the prefix nothing more is fetched."""
        chunks = [list(range(start, min(start + STREAM_CHUNK_BLOCKS, len(match))))
                  for start in range(0, len(match), STREAM_CHUNK_BLOCKS)]
        fetched: dict[int, bytes | memoryview | None] = {}
        leased: dict[int, Tier] = {}
        kept, ended, ahead = 0, False, None
        try:
            for n, chunk in enumerate(chunks):
                part = ahead.result() if ahead is not None else self._fetch(match, lease, chunk)
                fetched.update(part[0])
                leased.update(part[1])
                ahead = None
                if n + 1 < len(chunks):
                    ahead = self._prefetch().submit(self._fetch, match, lease, chunks[n + 1])
                for i in chunk:
                    data = fetched.get(i)
                    hdr = self._verified(match.keys[i], data, self.tiers[match.tier_indices[i]]) \
                        if data is not None else None
                    ended = ended or hdr is None
                    if not ended:
                        kept += 1  # handed out: promoted at the end even if the caller stops pulling here
                        yield VerifiedBlock(match.keys[i], hdr, data, match.tiers[i])
                if ended:
                    break
        finally:
            if ahead is not None:  # fetched already: verified too (every bad block goes now), then let go
                part = ahead.result()
                fetched.update(part[0])
                leased.update(part[1])
                for i, data in part[0].items():
                    if data is not None:
                        self._verified(match.keys[i], data, self.tiers[match.tier_indices[i]])
            for tier, keys in self._settle(match, fetched, leased, kept):
                _release(tier, keys)

    def _prefetch(self) -> ThreadPoolExecutor:
        with self._prefetch_lock:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefetch")
            return self._prefetcher

    def _fetch(self, match: PrefixMatch, lease: bool,
               only: list[int] | None = None) -> tuple[dict[int, bytes | memoryview | None], dict[int, Tier]]:
        """One batched get (or lease) per tier of the blocks `only` (default: all): block index ->
        data (None: gone), and which were leased."""
        wanted = range(len(match)) if only is None else only
        fetched: dict[int, bytes | memoryview | None] = {}
        leased: dict[int, Tier] = {}
        for tier_idx in sorted({match.tier_indices[i] for i in wanted}):
            tier = self.tiers[tier_idx]
            idxs = [i for i in wanted if match.tier_indices[i] == tier_idx]
            keys = [match.keys[i] for i in idxs]
            leasing = lease and hasattr(tier, "lease_many")
            get = tier.lease_many if leasing else tier.get_many
            datas = self._guarded(tier, "get", lambda g=get, ks=keys: g(ks), [None] * len(idxs))
            fetched.update(zip(idxs, datas))
            if leasing:
                leased.update((i, tier) for i, data in zip(idxs, datas) if data is not None)
        return fetched, leased

    def _verified_run(self, match: PrefixMatch, fetched: dict) -> Iterator[tuple[int, Header]]:
        """(index, header) of each verified block of the prefix, in order; once the prefix has ended
        (a block gone or bad) the rest are still verified, so every bad block is dropped now."""
        ended = False
        for i, (key, tier_idx) in enumerate(zip(match.keys, match.tier_indices)):
            data = fetched.get(i)
            hdr = self._verified(key, data, self.tiers[tier_idx]) if data is not None else None
            ended = ended or hdr is None
            if not ended:
                yield i, hdr

    def _settle(self, match: PrefixMatch, fetched: dict, leased: dict[int, Tier],
                kept: int) -> list[tuple[Tier, list[bytes]]]:
        """After a read of `kept` blocks: promote its lower-tier blocks to the top tier, end the leases
        of the blocks past the prefix, and return the prefix's own leases (per tier)."""
        promote = [(match.keys[i], fetched[i]) for i in range(kept) if match.tier_indices[i] > 0]
        if promote:
            self._put_top(promote)
        ours: dict[int, tuple[Tier, list[bytes]]] = {}
        rest: dict[int, tuple[Tier, list[bytes]]] = {}
        for i, tier in leased.items():
            (ours if i < kept else rest).setdefault(id(tier), (tier, []))[1].append(match.keys[i])
        for tier, keys in rest.values():
            _release(tier, keys)
        return list(ours.values())

    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        """Verified payloads of the longest cached prefix of `keys` (`read(match(keys))`)."""
        return self.read(self.match(keys)).payloads

    def _verified(self, key: bytes, data: bytes, tier: Tier) -> Header | None:
        try:
            return verify(data, key)
        except CorruptBlockError as exc:
            log.warning("bad block %s in %s: %s (deleted; recomputing)", key.hex()[:12], tier.name, exc)
            with self._read_locks[id(tier)]:  # the prefetch thread may be counting this tier's reads
                tier.stats.hits -= 1  # the tier counted a hit for bytes that are not this block
                tier.stats.misses += 1
                tier.stats.corrupt += 1
            self._guarded(tier, "delete", lambda: tier.delete(key), False)
            return None

    # -- writes ----------------------------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        self._put_top(items)
        if len(self.tiers) > 1:
            self._enqueue(items)

    def _put_top(self, items: list[tuple[bytes, bytes]]) -> None:
        top = self.tiers[0]
        evicted = self._guarded(top, "put", lambda: top.put_many(items), [], writing=True)
        if evicted and len(self.tiers) > 1:
            self._enqueue(evicted)  # demotion (a no-op below if write-through already put it there)

    def _enqueue(self, items: list[tuple[bytes, bytes]]) -> None:
        if self._queue is None:
            self._write_lower(items)
            return
        try:
            self._queue.put_nowait(items)
        except queue.Full:  # never block the compute path on a slow tier
            self.num_dropped_writes += len(items)

    def _drain(self) -> None:
        while True:
            items = self._queue.get()
            try:
                if items is None:
                    return
                self._write_lower(items)
            except Exception:  # a failing tier must not kill the writer
                log.exception("write to a lower tier failed")
            finally:
                self._queue.task_done()

    def _write_lower(self, items: list[tuple[bytes, bytes]]) -> None:
        keys = [k for k, _ in items]
        for tier in self.tiers[1:]:
            held = self._guarded(tier, "contains", lambda t=tier: t.contains_many(keys), [True] * len(items),
                                 writing=True)
            new = [(k, d) for (k, d), h in zip(items, held) if not h]
            if new:
                self._guarded(tier, "put", lambda t=tier, n=new: t.put_many(n), [], writing=True)

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.join()

    # -- resident host memory: the live KV of sequences longer than the device (engine/offload.py) --
    def host_tier(self) -> HostTier | None:
        """This process's DRAM tier (the top one), if there is one: the host memory offload uses."""
        top = self.tiers[0]
        return top if isinstance(top, HostTier) else None

    def pin_host(self, key: bytes, data: bytes | None) -> int | None:
        """Hold `key`'s block in a DRAM slot until `unpin_host([key])`: its slot, or None when it cannot
        be held (no DRAM tier, every slot pinned). A block DRAM already holds (written through when it
        was computed) is pinned where it is, checked by its key-bound header; else `data` is stored.
        Blocks evicted to make room are demoted like any eviction."""
        host = self.host_tier()
        if host is None:
            return None
        with self._write_locks[id(host)], self._read_locks[id(host)]:
            slot, evicted = host.pin(key, data)
        if evicted and len(self.tiers) > 1:
            self._enqueue(evicted)
        if slot is not None and data is not None and len(self.tiers) > 1:
            self._enqueue([(key, data)])  # write-through, as put_many (a no-op below where it is held)
        return slot

    def host_payloads(self, dtype, shape: tuple[int, ...]):
        """`[num_slots, *shape]` typed view of the DRAM slots' payloads: a pinned block is row `slot`."""
        return self.host_tier().slot_payloads(dtype, shape)

    def unpin_host(self, keys: list[bytes]) -> None:
        host = self.host_tier()
        if host is not None and keys:
            host.release(keys)

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats for tier in self.tiers}

    def health(self) -> dict[str, TierHealth]:
        return {tier.name: tier.health for tier in self.tiers}

    def occupancy(self) -> dict[str, tuple[int, int | None]]:
        return {tier.name: (tier.used_bytes(), tier.capacity_bytes) for tier in self.tiers}

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._retrier.join(timeout=30)  # a probe in flight ends within the backend's timeouts
        for tier in self.tiers:
            tier.health.unwatch(self._wake)
        self.flush()
        if self._queue is not None:
            self._queue.put(None)
            self._worker.join(timeout=10)
            self._queue = None
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()


def build_manager(specs: list[str], *, slot_bytes: int, async_writes: bool = True,
                  backoff: Backoff | None = None) -> TierManager:
    """Tiers from spec strings, top first: `dram:1GiB`, `mooncake://HOST:PORT`, `redis://HOST:PORT/0`,
    `ssd:/path:10GiB`. A pool that is down at start is just a tier that is down: it is retried."""
    return TierManager([make_tier(spec, slot_bytes=slot_bytes) for spec in specs], async_writes=async_writes,
                       backoff=backoff)
