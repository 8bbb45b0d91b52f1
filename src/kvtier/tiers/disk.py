"""Local SSD tier: one file per block under a directory, an index that survives restarts.

A block is written to a temporary file, fsynced and linked into place (atomic, and only where the
name is free: a block in place is never overwritten), so a crash never leaves a half-written block
under a real name; the header checksum catches anything else. On open the directory is scanned:
yesterday's blocks are found again, in mtime order (a write or read stamps its blocks, a request's tail
first as the index refreshes them, `kvtier.lru`: that order is use order), and a crash's leftover
temporary files are removed; files that are not ours are left alone. A block another live process wrote into the same directory after
our scan is adopted on first lookup.

A full (ENOSPC) or read-only disk turns the tier's writes off (`health.writable`), not its reads:
what is there keeps being served. `reconnect()` (the manager's background probe) turns writes back
on only when the file system is writable, has room for a few of the largest block this tier has
seen (`os.statvfs`), and a tiny write goes through — a 2-byte write succeeds on a disk that cannot
take one more block.

Restores (`lease_many`) read each file straight into a page-aligned buffer of a reused pool —
with O_DIRECT where the file system allows it, so the bytes move once, disk to buffer, with no page
cache copy and no fresh allocation — several files in flight; the buffers go back at `release`.
A layerwise load reads layer by layer (`lease_layers`, `tiers/ranged.py`): every file's head (header,
layer 0) and layer table first, then the other layers in page-aligned pieces. Every file read is a leaf
task on the process's transfer executor (`kvtier.transfer.executor`): no thread of this tier's own.

Threads: one reader and one writer at a time (the manager's two sides). The index is shared under
a short mutex; file I/O runs outside it. A key whose file we are writing or removing (`_in_flux`)
is neither held nor adoptable meanwhile, so a lookup never takes in a file that is about to go.

Several processes on one directory (two servers, a second `kvtier generate`, vLLM's scheduler and
workers) each keep their own index; the files are the truth, and no process deletes what another
is writing or has pinned for a load:
- a write goes to a temporary name of its own (`<key>.kvb.<pid>-<random>.tmp`), linked into place
  (never over a block already there); start-up removes only temporary files older than
  `TMP_GRACE_SECONDS` (a crash's, not a live write);
- a pin (`pin_many`, the lookup a load follows) is a shared byte-range lock on the block's byte of a lock
  file (`.kvtier-locks/`, Linux open file description locks: `_BlockLocks`; a platform without them pins in
  this process only), held until `unpin`: no
  descriptor per pin, so any number of pins hold in every process; every eviction takes the exclusive lock
  first (non-blocking), holds it across the unlink, and leaves a locked file where it is;
- no file stays on disk that no index counts: a file an eviction left (pinned) is a leftover of the
  evicting index (`leftover_bytes`), tried again at later eviction passes (`LEFTOVERS_PER_PASS` a pass, the
  oldest first) and at `close`, until it goes or an index takes it in again (a lookup's adoption, a write
  of the same key); an owner that hands its deletes off (`hand_deletes_off`) looks again at what it handed
  off, and hands off again a file still there a while later (a delete refused for another process's pin:
  `take_deletes`) — one retry list for both, least recently tried first, bounded (`RECHECK_LIMIT`); the
  process that deletes runs the deletes on its writes lane (`DiskStore.delete_behind_writes`), behind every
  write it queued before them and ahead of those after, so a write that lands after its key's eviction,
  however late, leaves nothing and one of the key admitted again stays (an index's own writes cannot strand
  a file: the key is indexed, in flux, before its file is written, and never a victim meanwhile);
- a lookup (`contains_many`) checks that an indexed file is still there: another process's eviction
  or a write still to land is a miss, not a stale hit; a reader that loses a race anyway gets a
  missing file (a miss) or fails the header checksum (`codecs.header.verify`): recomputed, never wrong.
`DiskStore` is the same directory without an index (a vLLM worker: `SchedulerSide` owns index and
eviction and ships its deletes in the step's metadata).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from kvtier.errors import UserError
from kvtier.transfer.executor import Tasks
from kvtier.lru import LRUIndex, tail_first
from kvtier.tiers.base import STREAM_CHUNK_BLOCKS, TierStats
from kvtier.tiers.buffers import Leases, ReadBuffers
from kvtier.tiers.events import TierEvents, announce_removed, announce_stored
from kvtier.tiers.health import TierHealth
from kvtier.tiers.ranged import HEAD_BYTES, RangedRead, plan_pieces
from kvtier.units import fmt_bytes

try:
    import fcntl
except ImportError:  # Windows: no byte-range locks here, pins hold in this process (`_BlockLocks`)
    fcntl = None

log = logging.getLogger(__name__)
_TMP_SUFFIX = ".tmp"
_BLOCK_SUFFIX = ".kvb"
_PROBE_NAME = ".kvtier-probe"
_LOCKS_NAME = ".kvtier-locks"  # every process's pins and evictions of the directory's blocks (`_BlockLocks`)
LOCK_FILES = 16  # ... in this many files (an index opens each once): a lock call walks its file's locks
_FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0: an OFD lock)
TMP_GRACE_SECONDS = 600.0  # a temporary file this old is a crashed write's, not another process's live one
SHIPPED_RECHECK_SECONDS = 1.0  # `take_deletes`: how late a handed-off key's file is looked for again
SHIPPED_CHECKS_PER_CALL = 64  # ... and how many at most per call (one step's bounded cost), or twice the call's
# new deletes where more (the list never outgrows what it looks at)
RECHECK_LIMIT = 1 << 16  # evicted files looked at again later, at most: past it the oldest is forgotten (counted)
LEFTOVERS_PER_PASS = 64  # leftovers tried again per eviction pass, oldest first (a pass's bounded cost)
PROBE_BLOCKS = 4  # writes come back only with room for this many of the largest block
_DISABLING_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


def _open_directory(directory: Path) -> None:
    """Create the directory (and its parents) if missing; anything in the way is the user's to fix."""
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"ssd tier: cannot use {directory} as its directory: {exc.strerror or exc}") from None


