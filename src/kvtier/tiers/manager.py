"""The tier stack: lookup, verified reads, write-back, health — in three parts.

- Lookup and read (this module): `match` asks the tiers top-down, each only for the keys the tiers
  above lack, and may pin what it found (kept from eviction until the load completes: vLLM's
  `prepare_load` contract); `locate` takes the record of a lookup made elsewhere (another process).
  A match records where each block is; the read goes there — one batched get per tier, falling
  through to the next tier on a miss — and nothing looks the blocks up again. Every block read is
  proven to be the block its key names (`codecs.header.verify(data, key)`) in one verify loop that
  `read` (a whole run) and `stream` (block by block) share: a corrupt or substituted block is deleted,
  counted, and ends the prefix there — the caller recomputes from that point. A block of this
  process's own DRAM never left the process: its key-bound header is checked, not its payload hash;
  every block that crossed a process or a medium (`shm:`, SSD, pools) gets the full proof.
  `stream_layers` (a layerwise load) proves and hands out layer l of every block before the last
  layer of any is read: a layered block's header and layer table first, then each slice on its own.
- Write-back (`tiers/writeback.py`): the top tier is written synchronously, the lower tiers on the
  process's writes lane (`transfer/executor.py`): write-through, so a second process on the same SSD or pool
  sees the blocks, and demotion of evicted blocks no lower tier holds yet (an eviction that write-through
  already placed below hands back its key, not its bytes).
- Health (`tiers/health.py`): each tier is readable and writable, or not. Reads skip a tier that is
  not readable, writes one that is not writable (a full disk still serves reads); a tier that raises
  is turned off both ways. One `HealthProber` thread probes each tier that is down.

Each tier has a read lock and a write lock: a slow pool put on the writer thread never holds up a
lookup on the compute path. The manager never calls up into its callers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.codecs.header import CorruptBlockError, Header, check_layer, verify
from kvtier.tiers import Backoff, Tier, TierHealth, TierStats, make_tier
from kvtier.tiers.base import STREAM_CHUNK_BLOCKS
from kvtier.tiers.events import TierEvents
from kvtier.tiers.health import HealthProber
from kvtier.tiers.writeback import WriteBack, put_chained
from kvtier.transfer.executor import Tasks

log = logging.getLogger(__name__)

Leases = list[tuple[Tier, list[bytes]]]  # (tier, keys) leased out: views valid until released


@dataclass(slots=True)
class PrefixMatch:
    """The longest cached prefix of some keys and where each of its blocks is (ids, no data).
    `pinned[i]`: block i is kept from eviction in its tier until the read ends (or `unpin`)."""

    keys: list[bytes]
    tier_indices: list[int]   # into TierManager.tiers
    tiers: list[str]          # the same, by name
    pinned: list[bool] = field(default_factory=list)  # empty: nothing pinned

    def __len__(self) -> int:
        return len(self.keys)

    def part(self, start: int, stop: int | None = None) -> "PrefixMatch":
        """Blocks [start, stop) of the match, their pins with them: one lookup split between two loads
        (an offloaded sequence's sink blocks for the device, the rest for host memory)."""
        return PrefixMatch(self.keys[start:stop], self.tier_indices[start:stop], self.tiers[start:stop],
                           self.pinned[start:stop])


@dataclass(slots=True)
class Prefix:
    """Blocks read for a match, each verified to be the block its key names; possibly shorter than
    the match (a block evicted meanwhile, or bad). `headers` let callers decode without a second check.
    Read with `lease=True`, payloads may be views of a tier's own memory (DRAM slots, pinned): the
    caller copies what it needs, then calls `release()` (idempotent; a no-op otherwise)."""

    payloads: list[bytes | memoryview]
    headers: list[Header]
    tiers: list[str]          # the tier each block came from
    leases: Leases = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.payloads)

    def release(self) -> None:
        leases, self.leases = self.leases, []
        release(leases)


@dataclass(frozen=True, slots=True)
class VerifiedBlock:
    """One block of `TierManager.stream`: proven to be the block `key` names."""

    key: bytes
    header: Header
    payload: bytes | memoryview
    tier: str                 # where it was read (below the match's tier if it fell through)


