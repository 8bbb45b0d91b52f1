"""Scheduler side: how many prompt tokens the tiers hold beyond vLLM's own prefix cache, which device
blocks to fill from them, and which newly full blocks to send down.

vLLM asks the device prefix cache first and offers the rest to `num_matched_tokens`; one lookup
(one `contains` round per tier, top-down, each asked only for what the tiers above lack) finds the
longest held run. The load itself runs on the worker; the scheduler never waits on a tier.

The shared directories (SSD, `shm:`) have one owner, this side (as vLLM's offloading manager keeps
its index in the scheduler): their index and eviction are decided here, the workers only write, read
and delete files. A step's saves are admitted into the index when they are sent down (evicting to make
room; a block not written yet is a miss until its file lands); the keys evicted go to the workers in
the step's records (`StepRecords.deletes`). The blocks a lookup offers are pinned at the lookup, so neither
this index nor any other process's (`DiskTier` pins are locks every process honours) deletes them before
vLLM allocates for them: the allocation trims the pins to what it takes (all released if it takes none), a
request waiting for device blocks, which vLLM asks about again each step, keeps its lookup and pins while
they stand (`_same_lookup`: one block probed a step, not the whole prompt), one not asked about in a step
is released when that step's records are built (its next lookup pins again), and what a load takes stays
pinned until the worker reports the load done (`loaded_from`) or the request ends. A request's blocks are
refreshed tail first (`kvtier.lru`): a lookup's pins, and each step that sends blocks down refreshes the
request's whole chain after admitting them, so its root stays the most recent and a full directory evicts
chains from their tails. A lookup asks for the first block alone before the rest: a miss costs one block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from kvtier.blocks import KeySpace
from kvtier.integrations.vllm.trackers import (LoadPlan, LoadSpec, RequestTracker, SaveSpec, StepRecords,
                                               request_namespace, shard_keys)
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.manager import TierManager

log = logging.getLogger("vllm.kvtier")  # under vLLM's logger: printed with its own lines


class SchedulerSide:
    """`world_size` workers (tensor parallel ranks) each store their shard of a block under its own key
    (`plan.shard_keys`): a block is a hit only when every rank's shard is held."""

    def __init__(self, space: KeySpace, manager: TierManager, world_size: int = 1, *, block_bytes: int | None = None,
                 saves: bool = True, promote_into: str | None = None) -> None:
        """`block_bytes`: a saved block's file size, as admitted into the directories' index before it is
        written (default: the layout's payload); `saves=False` (a disaggregated consumer): nothing sent down;
        `promote_into`: the directory the worker copies blocks it loaded from below into (its top tier, when
        that is a directory: the manager promotes what a read found below), admitted here too."""
        self.space = space
        self.world_size = world_size
        self.block_tokens = space.layout.block_tokens
        self.manager = manager
        self.saves = saves
        self._block_bytes = block_bytes or space.layout.block_bytes
        # the directories this side owns (the workers' are `DiskStore`s): evictions shipped, not done here
        self._directories = {tier.name: tier for tier in manager.tiers
                             if isinstance(tier, DiskTier) and tier.owns_index}
        for tier in self._directories.values():
            tier.hand_deletes_off()
        # tensor parallel: which rank's shard each file is (a file key does not say), per directory, for the
        # files it indexes or was told of (saves, promotions, pins): each rank deletes its own files, behind its
        # own writes (`deletes_for_rank`); forgotten as shipped. One not known (the start-up scan's): rank 0's
        self._file_ranks: dict[str, dict[bytes, int]] = {name: {} for name in self._directories}
        self._pins: dict[str, list[tuple[DiskTier, list[bytes]]]] = {}  # req_id -> the files it pinned
        self._unallocated: set[str] = set()  # pinned by a lookup, not allocated (yet)
        self._asked: set[str] = set()  # looked up this step (the others' unallocated pins go at its end)
        self._promote_into = self._directories.get(promote_into) if promote_into else None
        self._trackers: dict[str, RequestTracker] = {}
        self._plans: dict[str, LoadPlan] = {}
        self._requests: dict[str, object] = {}   # req_id -> vLLM Request (read only)
        self._records = StepRecords()
        # KV events (`events.py`): called with (request, first block index, keys, tiers) for the blocks a
        # step sends down (tiers None) and those a load takes from the tiers (where the lookup found them)
        self.on_blocks: Callable[[object, int, list[bytes], list[str] | None], None] | None = None

    def _tracker(self, request) -> RequestTracker:
        tracker = self._trackers.get(request.request_id)
        if tracker is None:
            lora = getattr(request, "lora_request", None)
            space = self.space.with_namespace(request_namespace(request.cache_salt, lora and lora.lora_name))
            tracker = self._trackers[request.request_id] = RequestTracker(space)
        return tracker

    def num_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` (block aligned) that the tiers hold, from the next block on.
        The last token is never offered: vLLM computes it to sample the next one."""
        tokens = request.all_token_ids
        num_blocks = (len(tokens) - 1) // self.block_tokens
        first = num_computed_tokens // self.block_tokens
        req_id = request.request_id
        tracker = self._tracker(request)
        if first > tracker.num_saved_blocks and not tracker.device_prefix_checked:
            self._skip_held_device_prefix(tracker, tracker.keys_for(tokens, first))
        keys = tracker.keys_for(tokens, num_blocks)[first:] if num_blocks > first else []
        self._asked.add(req_id)
        if self._same_lookup(req_id, first, keys):  # waiting for device blocks: its pins still hold the run
            return len(self._plans[req_id].keys) * self.block_tokens
        self._plans.pop(req_id, None)
        self._release(req_id)  # a later lookup replaces the earlier one's pins
        if not keys:
            return 0
        try:
            tiers = self._match(keys) if self._match(keys[:1]) else []  # a miss: one block asked, not all
        except Exception:  # noqa: BLE001 - a lookup error is a miss, never a failed request
            log.exception("kvtier: lookup failed; computing the prompt")
            return 0
        tiers = tiers[:self._pin(req_id, keys[:len(tiers)], tiers)]  # offered: only what stays until the alloc
        if tiers:
            self._plans[req_id] = LoadPlan(first, keys[:len(tiers)], tiers)
            self._unallocated.add(req_id)
        else:
            self._unpin(req_id)
        return len(tiers) * self.block_tokens

    def _same_lookup(self, req_id: str, first: int, keys: list[bytes]) -> bool:
        """vLLM asks again, step after step, for a request still waiting for device blocks: the last lookup's
        run stands while its pins hold (no process evicts a pinned block: a run all in this side's directories)
        and the block after it is still not held (one saved since, by another request with the same prefix,
        makes a fresh lookup): one `contains` of one block a step instead of the whole prompt's lookup and pins
        (`_pin`). A pinned block deleted as corrupt meanwhile fails its load, which is then recomputed."""
        plan = self._plans.get(req_id)
        if plan is None or req_id not in self._unallocated or plan.first_block != first:
            return False
        if any(tier not in self._directories for tier in plan.tiers):
            return False  # a pool's blocks are not pinned: asked again in full
        if keys[:len(plan.keys)] != plan.keys:
            return False
        after = keys[len(plan.keys):len(plan.keys) + 1]
        try:
            return not (after and self._match(after))
        except Exception:  # noqa: BLE001 - asked again in full
            return False

    def _skip_held_device_prefix(self, tracker: RequestTracker, keys: list[bytes]) -> None:
        """A new request's first blocks are vLLM's device hits (`keys`): those the tiers hold already (a
        run from the first) are not copied out and written again — each step a save costs the forward
        its copy — only refreshed with the chain (`SaveSpec.held_keys`). Asked once per request."""
        tracker.device_prefix_checked = True
        try:
            held = len(self._match(keys))
        except Exception:  # noqa: BLE001 - bookkeeping: the blocks are then saved again, as before
            log.exception("kvtier: looking up a device-cached prefix failed")
            return
        tracker.num_saved_blocks = max(tracker.num_saved_blocks, held)

    def _match(self, keys: list[bytes]) -> list[str]:
        """The tiers of the longest run of blocks every rank holds (rank 0's tier for each)."""
        tiers = self.manager.match(shard_keys(keys, 0, self.world_size)).tiers
        for rank in range(1, self.world_size):
            if not tiers:
                break
            held = self.manager.match(shard_keys(keys[:len(tiers)], rank, self.world_size)).tiers
            tiers = tiers[:len(held)]
        return tiers

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks are allocated: queue the load into them; nothing before them is to be saved again."""
        tracker = self._tracker(request)
        self._requests[request.request_id] = request
        plan = self._plans.pop(request.request_id, None)
        if plan is None or num_external_tokens <= 0:
            self._release(request.request_id)  # a lookup's pins nothing will load
            return
        num_blocks = num_external_tokens // self.block_tokens
        assert num_blocks <= len(plan.keys), (num_blocks, len(plan.keys))
        self._unallocated.discard(request.request_id)
        self._trim_pins(request.request_id, plan.keys[:num_blocks])
        plan.keys, plan.tiers = plan.keys[:num_blocks], plan.tiers[:num_blocks]
        ids = block_ids[plan.first_block:plan.first_block + num_blocks]
        self._records.loads.append(LoadSpec(request.request_id, plan.keys, ids, list(plan.tiers)))
        if self.on_blocks is not None:
            self.on_blocks(request, plan.first_block, plan.keys, plan.tiers)
        tracker.load, tracker.load_block_ids = plan, ids
        tracker.num_saved_blocks = max(tracker.num_saved_blocks, plan.first_block + num_blocks)
        self._admit_promotions(plan.keys, plan.tiers)

    def _rank_keys(self, keys: list[bytes]) -> list[bytes]:
        """The files of `keys`: every rank's shard of each block, block by block (a chain, as the directories
        refresh it: a block's shards go together)."""
        shards = [shard_keys(keys, rank, self.world_size) for rank in range(self.world_size)]
        return [shard[i] for i in range(len(keys)) for shard in shards]

    def _pin(self, req_id: str, keys: list[bytes], tiers: list[str]) -> int:
        """Keep the blocks a lookup found in the directories from eviction (ours and any other process's)
        until a load of them is done or the lookup is dropped: how many of `keys`, from the first, are held
        (a block that went since the lookup ends the run; blocks in other tiers count as held)."""
        self._unpin(req_id)
        pins, lost = [], len(keys)
        for name, tier in self._directories.items():
            blocks = [i for i, where in enumerate(tiers) if where == name]
            files = self._rank_keys([keys[i] for i in blocks])
            try:
                held = tier.pin_many(files) if files else []
            except Exception:  # noqa: BLE001 - a pin that fails is a miss, never a failed step
                log.exception("kvtier: pinning a load in %s failed", name)
                held = [False] * len(files)
            pins.append((tier, [key for key, h in zip(files, held) if h]))
            self._note_ranks(name, files, held)
            ws = self.world_size
            lost = min([lost] + [i for n, i in enumerate(blocks) if not all(held[n * ws:(n + 1) * ws])])
        self._pins[req_id] = pins
        if lost < len(keys):
            self._trim_pins(req_id, keys[:lost])
        return lost

    def _trim_pins(self, req_id: str, keys: list[bytes]) -> None:
        """Keep only the pins of `keys` (a load of fewer blocks than its lookup offered)."""
        files = set(self._rank_keys(keys))
        kept = []
        for tier, pinned in self._pins.get(req_id, []):
            tier.unpin([key for key in pinned if key not in files])
            kept.append((tier, [key for key in pinned if key in files]))
        if req_id in self._pins:
            self._pins[req_id] = kept

    def _admit_promotions(self, keys: list[bytes], tiers: list[str]) -> None:
        """The worker will copy the blocks it loads from below its top directory into it: index them
        there now (what that evicts ships with the step's records, as a save's evictions do)."""
        top = self._promote_into
        below = [key for key, where in zip(keys, tiers) if where != top.name] if top is not None else []
        if below:
            try:
                files = self._rank_keys(below)  # promoted all the same: one not admitted is deleted a step later
                self._note_ranks(top.name, files)
                top.hand_off_next([key for key, ok in zip(files, top.admit(files, self._block_bytes)) if not ok])
            except Exception:  # noqa: BLE001 - bookkeeping: the copies are then outside the index
                log.exception("kvtier: admitting %d promoted blocks into %s failed", len(below), top.name)

    def _note_ranks(self, name: str, files: list[bytes], flags: list[bool] | None = None) -> None:
        """`files` (`_rank_keys`: file j is rank j % world_size's shard) are in directory `name`'s index or
        will be deleted there (those `flags` says): remember whose shard each is."""
        ws = self.world_size
        if ws > 1:
            ranks = self._file_ranks[name]
            for j, file in enumerate(files):
                if flags is None or flags[j]:
                    ranks[file] = j % ws

    def _unpin(self, req_id: str) -> None:
        for tier, files in self._pins.pop(req_id, []):
            tier.unpin(files)

    def _release(self, req_id: str) -> None:
        """Drop the pins of a lookup not followed by an allocation (a load's stay until `loaded_from`)."""
        if req_id in self._unallocated:
            self._unallocated.discard(req_id)
            self._unpin(req_id)

    def _admit(self, saves: list[SaveSpec], chains: list[list[bytes]]
               ) -> tuple[list[SaveSpec], dict[str, list[bytes]], dict[str, list[int]]]:
        """Index the blocks sent down this step in each directory, then refresh the `chains` (each saving
        request's blocks so far, root first) tail first: the saves of the blocks some directory
        took (one no index has room for — all of it pinned — is not written: a future miss), and the files
        that evicted (and lookups' adoptions) for the workers to delete. A block one directory could not
        keep but another did is written to both (the worker writes through to every tier): outside the
        first one's index, which ships its delete with the next step, after the worker queued the write
        (`DiskTier.hand_off_next`) — a step that sends more blocks than a directory holds. With several ranks,
        whose shard each file to delete is (`deletes_for_rank`)."""
        keys = [key for spec in saves for key in spec.keys] if self.saves and self._directories else []
        files = self._rank_keys(keys)  # files[i * world_size + rank] is rank's shard of keys[i]
        ws = self.world_size
        chain_files = [self._rank_keys(chain) for chain in chains] if files else []  # the same in every directory
        taken_by = [0] * len(keys)  # per block: in how many directories every rank's file was admitted
        admitted_in = {}
        for name, tier in self._directories.items():
            try:
                admitted_in[name] = tier.admit(files, self._block_bytes) if files else []
            except Exception:  # noqa: BLE001 - bookkeeping: the blocks are then just not indexed
                log.exception("kvtier: admitting %d blocks into %s failed", len(files), name)
                admitted_in[name] = [False] * len(files)
            admitted = admitted_in[name]
            every_rank = [all(admitted[i * ws:(i + 1) * ws]) for i in range(len(keys))] if admitted else []
            taken_by = [n + ok for n, ok in zip(taken_by, every_rank)]
        kept = [n > 0 for n in taken_by]
        deletes, delete_ranks = {}, {}
        for name, tier in self._directories.items():
            self._note_ranks(name, files, [ok or kept[j // ws] for j, ok in enumerate(admitted_in[name])])
            try:  # written all the same where another directory took them: deleted a step later
                tier.hand_off_next([file for j, (file, ok) in enumerate(zip(files, admitted_in[name]))
                                    if not ok and kept[j // ws]])
                for chain in chain_files:
                    tier.touch_many(chain)
                evicted = tier.take_deletes()
            except Exception:  # noqa: BLE001 - bookkeeping: a file left behind is space, never a wrong block
                log.exception("kvtier: refreshing %d chains in %s failed", len(chain_files), name)
                evicted = []
            if evicted:
                deletes[name] = evicted
                if ws > 1:
                    ranks = self._file_ranks[name]
                    delete_ranks[name] = [ranks.pop(file, 0) for file in evicted]
        if all(kept):
            return saves, deletes, delete_ranks
        flags = iter(kept)
        kept_saves = [_keep(spec, [next(flags) for _ in spec.keys]) for spec in saves]
        return [spec for spec in kept_saves if spec.keys], deletes, delete_ranks

    def hit_tokens_by_tier(self, request_id: str) -> dict[str, int]:
        tracker = self._trackers.get(request_id)
        return tracker.loaded_tokens_by_tier() if tracker else {}

    def build_records(self, num_scheduled_tokens: dict[str, int], block_ids_of) -> StepRecords:
        """This step's loads, and the blocks that are full and computed once it ran (prompt and output)."""
        for req_id in self._unallocated - self._asked:  # no longer asked for (scheduled otherwise, preempted)
            self._release(req_id)
        self._asked.clear()
        chains = []  # the saving requests' blocks so far, refreshed once admitted
        for req_id, num_new in num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            tracker = self._trackers[req_id]
            tokens = request.all_token_ids  # output tokens still in flight (async scheduling) are not here yet
            num_full = min(request.num_computed_tokens + num_new, len(tokens)) // self.block_tokens
            if num_full <= tracker.num_saved_blocks:
                continue
            chains.append(tracker.keys_for(tokens, num_full))
            keys = chains[-1][tracker.num_saved_blocks:]
            ids = block_ids_of(req_id)[tracker.num_saved_blocks:num_full]
            # held_keys: the chain this save extends, refreshed with it in the worker's DRAM
            self._records.saves.append(SaveSpec(req_id, keys, ids, chains[-1][:tracker.num_saved_blocks]))
            if self.on_blocks is not None:
                self.on_blocks(request, tracker.num_saved_blocks, keys, None)
            tracker.num_saved_blocks = num_full
        self._records.saves, self._records.deletes, self._records.delete_ranks = self._admit(self._records.saves,
                                                                                              chains)
        records, self._records = self._records, StepRecords()
        return records

    def load_errors(self, invalid_block_ids: set[int]) -> None:
        """The worker could not load these blocks: vLLM recomputes them, and they are saved again."""
        for tracker in self._trackers.values():
            tracker.drop_failed_loads(invalid_block_ids)

    def loaded_from(self, tiers_by_request: dict[str, list[str]]) -> None:
        """Where the worker really read each loaded block (its DRAM, which the lookup does not see)."""
        for req_id, tiers in tiers_by_request.items():
            self._unpin(req_id)  # the load is over: its blocks may be evicted again
            tracker = self._trackers.get(req_id)
            if tracker is not None and tracker.load is not None:
                tracker.load.tiers = tiers[:len(tracker.load.tiers)]

    def finished(self, request_id: str) -> None:
        self._unallocated.discard(request_id)
        self._unpin(request_id)
        self._trackers.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._plans.pop(request_id, None)


def deletes_for_rank(deletes: dict[str, list[bytes]], delete_ranks: dict[str, list[int]],
                     rank: int) -> dict[str, list[bytes]]:
    """The files of a step's `deletes` (tier name -> files) that are rank `rank`'s shards (`delete_ranks`: the
    rank of each; none for a tier: one worker, all of them): each rank deletes its own, on its own writes lane,
    behind its own writes of them."""
    out = {}
    for name, files in deletes.items():
        ranks = delete_ranks.get(name)
        own = files if ranks is None else [file for file, r in zip(files, ranks) if r == rank]
        if own:
            out[name] = own
    return out


def _keep(spec: SaveSpec, flags: list[bool]) -> SaveSpec:
    """`spec` with only the blocks `flags` keeps (the chain it extends, `held_keys`, kept as it is)."""
    return replace(spec, keys=[k for k, f in zip(spec.keys, flags) if f],
                   block_ids=[b for b, f in zip(spec.block_ids, flags) if f])