def _place(tmp: Path, path: Path) -> None:
    """Put the written `tmp` under its block's name, atomically and only if that name is free: a block
    file in place is never replaced (a second writer of one key holds the same block), so the file a
    load pinned stays the file under that name. File systems without hard links: `os.replace`."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        os.replace(tmp, path)


class _BlockLocks:
    """Pins and evictions of a directory's blocks, for every process on it: byte-range locks, one byte per
    block (at a hash of its key) in one of `LOCK_FILES` files under `.kvtier-locks/`. Linux open file
    description locks (`F_OFD_SETLK`): owned by an open of the file, not by the process, so two indexes in one
    process exclude each other as two processes do, and closing another descriptor never drops them. A pin
    costs no descriptor of its own: an index keeps one open per lock file it used (at most `LOCK_FILES`), and
    any number of pins hold, in every process. The kernel keeps a file's locks in one list that every lock call
    walks (measured: ~25 ns per lock held), hence several files: 10,000 pins held make a pin ~+10 us.
    - a pin: a shared lock, non-blocking (refused while an eviction holds the byte); this index's pins of one
      byte are counted, the lock taken at the first and dropped at the last;
    - an eviction: an exclusive lock on the same open, non-blocking (refused while another index pins the
      byte; this index's own pins are its counts, checked under the same mutex), held across the unlink.
    Two keys on one byte (1 in 2^62) only make an eviction wait for the other key's pin. No lock file (a
    read-only directory nobody can delete from): pins hold in this index only, evictions take no lock."""

    _SPAN = (1 << 62) - 1  # offsets below 2^62: off_t never overflows

    def __init__(self, directory: Path) -> None:
        self._dir = directory / _LOCKS_NAME
        try:
            self._dir.mkdir(exist_ok=True)
        except OSError:
            pass  # read-only: shared locks need only readable files, if they are there
        self._mutexes = [threading.Lock() for _ in range(LOCK_FILES)]  # a file's counts and lock calls in order
        self._fds: list[int | None] = [None] * LOCK_FILES  # this index's open of each lock file
        self._writable = [False] * LOCK_FILES
        self._pins: dict[tuple[int, int], int] = {}  # (lock file, byte) -> this index's pins on it
        self._closed = False
        self._unlockable = False  # a lock call failed for another reason than a held byte: no lock files now
        if not hasattr(fcntl, "F_OFD_SETLK"):  # Linux's open file description locks (macOS: none; Windows: no fcntl)
            self._give_up(OSError(errno.ENOSYS, "no open file description locks on this platform"))

    def _give_up(self, exc: OSError) -> None:
        """The file system refused a byte-range lock (ENOLCK: NFS without lockd; EINVAL / ENOSYS: no OFD
        locks): from now on as with no lock file — pins hold in this index only, evictions take no lock —
        rather than every hit a miss and every eviction a stuck block. Logged once."""
        if not self._unlockable:
            self._unlockable = True
            log.warning("kvtier: %s refuses byte-range locks (%s): pins hold in this process only", self._dir, exc)

    @classmethod
    def _where(cls, key: bytes) -> tuple[int, int]:
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        return h % LOCK_FILES, (h >> 2) & cls._SPAN

    def _fd(self, n: int) -> int | None:
        """This index's open of lock file `n` (under its mutex), opened at first use."""
        if self._fds[n] is None and not self._closed and not self._unlockable:
            path = self._dir / f"{n:02x}"
            try:
                self._fds[n], self._writable[n] = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
            except OSError:
                try:  # a read-only directory: shared locks need only a readable file
                    self._fds[n] = os.open(path, os.O_RDONLY)
                except OSError:
                    pass
        return None if self._unlockable else self._fds[n]

    @staticmethod
    def _lock(fd: int, cmd: int, kind: int, byte: int) -> int:
        """One `fcntl` on one byte; returns the lock type found (`F_OFD_GETLK`)."""
        got = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, byte, 1, 0))
        return struct.unpack(_FLOCK, got)[0]

    def _take(self, fd: int, kind: int, byte: int) -> bool:
        """Lock one byte, non-blocking: False while another open holds it; True when taken, or when the file
        system refuses byte-range locks (`_give_up`: none from then on)."""
        try:
            self._lock(fd, fcntl.F_OFD_SETLK, kind, byte)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            self._give_up(exc)
        return True

    def pin(self, key: bytes) -> bool:
        """Hold `key` shared; False while an eviction (any index's) holds it."""
        where = n, byte = self._where(key)
        with self._mutexes[n]:
            if not self._pins.get(where) and (fd := self._fd(n)) is not None \
                    and not self._take(fd, fcntl.F_RDLCK, byte):
                return False  # being evicted right now
            self._pins[where] = self._pins.get(where, 0) + 1
        return True

    def unpin(self, key: bytes) -> None:
        where = n, byte = self._where(key)
        with self._mutexes[n]:
            left = self._pins.pop(where, 0) - 1  # none: `close` dropped them meanwhile
            if left > 0:
                self._pins[where] = left
            elif left == 0 and (fd := self._fd(n)) is not None:
                try:
                    self._lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, byte)
                except OSError as exc:
                    self._give_up(exc)

    def evict(self, key: bytes, remove) -> bool:
        """`remove()` under `key`'s exclusive lock; False (not called) while any index pins it."""
        where = n, byte = self._where(key)
        with self._mutexes[n]:
            if self._closed or self._pins.get(where):
                return False
            fd = self._fd(n)
            if fd is None or not self._writable[n]:
                remove()
                return True
            if not self._take(fd, fcntl.F_WRLCK, byte):
                return False  # pinned by another index
            try:
                remove()
            finally:
                with contextlib.suppress(OSError):  # refused locks (`_give_up`): nothing was taken
                    self._lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, byte)
        return True

    def pinned_elsewhere(self, key: bytes) -> bool:
        """Whether another index (any process's) pins `key` (a test's view)."""
        n, byte = self._where(key)
        with self._mutexes[n]:
            fd = self._fd(n)
            return fd is not None and self._lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, byte) != fcntl.F_UNLCK

    def num_pinned(self) -> int:
        return sum(list(self._pins.values()))

    def close(self) -> None:
        """Every lock of this index goes with its descriptors."""
        for n, mutex in enumerate(self._mutexes):
            with mutex:
                if self._fds[n] is not None:
                    os.close(self._fds[n])
                    self._fds[n] = None
                self._closed = True
        self._pins.clear()


