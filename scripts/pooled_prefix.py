"""What `pool_restore_parts.py` and `pool_read_into_check.py` share: SmolLM2's 4k-token prefix (16 blocks of 256
tokens) stored in a local Mooncake pool started on 127.0.0.1 (as `kvtier bench prefix` does), stopped afterwards."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier import models
from kvtier.bench.prefix import _prefix_keys
from kvtier.blocks import DEFAULT_BLOCK_TOKENS, KVLayout
from kvtier.codecs import Codec, get_codec
from kvtier.data import SHAKESPEARE, shared_data_file
from kvtier.hf import TieredCache
from kvtier.testing import services
from kvtier.tiers.manager import TierManager, build_manager


@dataclass(slots=True)
class PooledPrefix:
    loaded: object
    ids: torch.Tensor          # [1, 4097]: the prompt; its 16 full blocks before the last token are in the pool
    layout: KVLayout
    codec: Codec               # raw
    manager: TierManager       # the pool alone
    keys: list[bytes]          # the 16 blocks' keys
    names: list[str]           # ... as the pool names them

    @property
    def backend(self):
        return self.manager.tiers[0].backend


@contextmanager
def pooled_prefix() -> Iterator[PooledPrefix]:
    loaded = models.load("smollm2")
    ids = loaded.tokenizer(shared_data_file(SHAKESPEARE).read_text()[:4096 * 8], return_tensors="pt").input_ids[:, :4097]
    layout, codec = loaded.kv_layout(DEFAULT_BLOCK_TOKENS), get_codec("raw")
    with tempfile.TemporaryDirectory() as tmp:
        pool = services.MooncakePool(Path(tmp), segment="2GB", buffer="512MiB")
        pool.start()
        try:
            manager = build_manager([pool.spec], slot_bytes=codec.max_encoded_bytes(layout), async_writes=False)
            cache = TieredCache.for_model(loaded, manager, block_tokens=DEFAULT_BLOCK_TOKENS)
            with torch.inference_mode():
                loaded.model(ids, past_key_values=cache, use_cache=True)
            cache.store(ids[0])
            manager.flush()
            keys = _prefix_keys(loaded, ids, DEFAULT_BLOCK_TOKENS)
            yield PooledPrefix(loaded, ids, layout, codec, manager, keys, manager.tiers[0]._names(keys))
            manager.close()
        finally:
            pool.kill()
