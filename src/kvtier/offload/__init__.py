"""Contexts larger than the device: the live KV of a long sequence, its cold blocks in host memory.

A sequence whose prompt + max_tokens is more than the device budget holds (issue 18) keeps only a
*window* of its blocks in the device arena: the first `sink_blocks` (attention sinks, StreamingLLM)
and the last `recent_blocks` (the block being written and the ones just before it). Every full
block between them lives in host memory — a pinned slot of the DRAM tier (`HostBlockPool.pin`:
one host memory, the same slots prefix caching uses; a block written through when it was computed
is pinned where it already is, checked by its key-bound header). Attention over the middle runs
from a fixed *fetch area* on the device (counted in the device budget, two halves):

- `exact`: every host block of the sequence, layer by layer, in pieces of half the fetch area; a
  background thread fetches piece i + 1 (the next layer's, or the next sequence's) while piece i is
  attended to (on CUDA: issues its copies on a side stream, see `FetchArea`). Output is the attention
  over the whole context: the pieces are merged by their log-sum-exp (FlashAttention's merge), the
  device window with its causal mask.
- `sparse` (a budget in pages, or a fraction of the host pages): a host block of T tokens is T / P pages
  of P tokens (`OffloadConfig.page_tokens`; P = T: a page is the block). At each decode step and
  layer, a per-page summary kept on the device (per-channel min, max and mean of the page's keys) scores
  the host pages for each KV head: half Quest's bound of q.k over the page (min/max: no key of it scores
  more), half q . its mean key (`quest_scores`, `BOUND_WEIGHT`), the max over its group's query heads; only
  the top pages of each head are fetched (a head's K and V of a page are P x D contiguous in the slot: one
  copy each). Prefill chunks are always exact. The pick is made on the device
  and the copies are issued by the host, so on CUDA a sparse layer reads its selection back (one sync per
  layer and sequence) and copies on the compute stream: not overlapped.

A request whose prompt is cached starts where that computation would have left it: its sink blocks on
the device, its middle blocks held in DRAM slots. One lookup at admission finds both
(`Scheduler._reuse_offloaded_prefix`); the transfer worker loads the sink blocks into the device and
then holds the middle ones (`HostBlockPool.pin_match`): pinned where the DRAM tier holds them (no copy:
the blocks an earlier request wrote through), read once from a lower tier (SSD, a pool) otherwise,
verified by their payload checksums, stored into DRAM slots (not written back down) and pinned there.
The sequence waits in WAITING_FOR_KV meanwhile; the step thread never reads a tier.

Blocks move host -> device only; a host block never changes (it is full), so nothing moves back.
Summaries (2 x head_dim values per layer, KV head and page) are device memory too, reported
apart from the KV (`OffloadStats.summary_bytes`). On the CPU the fetch thread copies with numpy
memcpys. On CUDA the same thread issues `non_blocking` copies from the pinned DRAM slots on a side stream:
piece i + 1's copy of layer l + 1 runs while the compute stream attends over piece i, ordered by CUDA
events both ways (a half is never written while attention still reads it; attention never reads a half
before its copy landed), with no host sync on the way. That CUDA path was written without a GPU to run
it: `make gpu-check` runs its tests (tests/engine/test_offload.py -k cuda) when one is there.

Modules: `config` (the mode and the window's layout, parsed once: `OffloadConfig`; torch-free), `pages` (page
summaries and selection), `attend` (partial attentions, merged by log-sum-exp), `fetch` (`FetchArea`),
`attention` (`OffloadAttention`: what the engine's attention backend calls; `HostBlocks`, `SeqOffload`),
`in_place` (decodes on the CPU: host blocks read where they sit, one kernel call a layer, no fetch area),
`pool` (`HostBlockPool`: the engine's one owner of the host slots, room and pins of offloaded requests),
`host_kv` (`HostKV`: a `TieredCache` layer's host blocks, its staging and sparse pick), `stats` (`OffloadStats`).
`kvtier.hf_offload` is the transformers glue over the same pieces.
"""
