"""Mooncake-format request traces: one JSON object per line.

    {"timestamp": 0, "input_length": 1300, "output_length": 12, "hash_ids": [0, 1, 2]}

`timestamp` is the arrival time in ms, `hash_ids` the ids of the prompt's prefix blocks of
`BLOCK_TOKENS` tokens each; the last block may be partial and holds
`input_length - BLOCK_TOKENS * (len(hash_ids) - 1)` real tokens. Two requests sharing a block id
share that block's tokens and every token before it (the ids are chained hashes), so an id also
fixes the block's length: a tier keeps the size a block was stored with.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import xxhash

from kvtier.errors import UserError

BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(slots=True)
class Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]

    def block_tokens(self, i: int, block_tokens: int = BLOCK_TOKENS) -> int:
        """Real tokens in block `i` (only the last block may be partial)."""
        if i < len(self.hash_ids) - 1:
            return block_tokens
        return self.input_length - block_tokens * (len(self.hash_ids) - 1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(obj: object, block_tokens: int = BLOCK_TOKENS) -> Request:
    """One decoded line -> Request; ValueError with the problem (no line number) if malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [name for name in _FIELDS if name not in obj]
    if missing:
        raise ValueError(f"missing field {', '.join(repr(m) for m in missing)}")
    ts, n_in, n_out, ids = (obj[name] for name in _FIELDS)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise ValueError(f"'timestamp' must be a number >= 0, got {ts!r}")
    for name, value in (("input_length", n_in), ("output_length", n_out)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name!r} must be an integer >= 0, got {value!r}")
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise ValueError("'hash_ids' must be a list of integers")
    num_blocks = -(-n_in // block_tokens)
    if len(ids) < num_blocks:
        raise ValueError(f"'hash_ids' too short: {len(ids)} blocks of {block_tokens} tokens cannot hold "
                         f"input_length {n_in} (need {num_blocks})")
    if len(ids) > num_blocks:
        raise ValueError(f"'hash_ids' too long: {len(ids)} blocks for input_length {n_in} (expected {num_blocks})")
    return Request(float(ts), n_in, n_out, ids)


def read_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[Request]:
    """All requests of a JSONL trace, in file order; UserError naming the line of the first bad one."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace file not found: {path}")
    requests: list[Request] = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(parse_request(json.loads(line), block_tokens))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{line_no}: invalid JSON: {exc.msg}") from None
            except ValueError as exc:
                raise UserError(f"{path}:{line_no}: {exc}") from None
    return requests


def trace_hash_ids(token_ids: list[int], namespace: str = "", block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Mooncake-style prefix block ids of a prompt: one per (possibly partial, last) block of
    `block_tokens` tokens, each a 63-bit xxh3 chained over the previous id and the block's tokens, so
    two prompts share an id exactly when they share that block and everything before it."""
    ids: list[int] = []
    parent = xxhash.xxh3_64_intdigest(namespace.encode())
    for start in range(0, len(token_ids), block_tokens):
        block = token_ids[start:start + block_tokens]
        parent = xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(block)}I", parent, *block)) & (2**63 - 1)
        ids.append(parent)
    return ids


class TraceRecorder:
    """Appends requests to a Mooncake-format JSONL trace (thread-safe; the server records live traffic).

    `hash_ids` are any integers identifying prefix blocks of `BLOCK_TOKENS` tokens (e.g. the low 63 bits
    of the chained block keys); the recorder checks them as `read_trace` will.
    """

    def __init__(self, path: str | Path, block_tokens: int = BLOCK_TOKENS) -> None:
        self.path = Path(path)
        self.block_tokens = block_tokens
        self.num_records = 0
        self._lock = threading.Lock()
        self._file: IO[str] = self.path.open("a")

    def record(self, timestamp_ms: float, input_length: int, output_length: int, hash_ids: list[int]) -> None:
        obj = {"timestamp": timestamp_ms, "input_length": input_length, "output_length": output_length,
               "hash_ids": list(hash_ids)}
        try:
            parse_request(obj, self.block_tokens)
        except ValueError as exc:
            raise UserError(f"cannot record request: {exc}") from None
        line = json.dumps(obj, separators=(", ", ": ")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
