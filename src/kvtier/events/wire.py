"""vLLM 0.32's KV cache events on the wire, without vLLM: one place for the encoding `kvtier serve` publishes.

vLLM's `ZmqEventPublisher` sends each batch as a ZMQ multipart (topic, seq as 8 bytes big-endian, payload)
where payload is msgspec's msgpack of a `KVEventBatch` (`vllm/distributed/kv_events.py`): an array-like
struct `[ts, events, data_parallel_rank]`, each event a map tagged `type` (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`) with its fields in declaration order, the ones without a default always present (None
as nil) and the defaulted ones (`extra_keys`, `group_idx`, ...) omitted while at their default. This module
writes the same bytes with `msgpack` (tested against vLLM's own decoder in `.venv-vllm`).

One addition vLLM does not send: `cache_salt` on each block of a salted request. NVIDIA Dynamo's indexer (1.6.1)
reads that field and keys the block under the tenant (a query or selection with the same `cache_salt` matches
it, one without or with another does not); it ignores the salt vLLM puts in `extra_keys`. vLLM's decoder
ignores a field it does not know. Unsalted blocks carry no such field: their bytes stay vLLM's.
"""

from __future__ import annotations

from typing import Any

import msgpack

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"  # vLLM's names; the device is "GPU" on a CPU too

BlockHash = int | bytes  # vLLM's `ExternalBlockHash`: an int (the low 64 bits) by default


def block_hash(key: bytes) -> int:
    """A kvtier key as vLLM's external block hash: its low 64 bits as an unsigned int
    (`maybe_convert_block_hash`, vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`)."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def block_stored(block_hashes: list[BlockHash], parent_block_hash: BlockHash | None, token_ids: list[int],
                 block_size: int, medium: str | None, *, lora_id: int | None = None, lora_name: str | None = None,
                 extra_keys: list[tuple | None] | None = None, cache_salt: str | None = None) -> dict[str, Any]:
    """vLLM's `BlockStored`: `token_ids` of every block in `block_hashes`, in order; `extra_keys` one entry per
    block (the cache_salt on a prompt's first block, as `(salt,)`), or None; `cache_salt`: the blocks' tenant,
    for Dynamo's index (see the module's docstring)."""
    event = {"type": "BlockStored", "block_hashes": list(block_hashes), "parent_block_hash": parent_block_hash,
             "token_ids": list(token_ids), "block_size": block_size, "lora_id": lora_id, "medium": medium,
             "lora_name": lora_name}
    if extra_keys is not None:
        event["extra_keys"] = [list(keys) if keys is not None else None for keys in extra_keys]
    if cache_salt:
        event["cache_salt"] = cache_salt
    return event


def block_removed(block_hashes: list[BlockHash], medium: str | None) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int | None = 0) -> bytes:
    """A `KVEventBatch`'s payload (the publisher always sets the rank: vLLM's sets it to its DP rank)."""
    batch = [float(ts), events] if data_parallel_rank is None else [float(ts), events, data_parallel_rank]
    return msgpack.packb(batch, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """(ts, events as maps, data_parallel_rank) of a payload (ours or vLLM's)."""
    ts, events, *rest = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return ts, events, rest[0] if rest else None