@dataclass(slots=True)
class _Fetched:
    """What a batched read got: block index -> data (None: gone everywhere it was looked for), the
    tier that served it, and which tier leased it."""

    data: dict[int, bytes | memoryview | None] = field(default_factory=dict)
    source: dict[int, int] = field(default_factory=dict)
    leased: dict[int, Tier] = field(default_factory=dict)

    def update(self, other: "_Fetched") -> None:
        self.data.update(other.data)
        self.source.update(other.source)
        self.leased.update(other.leased)


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


def _quietly(tier: Tier, what: str, fn, keys: list[bytes]) -> None:
    """Bookkeeping (release, unpin): a tier bug must not fail the reader."""
    try:
        fn(keys)
    except Exception:  # noqa: BLE001
        log.exception("%s tier: %s raised", tier.name, what)


def release(leases: Leases) -> None:
    """End leases handed over by `read(lease=True)` or `stream(hold=...)`."""
    for tier, keys in leases:
        _quietly(tier, "release", tier.release, keys)


class _SharedLeases:
    """Leases two parties read: the reader (through `hold` or at once) and the promotion of the same
    blocks into the top tier. Stands in a `Leases` list as a tier whose `release` ends them once
    every party has let go."""

    name = "shared-leases"

    def __init__(self, leases: Leases, parties: int) -> None:
        self._leases = leases
        self._parties = parties
        self._lock = threading.Lock()

    def release(self, keys: list[bytes]) -> None:
        with self._lock:
            self._parties -= 1
            last = self._parties == 0
        if last:
            release(self._leases)


def _by_tier(pairs) -> dict[int, tuple[Tier, list[bytes]]]:
    grouped: dict[int, tuple[Tier, list[bytes]]] = {}
    for tier, key in pairs:
        grouped.setdefault(id(tier), (tier, []))[1].append(key)
    return grouped


