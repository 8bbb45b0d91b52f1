"""TieredCache: lossless equality with DynamicCache, prefix reuse through the tiers (offload: test_hf_offload.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from kvtier.hf import TieredCache
from kvtier.tiers.manager import build_manager

BLOCK = 16


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, n), generator=g)


def _greedy(loaded, ids, cache, n=12):
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                    max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def _manager(tmp_path, loaded, tiers=("dram",)):
    specs = {"dram": "dram:64MiB", "ssd": f"ssd:{tmp_path / 'ssd'}:64MiB"}
    slot = loaded.kv_layout(BLOCK).block_bytes + 4096
    return build_manager([specs[t] for t in tiers], slot_bytes=slot)


def test_greedy_tokens_equal_dynamic_cache(tiny_model):
    ids = _prompt(70)
    expected = _greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), n=40)
    got = _greedy(tiny_model, ids, TieredCache.for_model(tiny_model, block_tokens=BLOCK), n=40)
    assert got == expected


def test_cache_grows_in_place_and_holds_exact_kv(tiny_model):
    ids = _prompt(300)
    ref, ours = DynamicCache(config=tiny_model.config), TieredCache.for_model(tiny_model, block_tokens=BLOCK)
    with torch.inference_mode():
        tiny_model.model(ids, past_key_values=ref, use_cache=True)
        tiny_model.model(ids, past_key_values=ours, use_cache=True)
    assert ours.get_seq_length() == 300
    for a, b in zip(ref.layers, ours.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_prefix_is_reused_from_dram_and_output_is_identical(tmp_path, tiny_model):
    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(5 * BLOCK + 3)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert first.load_prefix(ids) == 0
    out1 = _greedy(tiny_model, ids, first)
    assert first.store(torch.cat([ids[0], torch.tensor(out1)])) == (5 * BLOCK + 3 + 12 - 1) // BLOCK
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert second.load_prefix(ids) == 5 * BLOCK
    assert second.prefix.hit_tokens_by_tier == {"dram": 5 * BLOCK}
    assert _greedy(tiny_model, ids, second) == out1
    manager.close()


def test_a_reset_cache_serves_the_next_request_in_the_same_buffers(tmp_path, tiny_model):
    """`reset()` (the `StaticCache.reset` idiom of a serving loop): the next request's prefix is
    restored into the pages the last one used, and its greedy tokens still equal DynamicCache's."""
    manager = _manager(tmp_path, tiny_model)
    ids, other = _prompt(5 * BLOCK + 3), _prompt(3 * BLOCK + 5, seed=1)
    cache = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    cache.load_prefix(ids, reserve_tokens=12)
    out = _greedy(tiny_model, ids, cache)
    cache.store(torch.cat([ids[0], torch.tensor(out)]))
    cache.reset()  # the first restore joins the layers' buffers into one allocation (`_join_buffers`) ...
    assert cache.load_prefix(ids, reserve_tokens=12) == 5 * BLOCK
    assert _greedy(tiny_model, ids, cache) == out
    pointers = [layer.buffers()[0].data_ptr() for layer in cache.layers]
    cache.reset()  # ... which every later request reuses
    assert cache.get_seq_length() == 0 and cache.prefix.cached_tokens == 0
    assert cache.load_prefix(ids, reserve_tokens=12) == 5 * BLOCK
    assert [layer.buffers()[0].data_ptr() for layer in cache.layers] == pointers
    assert _greedy(tiny_model, ids, cache) == out
    cache.reset()  # another prompt, nothing cached: computed in the same buffers
    assert cache.load_prefix(other) == 0
    assert _greedy(tiny_model, other, cache) == _greedy(tiny_model, other, DynamicCache(config=tiny_model.config))
    manager.close()


