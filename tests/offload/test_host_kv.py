"""`HostKV`: a `TieredCache` layer's host blocks (storage, staging, the sparse pick), apart from the Cache API."""

import torch

from kvtier.offload.host_kv import HostKV
from kvtier.offload.pages import gather_pages, page_summary, pick_pages, select_pages

B, H, T, D, P = 2, 2, 4, 3, 2  # batch, KV heads, block tokens, head dim, page tokens
CPU = torch.device("cpu")


def _tokens(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, num_blocks * T, D, generator=g), torch.randn(B, H, num_blocks * T, D, generator=g))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[B, H, n T, D] -> [B, n, H, T, D]."""
    return x.unflatten(2, (-1, T)).transpose(1, 2)


def test_appends_grow_the_buffers_and_keep_every_block_and_its_summary():
    host = HostKV(T, P, True, CPU, torch.float32)
    k1, v1 = _tokens(1, 0)
    k2, v2 = _tokens(2, 1)
    host.append(k1, v1)
    assert host.capacity == 1
    host.append(k2, v2)  # 1 + 2 > 1: doubled past what is needed
    assert (host.num_blocks, host.capacity) == (3, 3)
    k, v = torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)
    assert torch.equal(host.k[:, :3], _blocks(k)) and torch.equal(host.v[:, :3], _blocks(v))
    assert torch.equal(host.summaries[:3], page_summary(_blocks(k)[0], P))
    assert host.nbytes() == 2 * B * 3 * H * T * D * 4 and host.summary_bytes() == host.summaries[:3].nbytes
    fetched_k, fetched_v = host.fetch(2)
    assert torch.equal(fetched_k, _blocks(k)[:, :2]) and torch.equal(fetched_v, _blocks(v)[:, :2])
    host.stage(CPU)  # staged for 3 blocks: a fetch of 3 takes the staged copy
    assert torch.equal(host.fetch(3)[0], _blocks(k))
    host.clear()
    assert host.num_blocks == 0 and host.nbytes() == 0 and host.capacity == 3  # buffers kept


def test_pick_returns_each_heads_best_pages_in_context_order():
    host = HostKV(T, P, True, CPU, torch.float32)
    k, v = _tokens(3, 2)
    host.append(k, v)
    query = torch.randn(H, 1, D)
    top = select_pages(host.summaries[:3], query, 2)  # [2, H]: page index over the 3 blocks' 6 pages
    got_k, got_v = torch.full((H, 2 * P, D), float("nan")), torch.full((H, 2 * P, D), float("nan"))
    host.pick(query, 2, got_k, got_v)
    pages_k = k[0].unflatten(1, (-1, P))  # [H, pages, P, D]
    pages_v = v[0].unflatten(1, (-1, P))
    for j in range(2):
        for head in range(H):
            assert torch.equal(got_k[head, j * P:(j + 1) * P], pages_k[head, top[j, head]])
            assert torch.equal(got_v[head, j * P:(j + 1) * P], pages_v[head, top[j, head]])


def test_gather_pages_reads_each_heads_pages_from_strided_host_blocks_into_a_strided_destination():
    """The one gather of a pick (`FetchArea`'s on the CPU, `HostKV`'s): K of layer 1 of DRAM-slot-like blocks
    [S, L, 2, H, T, D] (blocks far apart) into the first tokens of a wider buffer [H, tokens, D]."""
    slots = torch.randn(5, 2, 2, H, T, D)
    blocks, pages = torch.tensor([[4, 0], [1, 3], [2, 3]]), torch.tensor([[1, 0], [0, 1], [1, 1]])  # [k, H]
    out = torch.zeros(H, 10, D)
    assert gather_pages(slots[:, 1, 0], blocks, pages, P, out[:, :3 * P]).shape == (H, 3 * P, D)
    for j in range(3):
        for head in range(H):
            first = pages[j, head] * P
            assert torch.equal(out[head, j * P:(j + 1) * P], slots[blocks[j, head], 1, 0, head, first:first + P])
    assert not out[:, 3 * P:].any()  # nothing past the pick


def test_pick_pages_splits_the_selection_into_blocks_and_pages():
    summaries = page_summary(torch.randn(3, H, T, D), P)  # 3 blocks of 2 pages
    query = torch.randn(H, 1, D)
    top = select_pages(summaries, query, 4)
    blocks, pages = pick_pages(summaries, query, 4, T // P)
    assert torch.equal(blocks * (T // P) + pages, top) and blocks.device.type == "cpu"


def test_restored_blocks_count_and_get_their_summaries():
    host = HostKV(T, P, True, CPU, torch.float32)
    host.reserve(4, 1, H, D)
    k, v = _tokens(2, 3)
    for i, (bk, bv) in enumerate(zip(_blocks(k)[0], _blocks(v)[0])):
        host.write(i, bk, bv)
    host.restored(2)
    assert host.num_blocks == 2 and torch.equal(host.block(1)[0], _blocks(k)[0, 1])
    assert torch.equal(host.summaries[:2], page_summary(_blocks(k)[0, :2], P))
