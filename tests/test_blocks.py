import subprocess
import sys

import numpy as np
import pytest

from kvtier.blocks import KeySpace, KVLayout, block_keys, chain_key

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_tokens=4)
SPACE = KeySpace("model-a", LAYOUT)


def test_layout_bytes_match_formula():
    # 2 (K,V) x 30 layers x 3 kv heads x 64 dims x 4 bytes = 46080 bytes per token
    assert LAYOUT.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert LAYOUT.block_bytes == 46080 * 4
    assert LAYOUT.block_shape == (30, 2, 3, 4, 64)


def test_only_full_blocks_get_keys_and_keys_chain():
    keys = block_keys(SPACE, list(range(10)))
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert keys[0] == chain_key(SPACE.root_key(), [0, 1, 2, 3])
    assert keys[1] == chain_key(keys[0], [4, 5, 6, 7])


def test_same_block_tokens_after_different_prefix_give_different_keys():
    a = block_keys(SPACE, [1, 2, 3, 4, 9, 9, 9, 9])
    b = block_keys(SPACE, [5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]
    assert block_keys(SPACE, [1, 2, 3, 4, 0, 0, 0, 0])[0] == a[0]


@pytest.mark.parametrize("other", [
    KeySpace("model-b", LAYOUT), KeySpace("model-a", LAYOUT, codec="int4"),
    KeySpace("model-a", LAYOUT, namespace="tenant-1"),
    KeySpace("model-a", KVLayout(30, 3, 64, "float16", 4)),
])
def test_model_codec_namespace_and_layout_are_part_of_the_key(other):
    tokens = list(range(8))
    assert set(block_keys(SPACE, tokens)).isdisjoint(block_keys(other, tokens))


def test_keys_are_deterministic_across_processes():
    code = ("from kvtier.blocks import *; s=KeySpace('model-a', KVLayout(30,3,64,'float32',4));"
            "print(block_keys(s, list(range(8)))[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == block_keys(SPACE, np.arange(8))[1].hex()


def test_bad_layout_rejected():
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout(2, 2, 0)


def test_a_key_chain_grows_with_its_tokens_and_never_rehashes(monkeypatch):
    """The vLLM tracker's and TieredCache's keys: extended as tokens arrive, each block hashed once."""
    import kvtier.blocks as blocks

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=4)
    space = KeySpace("fp", layout, "raw")
    tokens = list(range(22))  # 5 full blocks
    expected = block_keys(space, tokens)
    hashed = []
    monkeypatch.setattr(blocks, "chain_key", lambda parent, ids: hashed.append(list(ids)) or chain_key(parent, ids))
    chain = blocks.KeyChain(space)
    assert chain.extend(tokens[:9]) == expected[:2]
    assert chain.extend(tokens, 3) == expected[:3]
    assert chain.extend(tokens) == expected
    assert chain.extend(tokens, 2) == expected[:2]
    assert hashed == [tokens[i:i + 4] for i in range(0, 20, 4)]  # every block once, in order