def test_a_restore_writes_each_block_over_all_layers_at_once(tmp_path, tiny_model, monkeypatch):
    """The layers' buffers are views of one allocation, so a restored block is one copy per copy thread
    (not one per layer and K/V), and what lands is the stored KV."""
    from kvtier.transfer.copies import CopyGroup

    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(4 * BLOCK + 3)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    _greedy(tiny_model, ids, first, n=1)
    first.store(ids[0])
    groups = []
    monkeypatch.setattr("kvtier.hf.copy_threads", lambda: 2)
    monkeypatch.setattr("kvtier.hf.CopyGroup", lambda threads: groups.append(CopyGroup(threads)) or groups[-1])
    cache = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert cache.load_prefix(ids) == 4 * BLOCK
    assert groups[0].num_copies == 4 * 2  # 4 blocks, 2 threads
    bases = {layer.buffers()[i]._base.data_ptr() for layer in cache.layers for i in (0, 1)}
    assert len(bases) == 1
    for layer, want in zip(cache.layers, first.layers):
        assert torch.equal(layer.keys, want.keys[..., :4 * BLOCK, :])
        assert torch.equal(layer.values, want.values[..., :4 * BLOCK, :])
    manager.close()


@pytest.mark.parametrize("codec", ["int8", "int4+zstd"])
def test_lossy_codec_prefix_loads_exactly_the_decoded_blocks(tmp_path, tiny_model, codec):
    """A quantized tier codec: what the second request gets is exactly decode(encode(KV)), block by
    block; a raw-codec cache never sees these blocks (the codec is part of the key)."""
    from kvtier.codecs import get_codec

    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(3 * BLOCK + 5)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, codec=codec)
    _greedy(tiny_model, ids, first, n=2)
    key = bytes(16)
    expected = [get_codec(codec).decode(get_codec(codec).encode(first.block_tensor(i), key), key) for i in range(3)]
    assert first.store(ids[0]) == 3
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, codec=codec)
    assert second.load_prefix(ids) == 3 * BLOCK
    for i in range(3):
        assert torch.equal(second.block_tensor(i), expected[i])
    assert len(_greedy(tiny_model, ids, second, n=4)) == 4  # generation runs on the dequantized prefix
    assert TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK).load_prefix(ids) == 0
    manager.close()


def test_prompt_of_exact_blocks_still_computes_last_token(tmp_path, tiny_model):
    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(4 * BLOCK)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    out1 = _greedy(tiny_model, ids, first)
    first.store(ids[0])
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert second.load_prefix(ids) == 3 * BLOCK  # the 4th block holds the last prompt token
    assert _greedy(tiny_model, ids, second) == out1
    manager.close()


def test_namespaces_do_not_share_prefixes(tmp_path, tiny_model):
    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(3 * BLOCK + 1)
    a = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, namespace="tenant-a")
    _greedy(tiny_model, ids, a, n=2)
    a.store(ids[0])
    b = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, namespace="tenant-b")
    assert b.load_prefix(ids) == 0
    a2 = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, namespace="tenant-a")
    assert a2.load_prefix(ids) == 3 * BLOCK
    manager.close()


