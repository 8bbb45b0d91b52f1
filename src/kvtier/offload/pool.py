"""The host block pool: the host's peer of the device's `BlockManager`, for offloaded requests.

An offloaded request keeps its middle blocks in DRAM slots (the DRAM tier's, the same slots prefix caching uses).
The pool is the engine's one owner of that memory: its slots' typed view (what attention reads), its *room*
(slots set aside per request at admission for its longest need, so a running request never finds host memory
full; an ended request whose tier load may still pin slots keeps its room until the load is back) and its *pins*
(a block held in a slot while a sequence attends to it: where DRAM holds it already, else encoded and stored).
Pins go through `TierManager.pin_host` / `unpin_host` (the tier's locks, write-through and demotion stay the
manager's); the engine never touches them directly.
"""

from __future__ import annotations

from collections.abc import Callable


class HostRoomError(ValueError):
    """An offloaded request whose host blocks do not fit the host memory left (the message is for
    the client). `ever` is False when it could never fit (a 400), True when others hold the room now (429)."""

    def __init__(self, message: str, ever: bool) -> None:
        super().__init__(message)
        self.ever = ever


class HostBlockPool:
    """Host slots, room and pins of the offloaded requests of one engine (`manager`'s DRAM tier)."""

    def __init__(self, manager, block_bytes: int) -> None:
        host = manager.host_tier()
        if host is None:
            raise ValueError("the host block pool needs a DRAM tier (the manager's top tier)")
        self.manager = manager
        self.num_slots = host.num_slots
        self.block_bytes = block_bytes
        self._reserved: dict[str, int] = {}   # request id -> slots set aside for it
        self._held_by_loads: set[str] = set()  # ended requests whose tier load may still pin slots

    @property
    def num_reserved(self) -> int:
        return sum(self._reserved.values())

    def payloads(self, dtype, shape: tuple[int, ...]):
        """`[num_slots, *shape]` typed view of every slot's payload: a pinned block is row `slot`."""
        return self.manager.host_payloads(dtype, shape)

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
        `encode()`d and stored there. Returns the slot; RuntimeError when no slot can hold it."""
        slot = self.manager.pin_host(key, None)
        if slot is None:
            slot = self.manager.pin_host(key, encode())
        if slot is None:
            raise RuntimeError("host memory could not hold a block (every DRAM slot pinned)")
        return slot

    def unpin(self, keys: list[bytes]) -> None:
        """Let go of blocks no sequence attends to any more (finished, aborted, preempted, a load not taken)."""
        if keys:
            self.manager.unpin_host(keys)