class TierManager:
    def __init__(self, tiers: list[Tier], *, async_writes: bool = True, max_pending_writes: int = 1024,
                 backoff: Backoff | None = None) -> None:
        if not tiers:
            raise ValueError("a TierManager needs at least one tier")
        _name_apart(tiers)
        self.tiers = tiers
        if backoff is not None:
            for tier in tiers:
                tier.health.backoff = backoff
        # A tier serves one reader and one writer at a time (tiers/base.py): per tier and per side, so
        # a slow pool or SSD write on the worker thread never holds up a read on the compute path.
        self._read_locks = {id(tier): threading.Lock() for tier in tiers}
        self._write_locks = {id(tier): threading.Lock() for tier in tiers}
        self._writeback = WriteBack(tiers, self._guarded, threaded=async_writes, max_pending=max_pending_writes)
        self._aheads = Tasks()  # read-aheads on the process's read-ahead thread (`kvtier.transfer.executor`)
        self._prober = HealthProber(tiers, lambda t: (self._read_locks[id(t)], self._write_locks[id(t)]))

    @property
    def num_dropped_writes(self) -> int:
        return self._writeback.num_dropped

    @property
    def num_pending_writes(self) -> int:
        """Lower-tier write batches not landed yet (their stored events still to come)."""
        return self._writeback.num_pending

    def watch(self) -> TierEvents:
        """From now on every tier announces what lands in it and what leaves it (`tiers/events.py`):
        drain the returned log with `take()`. Watching again returns the same log."""
        if self.tiers[0].events is None:
            log = TierEvents()
            for tier in self.tiers:
                tier.events = log
        return self.tiers[0].events

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

    # -- lookup ------------------------------------------------------------------------------------
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether some usable tier holds each key (asked top-down, each tier only for what is missing)."""
        return [holder is not None for holder in self._holder_of_each(keys, pin=False)]

    def _holder_of_each(self, keys: list[bytes], *, pin: bool) -> list[int | None]:
        """The top tier holding each key: tiers are asked top-down, each only for the keys the tiers
        above do not hold, so a prefix that is all in DRAM never touches (or waits for) the SSD or the
        pool. `pin`: each found block is pinned in the tier that holds it."""
        holder: list[int | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for idx, tier in enumerate(self.tiers):
            if not missing:
                break
            if not tier.health.readable:
                continue
            ks = [keys[i] for i in missing]
            ask = (lambda t=tier: t.pin_many(ks)) if pin else (lambda t=tier: t.contains_many(ks))
            flags = self._guarded(tier, "pin" if pin else "contains", ask, [False] * len(ks))
            for i, held in zip(missing, flags):
                if held:
                    holder[i] = idx
            missing = [i for i in missing if holder[i] is None]
        return holder

    def match(self, keys: list[bytes], *, pin: bool = False) -> PrefixMatch:
        """Where each block of the longest prefix of `keys` held anywhere is: one batched contains
        per tier, top-down. Nothing is read yet; `read` / `stream` fetch there and verify. `pin=True`
        (a load will follow): each block is kept from eviction in its tier until that read ends —
        or `unpin(match)` for a load that does not happen."""
        holder = self._holder_of_each(keys, pin=pin)
        end = holder.index(None) if None in holder else len(keys)
        if pin:  # found past the prefix: no load reads them
            for _, (tier, ks) in _by_tier((self.tiers[t], keys[i]) for i, t in enumerate(holder)
                                          if i >= end and t is not None).items():
                _quietly(tier, "unpin", tier.unpin, ks)
        indices = holder[:end]
        return PrefixMatch(keys[:end], indices, [self.tiers[t].name for t in indices], [pin] * end if pin else [])

    def locate(self, keys: list[bytes], tiers: list[str]) -> PrefixMatch:
        """A match from another process's lookup (`tiers`: where it found each block, by name): the
        read goes there without looking anything up again, falling through on a miss. This process's
        own memory tiers (DRAM), which that lookup could not see, are asked first — in memory — and
        pin what they hold. A name this stack lacks ends the prefix."""
        index_of = {tier.name: i for i, tier in enumerate(self.tiers)}
        indices: list[int] = []
        for name in tiers[:len(keys)]:
            if name not in index_of:
                break
            indices.append(index_of[name])
        keys = keys[:len(indices)]
        pinned = [False] * len(keys)
        for idx, tier in enumerate(self.tiers):
            ask = [i for i in range(len(keys)) if indices[i] > idx]
            if not tier.in_process or not ask or not tier.health.readable:
                continue
            ks = [keys[i] for i in ask]
            held = self._guarded(tier, "pin", lambda t=tier: t.pin_many(ks), [False] * len(ks))
            for i, h in zip(ask, held):
                if h:
                    indices[i], pinned[i] = idx, True
        return PrefixMatch(keys, indices, [self.tiers[t].name for t in indices], pinned)

    def unpin(self, match: PrefixMatch) -> None:
        """End the pins of a match (idempotent): `read` and `stream` do it when they end."""
        pinned, match.pinned = match.pinned, []
        groups = _by_tier((self.tiers[t], k) for k, t, p in zip(match.keys, match.tier_indices, pinned) if p)
        for tier, ks in groups.values():
            _quietly(tier, "unpin", tier.unpin, ks)

    def lookup(self, keys: list[bytes]) -> list[str]:
        """Tier name of each block of the longest prefix of `keys` held anywhere."""
        return self.match(keys).tiers

    # -- reads: one verify loop ----------------------------------------------------------------------
    def read(self, match: PrefixMatch, *, lease: bool = False) -> Prefix:
        """Fetch a match's blocks (one batched get per tier) and prove each is the block its key
        names. The prefix ends at the first block that is missing after all (evicted meanwhile) or
        bad; every bad block of the run is deleted from its tier at once (not one per request) and
        counted as corrupt, not as a hit. Verified lower-tier blocks of the prefix are promoted to the
        top tier. `lease=True`: tiers hand out views of their memory instead of copies where they can,
        valid until `Prefix.release()` — one copy fewer on the restore path."""
        prefix = Prefix([], [], [])
        for block in self._blocks(match, lease, max(len(match), 1), prefix.leases):
            prefix.payloads.append(block.payload)
            prefix.headers.append(block.header)
            prefix.tiers.append(block.tier)
        return prefix

    def stream(self, match: PrefixMatch, *, lease: bool = True, hold: Leases | None = None) -> Iterator[VerifiedBlock]:
        """`read`, block by block, for a caller that copies each block somewhere: every block is
        verified just before it is yielded, so the copy reads it from cache, not memory (the restore
        then costs about one memcpy, not a checksum pass plus a memcpy). The blocks are fetched
        `stream_chunk_blocks` at a time (the largest among the tiers the match found them in), the next
        chunk on the process's read-ahead thread (`kvtier.transfer.executor`) while the caller copies this one, so
        an SSD or pool read overlaps the copies. The promotions, the deletion of bad blocks (among those
        fetched) and the end of the pins happen when the iteration ends or the generator is closed; so does
        the end of every lease — unless `hold` is given: the yielded blocks' leases are then appended to it
        (end them with `release(hold)`), so every block handed out stays valid until then. Past the end of
        the prefix nothing more is fetched."""
        chunk = max((self.tiers[t].stream_chunk_blocks for t in set(match.tier_indices)),
                    default=STREAM_CHUNK_BLOCKS)
        return self._blocks(match, lease, chunk, hold)

    def _blocks(self, match: PrefixMatch, lease: bool, chunk_blocks: int,
                hold: Leases | None) -> Iterator[VerifiedBlock]:
        """The one verify loop: fetch chunk by chunk (the next one ahead), verify each block just
        before it is handed out; once the prefix has ended the rest of what was fetched is still
        verified, so every bad block among it is dropped now."""
        chunks = [list(range(start, min(start + chunk_blocks, len(match))))
                  for start in range(0, len(match), chunk_blocks)]
        got = _Fetched()
        kept, ended, ahead = 0, False, None
        try:
            for n, chunk in enumerate(chunks):
                got.update(ahead.result() if ahead is not None else self._fetch(match, lease, chunk))
                ahead = None
                if n + 1 < len(chunks):
                    ahead = self._aheads.ahead(self._fetch, match, lease, chunks[n + 1])
                for i in chunk:
                    hdr = self._verified_at(match, got, i)
                    ended = ended or hdr is None
                    if not ended:
                        kept += 1  # handed out: promoted at the end even if the caller stops pulling here
                        yield VerifiedBlock(match.keys[i], hdr, got.data[i], self.tiers[got.source[i]].name)
                if ended:
                    break
        finally:
            if ahead is not None:  # fetched already: verified too (every bad block goes now), then let go
                part = ahead.result()
                got.update(part)
                for i in part.data:
                    self._verified_at(match, got, i)
            self._settle(match, got, kept, hold)

    def _fetch(self, match: PrefixMatch, lease: bool, only: list[int]) -> _Fetched:
        """One batched get (or lease) per tier of the blocks `only`, each where the match found it;
        a block gone from there is asked of the next tier down (no lookup: a get that misses)."""
        got = _Fetched()
        pending = {i: match.tier_indices[i] for i in only}
        while pending:
            below: dict[int, int] = {}
            for tier_idx in sorted(set(pending.values())):
                tier = self.tiers[tier_idx]
                idxs = [i for i, t in pending.items() if t == tier_idx]
                keys = [match.keys[i] for i in idxs]
                get = tier.lease_many if lease else tier.get_many
                datas = self._guarded(tier, "get", lambda g=get: g(keys), [None] * len(idxs))
                for i, data in zip(idxs, datas):
                    if data is None and tier_idx + 1 < len(self.tiers):
                        below[i] = tier_idx + 1
                        continue
                    got.data[i], got.source[i] = data, tier_idx
                    if lease and data is not None:
                        got.leased[i] = tier
            pending = below
        return got

    def _verified_at(self, match: PrefixMatch, got: _Fetched, i: int) -> Header | None:
        data = got.data.get(i)
        return None if data is None else self._verified(match.keys[i], data, self.tiers[got.source[i]])

    def _verified(self, key: bytes, data: bytes | memoryview, tier: Tier) -> Header | None:
        try:
            # DRAM slots of this process: the key-bound header; anything that crossed a medium: all of it
            return verify(data, key, payload=not tier.in_process)
        except CorruptBlockError as exc:
            self._reject(key, tier, exc)
            return None

    def _reject(self, key: bytes, tier: Tier, exc: CorruptBlockError) -> None:
        log.warning("bad block %s in %s: %s (deleted; recomputing)", key.hex()[:12], tier.name, exc)
        with self._read_locks[id(tier)]:  # the read-ahead thread may be counting this tier's reads
            tier.stats.hits -= 1  # the tier counted a hit for bytes that are not this block
            tier.stats.misses += 1
            tier.stats.corrupt += 1
        self._guarded(tier, "delete", lambda: tier.delete(key), False)

    # -- reads layer by layer (a layerwise load) -------------------------------------------------------
    def stream_layers(self, match: PrefixMatch, num_layers: int, *,
                      hold: Leases) -> Iterator[list[VerifiedBlock | None]]:
        """For l in 0..num_layers-1: every block of `match`, its layer l proven (None: the block is missing
        or bad at this layer or before, and stays None). Blocks in a file tier (SSD, `shm:`) are read in
        pieces (`lease_layers`): a layered block's header and layer table are proven before its layer 0
        is handed out, each later slice just before its own layer, so layer 0 of every block comes before
        the last layer of any is read. Other blocks (DRAM, pools, a file of an older format or a codec
        without layers) are read whole, as `stream` does, and proven whole before their layer 0. Not a
        prefix: the caller ends each request's prefix at its first None. A bad block is deleted and
        counted, as in `stream`. When the iteration ends (or the generator is closed) the pins end, the
        fully proven lower-tier blocks are promoted to the top tier on the writer thread, and every lease
        goes to `hold` (those of blocks not fully proven end now)."""
        n = len(match)
        ranged = [i for i in range(n) if hasattr(self.tiers[match.tier_indices[i]], "lease_layers")]
        whole = [i for i in range(n) if i not in set(ranged)]
        ahead = self._aheads.ahead(self._fetch, match, True, whole) if whole else None
        got, reads = _Fetched(), self._lease_layers(match, ranged)
        headers: list[Header | None] = [None] * n
        alive, complete = [True] * n, False
        try:
            fallen = [i for i in ranged if reads.get(i) is None]
            if ahead is not None:
                got.update(ahead.result())
                ahead = None
            got.update(self._fetch_below(match, fallen))
            for i, read in reads.items():
                if read is not None:
                    tier_idx = match.tier_indices[i]
                    got.data[i], got.source[i], got.leased[i] = read.view(), tier_idx, self.tiers[tier_idx]
            for layer in range(num_layers):
                yield [self._layer_at(match, got, reads, headers, alive, i, layer, num_layers) for i in range(n)]
            complete = True
        finally:
            if ahead is not None:
                got.update(ahead.result())
            self._settle(match, got, [i for i in range(n) if complete and alive[i]], hold)

    def _lease_layers(self, match: PrefixMatch, ranged: list[int]) -> dict[int, object]:
        """Block index -> the file tier's ranged read (None: not there)."""
        reads: dict[int, object] = {}
        for _, (tier, idxs) in _by_tier((self.tiers[match.tier_indices[i]], i) for i in ranged).items():
            keys = [match.keys[i] for i in idxs]
            got = self._guarded(tier, "get", lambda t=tier: t.lease_layers(keys), [None] * len(idxs))
            reads.update(zip(idxs, got))
        return reads

    def _fetch_below(self, match: PrefixMatch, idxs: list[int]) -> _Fetched:
        """Whole reads from the tiers below where the match found `idxs` (missing there: fall through)."""
        idxs = [i for i in idxs if match.tier_indices[i] + 1 < len(self.tiers)]
        if not idxs:
            return _Fetched()
        below = PrefixMatch(match.keys, [t + 1 for t in match.tier_indices], match.tiers)
        return self._fetch(below, True, idxs)

    def _layer_at(self, match: PrefixMatch, got: _Fetched, reads: dict, headers: list, alive: list[bool],
                  i: int, layer: int, num_layers: int) -> VerifiedBlock | None:
        """Block i with its layer `layer` proven, or None (and from now on) if it is missing or bad."""
        if not alive[i]:
            return None
        data, key = got.data.get(i), match.keys[i]
        read = reads.get(i) if got.source.get(i) == match.tier_indices[i] else None
        if data is None:
            alive[i] = False
            return None
        tier = self.tiers[got.source[i]]
        try:
            if headers[i] is None:
                if read is not None and not read.wait(0):  # the head and the layer table (or all of it)
                    raise OSError("read failed")
                hdr = verify(data, key, payload=False)
                if not hdr.layered and not tier.in_process:
                    verify(data, key)  # read whole: proven whole
                if hdr.shape[0] != num_layers:
                    raise OSError(f"{hdr.shape[0]} layers, the reader has {num_layers}")  # not this model's
                headers[i] = hdr
            hdr = headers[i]
            if hdr.layered and not tier.in_process:
                if read is not None and not read.wait(hdr.layer_range(layer)[1]):
                    raise OSError("read failed")
                check_layer(hdr, key, data, layer)
        except CorruptBlockError as exc:
            alive[i] = False
            self._reject(key, tier, exc)
            return None
        except OSError:
            alive[i] = False  # a read error, or a block of another shape: a miss
            return None
        return VerifiedBlock(key, hdr, data, tier.name)

    def _settle(self, match: PrefixMatch, got: _Fetched, kept: int | list[int], hold: Leases | None) -> None:
        """After a read of `kept` blocks (a prefix; `stream_layers`: those fully proven): end the leases of
        the other blocks and the pins;
        promote the prefix's lower-tier blocks to the top tier on the writer thread (`flush()` waits for
        it), off the reader's path — a layerwise load writes its first layer without waiting for DRAM;
        end the prefix's own leases (or hand them to `hold`), those the promotion reads once it has too."""
        kept = set(range(kept)) if isinstance(kept, int) else set(kept)  # a prefix, or any blocks (stream_layers)
        self._refresh(match, got, sorted(kept))
        promoted = [i for i in sorted(kept) if got.source[i] > 0]
        ours = _by_tier((tier, match.keys[i]) for i, tier in got.leased.items() if i in kept and got.source[i] == 0)
        read_by_promotion = _by_tier((got.leased[i], match.keys[i]) for i in promoted if i in got.leased)
        rest = _by_tier((tier, match.keys[i]) for i, tier in got.leased.items() if i not in kept)
        release(list(rest.values()))
        self.unpin(match)
        shared = _SharedLeases(list(read_by_promotion.values()), parties=2 if promoted else 1)
        if promoted:
            items = [(match.keys[i], got.data[i]) for i in promoted]
            if not self._writeback.run_later(lambda: self._promote(items, shared)):
                self._promote(items, shared)
        if hold is not None:
            hold.extend(ours.values())
            hold.append((shared, []))
        else:
            release(list(ours.values()))
            shared.release([])

    def _refresh(self, match: PrefixMatch, got: _Fetched, kept: list[int]) -> None:
        """A read in chunks refreshed each chunk after the one before: refresh the blocks read (root first) in
        the tiers that served them, tail first, so the root ends most recent (`kvtier.lru`)."""
        for tier, keys in _by_tier((self.tiers[got.source[i]], match.keys[i]) for i in kept).values():
            if hasattr(tier, "touch_many"):  # the tiers with an LRU of their own (pools evict by themselves)
                self._guarded(tier, "touch", lambda t=tier, ks=keys: t.touch_many(ks), None)

    def _promote(self, items: list[tuple[bytes, bytes | memoryview]], shared: "_SharedLeases") -> None:
        try:
            self._put_top(items)
            top = self.tiers[0]  # they came from below: an eviction needs no demotion
            self._guarded(top, "placed_below", lambda: top.placed_below([k for k, _ in items]), None, writing=True)
        finally:
            shared.release([])

    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        """Verified payloads of the longest cached prefix of `keys` (`read(match(keys))`)."""
        return self.read(self.match(keys)).payloads

    # -- writes ----------------------------------------------------------------------------------
    def put_many(self, items: list[tuple[bytes, bytes]], *, chains: Sequence[list[bytes]] = ()) -> None:
        """Into the top tier now; write-through to the lower tiers on the write-back queue. `chains`: the
        requests' chains the blocks extend (root first, the new keys included; a save carries only a turn's
        new blocks): every tier that holds some of them refreshes them with the put, tail first, without
        rewriting them (`writeback.put_chained`), so the new blocks never outrank their root."""
        self._put_top(items, chains)
        self._writeback.submit(items, through=True, chains=chains)

    def _put_top(self, items: list[tuple[bytes, bytes]], chains: Sequence[list[bytes]] = ()) -> None:
        top = self.tiers[0]
        evicted = self._guarded(top, "put", lambda: put_chained(top, items, chains), [], writing=True)
        # a block write-through placed below comes back as its key alone: nothing to demote
        self._writeback.submit([(key, data) for key, data in evicted if data is not None], through=False)

    def write_later(self, job, *, blocks: int) -> bool:
        """Run `job()` on the process's writes lane (`transfer/executor.py`), after what is queued: a save
        of `blocks` blocks (`BlockMover.save`), whose put then writes through on that thread. False: no
        writes lane (`async_writes=False`: the caller runs it) or it is full (dropped, counted in
        `num_dropped_writes`)."""
        return self._writeback.run_later(job, blocks=blocks)

    @property
    def has_writer_thread(self) -> bool:
        return self._writeback.threaded

    def flush(self) -> None:
        """Until the pending writes have landed: saves handed to `write_later`, write-through, demotions,
        promotions."""
        self._writeback.flush()

    # -- the top tier's memory, read in place -------------------------------------------------------
    @property
    def num_in_place_slots(self) -> int:
        """Slots of the top tier when it is this process's memory (`in_process`: a reader may read its
        arena in place, `lease_in_place`), else 0."""
        top = self.tiers[0]
        return top.num_slots if top.in_process else 0

    def in_place_view(self, dtype, shape: tuple[int, ...]):
        """`[num_slots, *shape]` typed view of the top tier's slot payloads: a block leased in place at
        slot s is row s."""
        assert self.num_in_place_slots, "the top tier is not this process's memory"
        return self.tiers[0].payload_view(dtype, shape)

    def lease_in_place(self, items: list[tuple[bytes, bytes | memoryview | None]], *,
                       from_below: bool = False) -> list[int | None]:
        """Lease blocks in the top tier's memory for a reader in place, each until `release_in_place([key])`:
        its slot, or None (data None and not held, every slot leased, the tier down or not in this
        process). A block the top tier holds is leased where it is; one it lacks is stored from its data and
        written through below, as `put_many` does — unless it was read from a lower tier (`from_below`):
        that tier holds it already, and its eviction will copy nothing out. Blocks evicted to make room are
        demoted like any eviction."""
        top = self.tiers[0]
        if not top.in_process:
            return [None] * len(items)
        slots, evicted = self._guarded(top, "lease", lambda: top.lease_slots(items, placed_below=from_below),
                                       ([None] * len(items), []), writing=True)
        # demotion of what made room (a block placed below already comes back as its key alone)
        self._writeback.submit([(k, d) for k, d in evicted if d is not None], through=False)
        if not from_below:
            self._writeback.submit([(k, d) for (k, d), slot in zip(items, slots) if slot is not None and d is not None],
                                   through=True)
        return slots

    def release_in_place(self, keys: list[bytes]) -> None:
        """End leases `lease_in_place` handed out (one each)."""
        if keys:
            release([(self.tiers[0], keys)])

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, TierStats]:
        return {tier.name: tier.stats for tier in self.tiers}

    def health(self) -> dict[str, TierHealth]:
        return {tier.name: tier.health for tier in self.tiers}

    def occupancy(self) -> dict[str, tuple[int, int | None]]:
        return {tier.name: (tier.used_bytes(), tier.capacity_bytes) for tier in self.tiers}

    def close(self) -> None:
        self._prober.close()
        self._aheads.join()  # a read-ahead still reading (a stream left unfinished): before its tiers close
        self._writeback.close()
        for tier in self.tiers:
            tier.close()


def build_manager(specs: list[str], *, slot_bytes: int, async_writes: bool = True,
                  backoff: Backoff | None = None) -> TierManager:
    """Tiers from spec strings, top first: `dram:1GiB`, `mooncake://HOST:PORT`, `redis://HOST:PORT/0`,
    `ssd:/path:10GiB`. A pool that is down at start is just a tier that is down: it is retried."""
    return TierManager([make_tier(spec, slot_bytes=slot_bytes) for spec in specs], async_writes=async_writes,
                       backoff=backoff)