def _key_of(path: Path) -> bytes | None:
    """The key a block file holds, from its name `<shard>/<hex key>.kvb`; None for any other file."""
    hex_key = path.name.removesuffix(_BLOCK_SUFFIX)
    if hex_key == path.name or path.parent.name != hex_key[:2]:
        return None
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        return None
    return key if key and key.hex() == hex_key else None


class DiskTier:
    name = "ssd"
    owns_index = True  # decides what the directory keeps (`DiskStore`: another process does)
    in_process = False  # the blocks crossed a medium (a file, maybe another process's): full payload proof
    stream_chunk_blocks = STREAM_CHUNK_BLOCKS
    events: TierEvents | None = None  # `TierManager.watch()`: what lands and leaves, announced

    def __init__(self, directory: str | Path, capacity_bytes: int | None) -> None:
        self.directory = Path(directory)
        self._root = os.fspath(self.directory)
        _open_directory(self.directory)
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self.health = TierHealth(self.name)
        self._lru = LRUIndex(capacity_bytes)
        self._index_lock = threading.Lock()
        self._in_flux: set[bytes] = set()
        self._pins: dict[bytes, int] = {}  # blocks a load will read (`pin_many`): never evicted meanwhile
        self._locks = _BlockLocks(self.directory)  # ... nor by any other process (a shared lock per pin)
        # evicted, its file maybe still there (another process pinned it; or handed off, the deleter's to do):
        # (size, when last tried; handed off: 0 bytes), looked at again later, least recently tried first
        self._recheck: dict[bytes, tuple[int, float]] = {}
        self.rechecks_dropped = 0  # ... forgotten past `RECHECK_LIMIT`
        self._deletes: list[bytes] | None = None  # `hand_deletes_off`: evicted keys, deleted by someone else
        self._admitted: set[bytes] = set()  # ... admitted since the last `take_deletes` (this step)
        self._after_step: list[bytes] = []  # ... whose write the other process queues with this step,
        self._next_call: list[bytes] = []  # ... and with the last one: handed off at the next call
        self._readers: Tasks | None = None  # this tier's reads (and a store's deletes) on the process's transfer executor
        self._max_block_bytes = 0  # the largest block seen (scanned or offered): sizes the probe
        self._buffers = ReadBuffers()
        self._leases = Leases()  # read buffers lent out, by key
        self._direct_io = hasattr(os, "O_DIRECT")
        self._open()
        if self._read_only():
            self.health.fail(f"{self.directory}: read-only file system", reads=False)

    def _open(self) -> None:
        """Index what the directory holds (the owner of the directory's index: not `DiskStore`)."""
        self._scan()
        self._warn_if_disk_smaller()

    def _warn_if_disk_smaller(self) -> None:
        """A capacity the file system cannot hold is not an error (the disk may be cleaned up), but the
        tier will stop writing at ENOSPC long before it is full: say so now, not then."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return
        room = st.f_bavail * st.f_frsize + self._lru.used
        if room < self.capacity_bytes:
            log.warning("%s tier %s: capacity %s but the file system has room for %s (free + this tier's "
                        "blocks): writes stop when the disk fills", self.name, self.directory,
                        fmt_bytes(self.capacity_bytes), fmt_bytes(room))

    def _read_only(self) -> bool:
        try:
            return bool(os.statvfs(self.directory).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    def _path(self, key: bytes) -> Path:
        hex_key = key.hex()
        return self.directory / hex_key[:2] / f"{hex_key}{_BLOCK_SUFFIX}"

    def _file(self, key: bytes) -> str:
        """`_path` as a string, for the lookups' stats (one per block, every lookup): pathlib's joins cost
        more than the stat itself."""
        hex_key = key.hex()
        return f"{self._root}/{hex_key[:2]}/{hex_key}{_BLOCK_SUFFIX}"

    def _scan(self) -> None:
        found = []
        oldest_live_ns = time.time_ns() - int(TMP_GRACE_SECONDS * 1e9)
        for path in self.directory.glob("*/*"):
            try:
                stat = path.stat()
            except OSError:
                continue  # gone meanwhile: another process's write or eviction
            if path.name.endswith(_TMP_SUFFIX):
                if stat.st_mtime_ns < oldest_live_ns:
                    self._remove(path)  # a write that never reached its name (younger: maybe a live one)
            elif (key := _key_of(path)) is not None:
                found.append((stat.st_mtime_ns, key, stat.st_size))
        for _, key, size in sorted(found):
            self._max_block_bytes = max(self._max_block_bytes, size)
            for victim, victim_size in self._lru.insert(key, size) or []:  # more than the configured size
                if not self._remove_unpinned(victim):
                    self._recheck_later([(victim, victim_size)], time.monotonic())

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:  # a read-only disk: the file stays, unindexed
            self._write_failed(exc)

    def _remove_unpinned(self, key: bytes) -> bool:
        """Delete a block's file unless a load pinned it (any process's `pin_many`: a shared lock on its byte
        of the lock file); False when it stays (pinned, or the disk refused: it is tried again later). The
        exclusive lock is held across the unlink, so a pin taken meanwhile finds the file gone (`_pin`)."""
        removed = [True]

        def remove() -> None:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as exc:  # a read-only disk: the file stays
                self._write_failed(exc)
                removed[0] = False

        return self._locks.evict(key, remove) and removed[0]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        # tail first: a block adopted (or resized) here is inserted anew, and a request's root ends most recent
        return tail_first([self._holds(key) for key in tail_first(keys)])

    def pin_many(self, keys: list[bytes]) -> list[bool]:
        """`contains_many`, each held block kept from eviction until `unpin` — this process's and every
        other's (a shared lock on the block's byte of `.kvtier-locks`, no descriptor of its own: any number of
        pins) — and refreshed (a use), tail first. A file that goes anyway (removed by hand) makes the read a
        miss: recomputed."""
        return tail_first([self._pin(key) for key in tail_first(keys)])

    def touch_many(self, keys: list[bytes]) -> None:
        """Refresh a request's blocks (root first) tail first: the manager, after a read that came in chunks."""
        with self._index_lock:
            self._lru.touch_many(keys)

    def _pin(self, key: bytes) -> bool:
        """Held, and pinned for a load: a use (the owner of a directory a worker reads sees no read of its
        own). The lock comes first, then the lookup: an eviction holds its lock across the unlink, so a file
        found now stays until `unpin`."""
        if not self._locks.pin(key):
            return False  # being evicted right now
        if not self._holds(key):
            self._locks.unpin(key)
            return False
        with self._index_lock:
            self._lru.touch(key)
            self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, keys: list[bytes]) -> None:
        """One `unpin` per `pin_many` that held the block; the last one lets any process evict it again."""
        released = []
        with self._index_lock:
            for key in keys:
                if key in self._pins:
                    self._pins[key] -= 1
                    if not self._pins[key]:
                        del self._pins[key]
                    released.append(key)
        for key in released:
            self._locks.unpin(key)

    def placed_below(self, keys: list[bytes]) -> None:
        pass  # the SSD evicts by deleting: it never hands blocks back for demotion

    def _holds(self, key: bytes) -> bool:
        """Indexed and its file still there (the index may be stale: another process's eviction, a
        write another process has yet to land), or a file found now and adopted."""
        with self._index_lock:
            if key in self._in_flux:
                return False
            indexed = key in self._lru
        if not indexed:
            return self._adopt(key)
        try:
            size = os.stat(self._file(key)).st_size
        except OSError:
            return False
        self._resize(key, size)
        return True

    def _resize(self, key: bytes, size: int) -> None:
        """An indexed block's file is `size` bytes: count that (a block `admit`ted at an estimate)."""
        with self._index_lock:
            if key in self._in_flux or key not in self._lru or self._lru.size_of(key) == size:
                return
            victims = self._insert(key, size) or []
        self._evict(victims)

    def _adopt(self, key: bytes) -> bool:
        """A block file another process wrote after our scan: take it into the index. Not while the
        disk takes no writes: nobody adds blocks to it, and the file could be one we failed to evict."""
        if not self.health.writable:
            return False
        try:
            size = os.stat(self._file(key)).st_size
        except OSError:
            return False
        with self._index_lock:
            if key in self._in_flux:
                return False
            victims = self._insert(key, size) or []
            held = key in self._lru
        self._evict(victims)
        return held

    def _insert(self, key: bytes, size: int, batch: set[bytes] = frozenset()) -> list[tuple[bytes, int]] | None:
        """Index `key` (under the index lock), evicting neither a pinned block nor one of `batch` (the call's
        other blocks: a chain longer than the tier keeps its first ones); its victims are in flux until
        `_evict` removed their files."""
        victims = self._lru.insert(key, size, pinned=self._in_flux.union(self._pins, batch))
        self._in_flux.update(victim for victim, _ in victims or [])
        self._recheck.pop(key, None)  # counted again: not ours to delete later
        return victims

    def _evict(self, victims: list[tuple[bytes, int]], *, every_leftover: bool = False) -> None:
        """Delete the victims' files (or hand them to `take_deletes`). A file another process pinned stays,
        out of our index, as a leftover: tried again at later eviction passes, `LEFTOVERS_PER_PASS` of them a
        pass, the oldest first (`every_leftover`: all, at `close`), until it goes or is indexed again, so no
        file stays on disk that no index counts."""
        keys = [victim for victim, _ in victims]
        if self._deletes is not None:  # the process that deletes them announces them
            with self._index_lock:
                fresh = [key for key in keys if key in self._admitted]  # this step's: a write may be to come
            to_come = {key for key in fresh if not os.path.exists(self._file(key))}
            with self._index_lock:
                self._deletes.extend(key for key in keys if key not in to_come)
                self._after_step.extend(key for key in keys if key in to_come)  # with the next step
                self._in_flux.difference_update(keys)
            self.stats.evictions += len(keys)
            return
        with self._index_lock:  # leftovers tried again, in flux meanwhile as victims are
            retried = self._take_rechecks(None if every_leftover else LEFTOVERS_PER_PASS)
            self._in_flux.update(key for key, _ in retried)
        victims = victims + retried
        removed = []
        try:
            for key, size in victims:
                if self._remove_unpinned(key):
                    removed.append(key)
                else:
                    with self._index_lock:
                        self._recheck_later([(key, size)], time.monotonic())
        finally:  # an unexpected error leaves no key in flux for good (neither held nor adoptable)
            self.stats.evictions += len(removed)
            announce_removed(self, removed)
            with self._index_lock:
                self._in_flux.difference_update(key for key, _ in victims)

    def _recheck_later(self, victims: list[tuple[bytes, int]], now: float) -> None:
        """Look at these evicted blocks' files again later, after every other (under the index lock). Past
        `RECHECK_LIMIT` the least recently tried is forgotten, its file (if still there: pinned for long, or
        a deleter that never deletes) left to the next start-up's scan: counted (`rechecks_dropped`), logged."""
        for key, size in victims:
            self._recheck.pop(key, None)
            self._recheck[key] = (size, now)
        over = len(self._recheck) - RECHECK_LIMIT
        if over > 0:
            for key in list(itertools.islice(self._recheck, over)):
                del self._recheck[key]
            if not self.rechecks_dropped:
                log.warning("%s tier %s: more than %d evicted files to look at again; forgetting the oldest "
                            "(a file still there stays until the next start-up)", self.name, self.directory,
                            RECHECK_LIMIT)
            self.rechecks_dropped += over

    def _take_rechecks(self, limit: int | None, wait_seconds: float = 0.0) -> list[tuple[bytes, int]]:
        """At most `limit` (None: all) evicted blocks whose files to look at again now, least recently tried
        first, each last tried `wait_seconds` ago or more; taken off the list (one in flux stays on it). Under
        the index lock. The one retry list of both ways to evict: an eviction pass's leftovers, a hand-off's
        second look (`take_deletes`)."""
        now = time.monotonic()
        due = []
        for key, (size, tried) in self._recheck.items():
            if len(due) == limit or now - tried < wait_seconds:
                break
            if key not in self._in_flux:
                due.append((key, size))
        for key, _ in due:
            del self._recheck[key]
        return due

    def leftover_bytes(self) -> int:
        """Evicted blocks whose files are still on disk, pinned by another process: deleted at a later pass
        (after `hand_deletes_off`: none, the deleter's)."""
        with self._index_lock:
            return sum(size for size, _ in self._recheck.values())

    def hand_deletes_off(self) -> None:
        """From now on this index decides evictions and another process executes them: evicted keys
        collect for `take_deletes` instead of being deleted here (vLLM: the scheduler owns the index,
        its workers delete what the step's metadata tells them). Leftovers of the start-up scan go with
        the first ones."""
        with self._index_lock:
            self._deletes = list(self._recheck)
            self._recheck.clear()

    def take_deletes(self) -> list[bytes]:
        """The keys evicted since the last call (after `hand_deletes_off`), LRU first — one admitted this step
        whose file has not landed, and those said to be written here unadmitted (`hand_off_next`), at the next
        call: the other process queues their writes with this step (a save, a promotion after a load), so their
        delete goes with the next step, behind the writes — and again any key handed off a while ago
        whose file is still there and that no index here counts (a delete the other side could not do: another
        process pinned the file). A key indexed again since its eviction (admitted or adopted: counted) is not
        handed off, and none twice in one call. A handed-off key is looked at `SHIPPED_RECHECK_SECONDS` later
        (the other side has had its step to delete it), at most `SHIPPED_CHECKS_PER_CALL` a call or twice the
        call's new deletes (more leave the list than join it), least recently looked at first, and forgotten once
        its file is gone: the other side deletes behind the writes it queued before the delete
        (`DiskStore.delete_behind_writes`), so no write of it lands later."""
        now = time.monotonic()
        with self._index_lock:  # a key indexed again since (counted) stays; each key once
            deletes = list(dict.fromkeys(key for key in (self._deletes or []) + self._next_call
                                         if key not in self._lru and key not in self._in_flux))
            self._deletes = []
            self._next_call, self._after_step = self._after_step, []
            self._admitted.clear()
            due = self._take_rechecks(max(SHIPPED_CHECKS_PER_CALL, 2 * len(deletes)), SHIPPED_RECHECK_SECONDS)
            self._recheck_later([(key, 0) for key in deletes], now)
        if not due:
            return deletes
        still_there = [key for key, _ in due if os.path.exists(self._file(key))]
        with self._index_lock:  # not indexed again (counted) nor handed off anew meanwhile
            again = [key for key in still_there
                     if key not in self._lru and key not in self._in_flux and key not in self._recheck]
            self._recheck_later([(key, 0) for key in again], now)
        return deletes + again

    def admit(self, keys: list[bytes], size_bytes: int) -> list[bool]:
        """Index blocks another process is about to write here (their size as `size_bytes`, corrected
        by the first lookup that finds the file), evicting to make room as a write would; whether each
        is indexed (not: everything else is pinned or one of `keys`, which never evict each other: a chain
        longer than the tier keeps its first blocks). Refreshed tail first (`kvtier.lru`). Until their files
        land, lookups find them missing."""
        victims: list[tuple[bytes, int]] = []
        batch = set(keys)
        with self._index_lock:
            for key in keys:
                if key not in self._lru and key not in self._in_flux:
                    victims += self._insert(key, size_bytes, batch) or []
            admitted = [key in self._lru for key in keys]
            self._lru.touch_many(keys)
            if self._deletes is not None:
                self._admitted.update(keys)
        self._evict(victims)
        return admitted

    def hand_off_next(self, keys: list[bytes]) -> None:
        """After `hand_deletes_off`: `keys`, which `admit` refused this step, will be written here all the same
        (vLLM's worker writes a block through to every directory once one took it, and promotes what it loaded
        from below): handed off for deletion at the `take_deletes` after this step's, so the delete reaches the
        other process behind the write it queues with this step (`DiskStore.delete_behind_writes` then removes
        the file however late it lands). A key indexed meanwhile is kept."""
        with self._index_lock:
            if self._deletes is not None:
                self._after_step += keys

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def _read_all(self, keys: list[bytes], read) -> list:
        """`read(path)` of each key's file, None where it cannot be read. No index lookup first: a load
        reads where its lookup (`pin_many` / `contains_many`, maybe another process's) found the block,
        and a missing file is just a miss. Batched reads are leaf tasks on the process's transfer executor
        (`kvtier.transfer.executor`: its workers, not threads of this tier): an SSD serves several reads
        faster than one at a time (queue depth), and file reads release the GIL."""
        paths = [self._path(key) for key in keys]
        if len(paths) < 2:
            return [read(path) for path in paths]
        return list(self._reader_pool().map(read, paths))

    def _reader_pool(self) -> Tasks:
        if self._readers is None:
            self._readers = Tasks()  # on the process's executor at each read
        return self._readers

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        start = time.perf_counter()
        out = self._read_all(keys, self._read)
        self._after_read(keys, out)
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def lease_many(self, keys: list[bytes]) -> list[memoryview | None]:
        """Like `get_many`, each file read straight into a pooled buffer (O_DIRECT where possible);
        read-only views, valid until `release(keys)` gives the buffers back."""
        start = time.perf_counter()
        out: list[memoryview | None] = []
        for key, got in zip(keys, self._read_all(keys, self._read_into)):
            if got is None:
                out.append(None)
                continue
            buf, size = got
            self._leases.add(key, buf)
            out.append(memoryview(buf)[:size].toreadonly())
        self._after_read(keys, out)
        self.stats.read_seconds += time.perf_counter() - start
        return out

    def lease_layers(self, keys: list[bytes]) -> list[RangedRead | None]:
        """`lease_many` in pieces, for a reader that takes a block layer by layer: each file's head (its
        header and layer 0) and layer table are read before this returns, the other layers are on their
        way — piece n of every file before piece n + 1 of any (`RangedRead.wait` for a byte range).
        Nothing is verified here (the manager does, slice by slice); buffers leased until `release`."""
        start = time.perf_counter()
        readers = self._reader_pool()
        reads = list(readers.map(self._read_head, [self._path(key) for key in keys]))
        plans = [read.rest if read is not None else [] for read in reads]
        for n in range(max(map(len, plans), default=0)):
            for read, plan in zip(reads, plans):
                if n < len(plan):
                    read.submit(readers, plan[n:n + 1])
        for key, read in zip(keys, reads):
            if read is not None:
                self._leases.add(key, read)
        self._after_read(keys, [read.view() if read is not None else None for read in reads], stamp=False)
        # the stamps (a metadata write per file) after the reads, off the way to layer 0
        readers.submit(self._stamp, [self._path(key) for key, read in zip(keys, reads) if read is not None])
        self.stats.read_seconds += time.perf_counter() - start
        return reads

    def _read_head(self, path: Path) -> RangedRead | None:
        """The file opened, a buffer for all of it taken, its first `HEAD_BYTES` read and then the piece with
        its last bytes (a layered block's table; any other file: all the rest), the other pieces left in
        `read.rest`; None: unreadable."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        read = None
        try:
            size = os.fstat(fd).st_size
            read = RangedRead(fd, self._buffers.take(size), size, lambda: self._open_device(path))
            read.read(0, min(size, HEAD_BYTES))
            pieces = plan_pieces(size, read.view()[:HEAD_BYTES])
            if pieces:  # the table (or the rest) first: a reader proves layer 0 with it
                read.read(*pieces[0])
            read.rest = pieces[1:]
            return read
        except OSError:
            if read is not None:
                read.close()
                self._buffers.give(read.buf)
            else:
                os.close(fd)
            return None

    def _open_device(self, path: Path) -> tuple[int, bool]:
        """`path` opened for reads from the device: (fd, whether O_DIRECT)."""
        fd = self._open_for_read(path)
        return fd, self._direct_io

    def release(self, keys: list[bytes]) -> None:
        """Give back the buffers `lease_many` / `lease_layers` read `keys` into (one lease each)."""
        for buf in self._leases.end(keys):
            if isinstance(buf, RangedRead):  # its pieces still reading end (or are cancelled) first
                buf.close()
                buf = buf.buf
            self._buffers.give(buf)

    def num_leased(self) -> int:
        return len(self._leases)

    def _read_into(self, path: Path) -> tuple[mmap.mmap, int] | None:
        """The whole file in a pooled buffer: (buffer, file size), or None if it cannot be read."""
        try:
            fd = self._open_for_read(path)
        except OSError:
            return None
        buf = None
        try:
            size = os.fstat(fd).st_size
            buf = self._buffers.take(size)
            done = 0
            while done < size:  # O_DIRECT reads whole pages; the last one comes back short at EOF
                n = os.preadv(fd, [memoryview(buf)[done:]], done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short read of {path}")
                done += n
            return buf, size
        except OSError:
            if buf is not None:
                self._buffers.give(buf)
            return None
        finally:
            os.close(fd)

    def _open_for_read(self, path: Path) -> int:
        if self._direct_io:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_io = False  # this file system does not do O_DIRECT: the page cache it is
                log.info("ssd tier %s: no O_DIRECT on this file system; buffered reads", self.directory)
        return os.open(path, os.O_RDONLY)

    def _after_read(self, keys: list[bytes], out: list, *, stamp: bool = True) -> None:
        """Bookkeeping shared by both reads: recency (a block another process wrote is adopted now,
        its size known from the read), stamps, lost files, counters."""
        hit_keys = [key for key, data in zip(keys, out) if data is not None]
        with self._index_lock:
            adopt = [(key, len(data)) for key, data in zip(keys, out)
                     if data is not None and key not in self._lru and key not in self._in_flux]
        if adopt and self.health.writable:  # as `_adopt`: a disk that takes no writes adopts nothing
            for key, size in adopt:
                with self._index_lock:  # the file checked under the lock: an eviction of it is in flux or done
                    fresh = key not in self._in_flux and key not in self._lru and self._path(key).exists()
                    victims = (self._insert(key, size, set(hit_keys)) or []) if fresh else []
                self._evict(victims)
        with self._index_lock:  # a read is a use: tail first
            self._lru.touch_many(hit_keys)
        if stamp:
            self._stamp([self._path(key) for key in hit_keys])
        for key, data in zip(keys, out):
            if data is None:
                self._lost(key)
        self.stats.hits += len(hit_keys)
        self.stats.misses += len(keys) - len(hit_keys)
        self.stats.bytes_read += sum(len(d) for d in out if d is not None)

    def _lost(self, key: bytes) -> None:
        """An indexed file failed to read: gone (another process's eviction, an operator: dropped from
        the index — a miss, not an error, in a directory several processes share), or evicted by our
        own writer meanwhile — and maybe written again since (just a miss)."""
        with self._index_lock:
            if key in self._in_flux or key not in self._lru or self._path(key).exists():
                return
            self._lru.pop(key)
        announce_removed(self, [key])

    @staticmethod
    def _stamp(paths: list[Path]) -> None:
        """Writes and reads are use: set the mtime of a request's blocks (root first) a nanosecond apart, tail
        first as the index refreshes them, so the LRU order rebuilt at the next start is use order. One
        metadata update per block."""
        now_ns = time.time_ns()
        for i, path in enumerate(tail_first(paths)):
            try:
                os.utime(path, ns=(now_ns + i, now_ns + i))
            except OSError:
                pass  # a read-only disk keeps its old order

    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Write blocks, most valuable first (a request's in prompt order, root first: stored events name a
        parent before its children); evicted blocks are deleted (the SSD is the last tier), so none are
        returned. The batch's blocks never evict each other (a chain longer than the tier keeps its first
        ones) and are refreshed, and stamped, tail first (`kvtier.lru`)."""
        start = time.perf_counter()
        batch = {key for key, _ in items}
        for key, data in items:
            if not self.health.writable:
                break  # the disk filled up mid-batch
            self._put(key, data, batch)
        keys = [key for key, _ in items]
        with self._index_lock:
            self._lru.touch_many(keys)
        self._stamp([self._path(key) for key in keys])
        self.stats.write_seconds += time.perf_counter() - start
        return []

    def _put(self, key: bytes, data: bytes, batch: set[bytes]) -> None:
        with self._index_lock:
            self._max_block_bytes = max(self._max_block_bytes, len(data))
            if key in self._lru:
                return  # refreshed with its batch
            if key in self._in_flux:
                return  # its old file is being removed (a lookup's eviction): skip it this time
            victims = self._insert(key, len(data), batch)
            if victims is None:
                return  # larger than the whole tier
            self._in_flux.add(key)
        try:
            self._evict(victims)
            self._write(self._path(key), data)
        except OSError as exc:
            with self._index_lock:
                self._lru.pop(key)
            self._write_failed(exc)
        else:
            self.stats.puts += 1
            self.stats.bytes_written += len(data)
            announce_stored(self, [key])
        finally:
            with self._index_lock:
                self._in_flux.discard(key)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(exist_ok=True)  # shard directory: first two hex digits of the key
        # a name of this write's own: two processes writing one key never share (truncate) a file
        tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _place(tmp, path)
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # read-only: there is no tmp file either

    def _write_failed(self, exc: OSError) -> None:
        self.stats.errors += 1
        if exc.errno in _DISABLING_ERRNOS:
            self.health.fail(f"{self.directory}: {exc.strerror or exc}", reads=False)

    def reconnect(self) -> bool:
        """Probe: turn writes (and reads, if a bug turned them off) back on when a write would work."""
        if self.health.healthy:
            return True
        problem = self._write_problem()
        if problem is None:
            self.health.recover()
        else:
            log.debug("ssd tier %s: still not writable: %s", self.directory, problem)
        return problem is None

    def _write_problem(self) -> str | None:
        try:
            fs = os.statvfs(self.directory)
        except OSError as exc:
            return str(exc)
        if fs.f_flag & os.ST_RDONLY:
            return "read-only file system"
        free_bytes = fs.f_bavail * fs.f_frsize
        need_bytes = PROBE_BLOCKS * self._max_block_bytes
        if free_bytes < need_bytes:
            return f"{fmt_bytes(free_bytes)} free, fewer than {PROBE_BLOCKS} blocks ({fmt_bytes(need_bytes)})"
        probe = self.directory / f"{_PROBE_NAME}-{os.getpid()}"  # a process's own: two probes never race
        try:
            self._write(probe, b"ok")
            probe.unlink()
        except OSError as exc:
            return str(exc)
        return None

    def delete(self, key: bytes) -> bool:
        """Drop a bad block (the manager's verify found it corrupt or foreign), pinned or not: every
        reader of it would fail the same check."""
        with self._index_lock:
            if key in self._in_flux or self._lru.pop(key) is None:
                return False
            self._in_flux.add(key)
        self._remove(self._path(key))
        announce_removed(self, [key])
        with self._index_lock:
            self._in_flux.discard(key)
        return True

    def used_bytes(self) -> int:
        return self._lru.used

    def num_blocks(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        if self._readers is not None:
            self._readers.join()  # its reads and stamps still out (the executor is the process's)
        self._buffers.close()  # leased buffers still out are unmapped when they come back
        if self._deletes is None and self._recheck:
            self._evict([], every_leftover=True)  # a last try at every one (still pinned: the next start-up indexes it)
        with self._index_lock:
            self._pins.clear()
        self._locks.close()  # every pin's lock goes with it


class DiskStore(DiskTier):
    """A block directory whose index and eviction another process owns (a vLLM worker's SSD or
    `shm:`: `SchedulerSide` admits the blocks the worker writes and tells it what to delete): write,
    read and delete, no index, no eviction, no start-up cleanup. Lookups ask the files."""

    owns_index = False

    def __init__(self, directory: str | Path, name: str = "ssd") -> None:
        self.name = name
        super().__init__(directory, None)

    def _open(self) -> None:
        pass  # the owner scans and cleans up

    def touch_many(self, keys: list[bytes]) -> None:
        """Nothing to refresh: no index here (the owner's LRU orders the directory)."""

    def _holds(self, key: bytes) -> bool:
        with self._index_lock:
            if key in self._in_flux:
                return False
        return os.path.exists(self._file(key))

    def _insert(self, key: bytes, size: int, batch: set[bytes] = frozenset()) -> list[tuple[bytes, int]]:
        return []  # nothing indexed, nothing evicted: the owner's index decides

    def delete(self, key: bytes) -> bool:
        """Drop a bad block (as `DiskTier.delete`)."""
        return self._delete(key, lambda: self._remove(self._path(key)) is None)

    def delete_many(self, keys: list[bytes]) -> int:
        """The files the owner's index evicted, deleted now: how many went (one a load pinned stays, as one
        being written here right now). `delete_behind_writes` orders them after this process's writes."""
        return sum(self._delete(key, lambda: os.path.exists(self._file(key)) and self._remove_unpinned(key))
                   for key in keys)

    def delete_behind_writes(self, keys: list[bytes]) -> Future:
        """`delete_many` on the process's writes lane (`TransferExecutor.after_writes`: never dropped, never
        waits): behind every write this process queued before it, so a write queued before its key's eviction
        lands first and goes, however late; ahead of every write queued after it (the key admitted again: that
        file stays). Its future says how many went; the store's close waits for it."""
        return self._reader_pool().after_writes(self.delete_many, keys)

    def _delete(self, key: bytes, remove) -> bool:
        """`remove()` (True: the file went) with `key` in flux meanwhile (not held, nor removed twice), the
        removal announced: a bad block's and an evicted one's."""
        with self._index_lock:
            if key in self._in_flux:
                return False
            self._in_flux.add(key)
        try:
            removed = bool(remove())
        finally:
            with self._index_lock:
                self._in_flux.discard(key)
        if removed:
            announce_removed(self, [key])
        return removed


class SharedMemoryTier(DiskTier):
    """The disk tier on a RAM file system (`/dev/shm`): DRAM that every process on the host sees.

    vLLM's scheduler and worker are separate processes; a `HostTier` lives in one of them, block files
    under `/dev/shm` are read by both (the scheduler's lookups, the worker's loads) at memory speed."""

    name = "shm"