def test_corrupt_ssd_block_is_recomputed_not_served(tmp_path, tiny_model):
    manager = _manager(tmp_path, tiny_model, tiers=("ssd",))
    ids = _prompt(4 * BLOCK + 1)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    out1 = _greedy(tiny_model, ids, first)
    first.store(ids[0])
    manager.flush()
    files = sorted(p for p in (tmp_path / "ssd").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(files) == 4
    second_key_file = _file_of_block(tmp_path, tiny_model, ids, 2)
    data = bytearray(second_key_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    second_key_file.write_bytes(bytes(data))
    manager.close()
    manager = _manager(tmp_path, tiny_model, tiers=("ssd",))
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert second.load_prefix(ids) == 2 * BLOCK  # blocks 0-1 served, block 2 corrupt -> recompute from there
    assert manager.stats()["ssd"].corrupt == 1
    assert _greedy(tiny_model, ids, second) == out1
    manager.close()


def test_substituted_ssd_blocks_are_refused_and_healed_in_one_run(tmp_path, tiny_model):
    """Valid block files in the wrong place — two swapped, one from another prompt copied over a
    third — are never loaded: the prefix stops before the first, the text equals the uncached
    reply, and one store puts every refused block back (not one per run)."""
    manager = _manager(tmp_path, tiny_model, tiers=("ssd",))
    ids, other = _prompt(5 * BLOCK + 1), _prompt(5 * BLOCK + 1, seed=99)
    reference = _greedy(tiny_model, ids, DynamicCache(config=tiny_model.config))
    for prompt in (ids, other):
        cache = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
        _greedy(tiny_model, prompt, cache, n=1)
        cache.store(prompt[0])
    manager.flush()
    manager.close()
    files = [_file_of_block(tmp_path, tiny_model, ids, i) for i in range(5)]
    b1, b2 = files[1].read_bytes(), files[2].read_bytes()
    files[1].write_bytes(b2), files[2].write_bytes(b1)
    files[4].write_bytes(_file_of_block(tmp_path, tiny_model, other, 4).read_bytes())
    manager = _manager(tmp_path, tiny_model, tiers=("ssd",))
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert second.load_prefix(ids) == BLOCK
    assert manager.stats()["ssd"].corrupt == 3
    assert _greedy(tiny_model, ids, second) == reference
    assert second.store(ids[0]) == 4  # blocks 1-4 (all of the recomputed ones) go down again
    manager.flush()
    third = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert third.load_prefix(ids) == 5 * BLOCK
    assert _greedy(tiny_model, ids, third) == reference
    manager.close()


def _file_of_block(tmp_path, loaded, ids, index):
    from kvtier.blocks import KeySpace, block_keys

    space = KeySpace(loaded.fingerprint, loaded.kv_layout(BLOCK), "raw")
    key_hex = block_keys(space, ids[0].tolist())[index].hex()
    [path] = [p for p in (tmp_path / "ssd").rglob(f"*{key_hex}*") if p.is_file()]
    return path


def _generate_in_two_processes(specs: list[str]) -> tuple[dict, dict]:
    """`run_generate` (what `kvtier generate` runs) twice, as two processes on the same tier specs."""
    script = f"""
import json, sys, torch
from kvtier import models
from kvtier.generate_cli import run_generate
from kvtier.tiers.manager import build_manager
loaded = models.load("tiny", device="cpu")
m = build_manager({specs!r}, slot_bytes=loaded.kv_layout({BLOCK}).block_bytes + 4096)
ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(7))[0].tolist()
r = run_generate(loaded, m, ids, max_new_tokens=8, block_tokens={BLOCK})
m.flush(); m.close()
print(json.dumps({{"text": r.text, "cached": r.cached_tokens, "hits": r.hit_tokens_by_tier}}))
"""
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True) for _ in range(2)]
    first, second = (__import__("json").loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    return first, second


def test_second_process_hits_ssd_and_prints_same_text(tmp_path, tiny_model):
    first, second = _generate_in_two_processes([f"ssd:{tmp_path / 'ssd'}:64MiB"])
    assert first["cached"] == 0
    assert second["cached"] == 5 * BLOCK and second["hits"] == {"ssd": 5 * BLOCK}
    assert second["text"] == first["text"]


@pytest.mark.services
def test_second_process_hits_the_pool_and_prints_same_text(pool_service, tiny_model):
    """The pool is what servers share: process 2's DRAM is empty, its prefix comes from the pool.
    (A fresh random salt in the namespace is not needed: the tiny model's fingerprint plus this
    prompt are unique to this test within the session's pool.)"""
    first, second = _generate_in_two_processes(["dram:64MiB", pool_service.spec])
    pool_name = pool_service.spec.split(":", 1)[0]
    assert first["cached"] == 0
    assert second["cached"] == 5 * BLOCK and second["hits"] == {pool_name: 5 * BLOCK}
    assert second["text"] == first["text"]


@pytest.mark.smollm2
def test_smollm2_tiered_equals_dynamic_cache(smollm2, shakespeare_text):
    ids = smollm2.tokenizer(shakespeare_text[:3000], return_tensors="pt").input_ids[:, :600]
    expected = _greedy(smollm2, ids, DynamicCache(config=smollm2.config), n=16)
    assert _greedy(smollm2, ids, TieredCache.for_model(smollm2, block_tokens=256), n=16) == expected


# -- quantized resident KV ------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_quantized_resident_generates_like_quantized_kv_cache(tiny_model, codec):
    from kvtier.levers.quantized_cache import QuantizedKVCache

    ids = _prompt(150)
    expected = _greedy(tiny_model, ids, QuantizedKVCache(tiny_model.config, codec), n=20)
    cache = TieredCache.for_model(tiny_model, block_tokens=BLOCK, resident_codec=codec)
    assert _greedy(tiny_model, ids, cache, n=20) == expected
    raw_bytes = cache.get_seq_length() * tiny_model.kv_layout(BLOCK).bytes_per_token
    assert cache.resident_bytes < raw_bytes / 2  # 128 of the 169 tokens quantized


def test_quantized_resident_prefix_round_trips_through_the_tiers(tmp_path, tiny_model):
    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(9 * BLOCK + 5)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, resident_codec="int4")
    out1 = _greedy(tiny_model, ids, first)
    stored = first.store(torch.cat([ids[0], torch.tensor(out1)]))
    assert stored == (9 * BLOCK + 5 + 12 - 1) // BLOCK
    manager.flush()
    # a full-precision cache never sees those blocks: their KV is not what it would compute
    assert TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK).load_prefix(ids) == 0
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK, resident_codec="int4")
    assert second.load_prefix(ids) == 9 * BLOCK
    for layer_a, layer_b in zip(first.layers, second.layers):  # what attention saw, bit for bit
        for a, b in zip(layer_a.token_range(0, 9 * BLOCK), layer_b.token_range(0, 9 * BLOCK)):
            assert torch.equal(a, b)
    assert len(_greedy(tiny_model, ids, second)) == 12
    manager.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_restore_copies_on_several_threads_give_the_same_tokens(tmp_path, tiny_model, monkeypatch, threads):
    """A lone restore copies on `copy_threads()` threads (the copies of one block go to the helpers
    while the next block is read); the K/V and the greedy tokens are those of DynamicCache."""
    import kvtier.hf

    monkeypatch.setattr(kvtier.hf, "copy_threads", lambda: threads)
    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(6 * BLOCK + 2)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    first.load_prefix(ids)
    out = _greedy(tiny_model, ids, first)
    first.store(torch.cat([ids[0], torch.tensor(out)]))
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert second.load_prefix(ids) == 6 * BLOCK
    ref = DynamicCache(config=tiny_model.config)
    with torch.inference_mode():
        tiny_model.model(ids[:, :6 * BLOCK], past_key_values=ref, use_cache=True)
    for a, b in zip(ref.layers, second.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert _greedy(tiny_model, ids, second) == out
    manager.close()


def test_a_failed_restore_copy_computes_the_prompt_instead(tmp_path, tiny_model, monkeypatch, caplog):
    """A copy that fails on a helper thread ends the restore with nothing cached (the buffers may be
    half-written): the request computes its prompt and its tokens are still DynamicCache's."""
    import kvtier.hf
    from kvtier.transfer.copies import CopyGroup

    class FailingGroup(CopyGroup):
        def add(self, dst, src):
            super().add(dst, src.reshape(-1) if self.num_copies == 7 else src)

    manager = _manager(tmp_path, tiny_model)
    ids = _prompt(4 * BLOCK + 5)
    first = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    out = _greedy(tiny_model, ids, first)
    first.store(ids[0])
    monkeypatch.setattr(kvtier.hf, "CopyGroup", FailingGroup)
    monkeypatch.setattr(kvtier.hf, "copy_threads", lambda: 2)
    second = TieredCache.for_model(tiny_model, manager, block_tokens=BLOCK)
    assert second.load_prefix(ids) == 0
    assert second.get_seq_length() == 0
    assert "copying 4 restored blocks" in caplog.text
    assert _greedy(tiny_model, ids, second) == out
    manager.close()
