"""The host block pool: the host's peer of the device's `BlockManager`, for offloaded requests.

An offloaded request keeps its middle blocks in DRAM slots (the DRAM tier's, the same slots prefix caching uses).
The pool is the engine's one owner of that memory: its slots' typed view (what attention reads), its *room*
(slots set aside per request at admission for its longest need, so a running request never finds host memory
full; an ended request whose tier load may still pin slots keeps its room until the load is back) and its *pins*
(a block held in a slot while a sequence attends to it: where DRAM holds it already, else stored there; a pinned
slot is never evicted nor reused by the tier's LRU). Pins are leases of the top tier's memory in place, through
the manager (`TierManager.lease_in_place`: the tier's lock, write-through and demotion stay the manager's); the
pool counts them, so the engine and its tests see what is held without reading a tier.

Two threads pin: the step thread (`pin`: a block leaving a sequence's device window) and the transfer worker
(`pin_match`: a cached prefix's middle blocks, read from where a lookup found them). The counts take a lock; the
room is the step thread's alone.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field

from kvtier.tiers.manager import PrefixMatch

log = logging.getLogger(__name__)


class HostRoomError(ValueError):
    """An offloaded request whose host blocks do not fit the host memory left (the message is for
    the client). `ever` is False when it could never fit (a 400), True when others hold the room now (429)."""

    def __init__(self, message: str, ever: bool) -> None:
        super().__init__(message)
        self.ever = ever


@dataclass(slots=True)
class PinnedInHost:
    """What `pin_match` holds in DRAM slots: the first `len(slots)` blocks of the match."""

    slots: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)  # the tier each came from

    def __len__(self) -> int:
        return len(self.slots)


class HostBlockPool:
    """Host slots, room and pins of the offloaded requests of one engine (`manager`'s top tier, DRAM)."""

    def __init__(self, manager, block_bytes: int) -> None:
        self.num_slots = manager.num_in_place_slots
        if not self.num_slots:
            raise ValueError("the host block pool needs a DRAM tier (the manager's top tier)")
        self.manager = manager
        self.block_bytes = block_bytes
        self._reserved: dict[str, int] = {}   # request id -> slots set aside for it
        self._held_by_loads: set[str] = set()  # ended requests whose tier load may still pin slots
        self._pins: Counter[bytes] = Counter()  # key -> pins held (a block shared by two sequences: two)
        self._lock = threading.Lock()

    @property
    def num_reserved(self) -> int:
        return sum(self._reserved.values())

    @property
    def num_pinned(self) -> int:
        """Pins held now (0 once every offloaded request has ended and its loads are back)."""
        with self._lock:
            return sum(self._pins.values())

    def payloads(self, dtype, shape: tuple[int, ...]):
        """`[num_slots, *shape]` typed view of every slot's payload: a pinned block is row `slot`."""
        return self.manager.in_place_view(dtype, shape)

    # -- room -----------------------------------------------------------------------------------------
    def check_room(self, need: int) -> None:
        """`HostRoomError` unless `need` slots can be set aside now (`ever=False`: never, on this DRAM tier)."""
        if need > self.num_slots:
            raise HostRoomError(f"host memory: this request keeps {need} blocks ({need * self.block_bytes:,} B) in "
                                f"the DRAM tier, which holds {self.num_slots} blocks in all: shorten the prompt or "
                                "max_tokens, or give the DRAM tier more memory", ever=False)
        free = self.num_slots - self.num_reserved
        if need > free:
            raise HostRoomError(f"host memory: this request keeps {need} blocks ({need * self.block_bytes:,} B) in "
                                f"the DRAM tier; {free} of its {self.num_slots} blocks are free now (the rest hold "
                                "running long requests): retry later", ever=True)

    def reserve(self, request_id: str, need: int) -> None:
        """Set `need` slots aside for a request (`HostRoomError` when they are not free)."""
        assert request_id not in self._reserved, f"request {request_id!r} has host room already"
        self.check_room(need)
        self._reserved[request_id] = need

    def release(self, request_id: str, *, load_in_flight: bool = False) -> None:
        """A request ended: its room goes back, or, while a tier load of it may still pin slots, when that
        load is back (`load_returned`)."""
        if request_id not in self._reserved:
            return
        if load_in_flight:
            self._held_by_loads.add(request_id)
        else:
            del self._reserved[request_id]

    def load_returned(self, request_id: str) -> None:
        """The load of an ended request is back (its slots unpinned): its room goes back."""
        if request_id in self._held_by_loads:
            self._held_by_loads.discard(request_id)
            self._reserved.pop(request_id, None)

    # -- pins -----------------------------------------------------------------------------------------
    def pin(self, key: bytes, encode: Callable[[], bytes]) -> int:
        """Hold `key`'s block in a slot: where DRAM holds it already (checked by its key-bound header), else
        `encode()`d and stored there (and written through below). Returns the slot; RuntimeError when no
        slot can hold it."""
        slot = self.manager.lease_in_place([(key, None)])[0]
        if slot is None:
            slot = self.manager.lease_in_place([(key, encode())])[0]
        if slot is None:
            raise RuntimeError("host memory could not hold a block (every DRAM slot pinned)")
        self._count([key], +1)
        return slot

    def pin_match(self, match: PrefixMatch) -> PinnedInHost:
        """Hold a lookup's blocks in DRAM slots, in order, each until `unpin`: a block DRAM holds is pinned
        where it is; one read from below (its payload proven by the stream) is stored into a slot, not
        written back down, and pinned there. Ends at the first block missing, bad, or that no slot can
        hold; the lookup's own pins end with the stream."""
        pinned = PinnedInHost()
        top = self.manager.tiers[0].name
        try:
            with closing(self.manager.stream(match)) as blocks:
                for block in blocks:
                    here = block.tier == top
                    slot = self.manager.lease_in_place([(block.key, None if here else block.payload)],
                                                       from_below=not here)[0]
                    if slot is None:
                        break
                    pinned.slots.append(slot)
                    pinned.keys.append(block.key)
                    pinned.tiers.append(block.tier)
                    self._count([block.key], +1)
        except BaseException:
            self.unpin(pinned.keys)  # nobody takes them
            raise
        return pinned

    def unpin(self, keys: list[bytes]) -> None:
        """Let go of blocks no sequence attends to any more (finished, aborted, preempted, a load not taken)."""
        if keys:
            self._count(keys, -1)
            self.manager.release_in_place(keys)

    def _count(self, keys: list[bytes], delta: int) -> None:
        with self._lock:
            for key in keys:
                self._pins[key] += delta
                assert self._pins[key] >= 0, f"block {key.hex()[:12]} unpinned more often than pinned"
                if not self._pins[key]:
                    del self._pins[key]
