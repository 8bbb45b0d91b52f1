"""The cluster model: nodes, each with an HBM, DRAM and SSD tier, and an optional pool shared by all.

Every tier is a `kvtier.lru.LRUIndex` over block ids sized in tokens (the real tokens a block
holds), the same class and eviction order the real DRAM/SSD tiers use. Policy, per request on node n
(tiers top first: hbm[n], dram[n], pool, ssd[n]):

- lookup: block i hits in the highest tier holding it, and only if blocks 0..i-1 all hit (prefix);
- promotion: a block hit in a lower tier is copied into HBM (it stays where it was, as
  `TierManager.get_prefix` leaves it), new (computed) blocks go into HBM;
- write policy `through` (default, as `TierManager.put_many`): new blocks are also written to every
  lower tier; blocks HBM evicts are demoted to each lower tier that lacks them; a lower tier's own
  evictions are dropped. `back`: only HBM gets new blocks; each tier's evictions go one tier down
  (HBM -> DRAM -> pool -> SSD) and the last tier's are dropped;
- recency: a request's blocks are refreshed tail first (`kvtier.lru.tail_first`, as kvtier's own tiers do),
  so its first block ends most recent and LRU evicts leaves of the prefix tree before their roots (vLLM's
  free-queue order: an evicted root would strand every block after it). `root_first_tiers`: the tiers below
  HBM take them root first instead, as kvtier's vLLM connector admitted and touched a request's blocks
  before its tiers went tail first, so those tiers evicted a prefix's root before its leaves and stranded
  the chain (`kvtier bench route` with a bounded `shm:` tier measured it: 43-44% hits where tail first
  predicts 53-55%, `docs/benchmarks/route.md`); the recorded runs in `tests/sim/data` are modelled so.

Not modelled: blocks pinned by running requests, HBM held by decode, cache updates taking time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.errors import UserError
from kvtier.lru import LRUIndex, tail_first
from kvtier.sim.trace import BLOCK_TOKENS, Request

TIERS = ("hbm", "dram", "pool", "ssd")
WRITE_POLICIES = ("through", "back")
_OPTION = {"hbm": "--hbm-kv-tokens", "dram": "--dram-tokens", "pool": "--pool-tokens", "ssd": "--ssd-tokens"}
# Defaults for moving a restored prefix into HBM. dram and pool are per GPU (each TP rank reads its
# shard over its own PCIe link / NIC), ssd per node. HBM hits cost nothing.
DRAM_BW_BYTES_S = 25e9      # PCIe 5 x16 as pinned-memory copies achieve it (64 GB/s peak)
POOL_BW_BYTES_S = 12.5e9    # one 100 Gb/s RDMA NIC per GPU (Mooncake's testbed); 400G NICs give 50
SSD_BW_BYTES_S = 5e9        # one PCIe 4/5 NVMe, sequential reads (3-7 GB/s)
DRAM_LATENCY_S = 10e-6
POOL_LATENCY_S = 50e-6      # RDMA round trip + metadata lookup in the pool master
SSD_LATENCY_S = 100e-6
MFU = 0.4                   # prefill model-FLOPs utilisation (large-batch prefill reaches 0.4-0.6)


@dataclass(slots=True)
class ClusterConfig:
    """Capacities in tokens: hbm, dram and ssd per node, pool for the whole cluster."""

    num_nodes: int = 1
    gpus_per_node: int = 8
    hbm_tokens: int = 0
    dram_tokens: int = 0
    pool_tokens: int = 0
    ssd_tokens: int = 0
    write_policy: str = "through"
    root_first_tiers: bool = False         # the tiers below HBM refresh a request's blocks root first (kvtier before
                                           # its tiers went tail first; see above)
    block_tokens: int = BLOCK_TOKENS
    kv_bytes_per_token: float = 131072.0   # llama-3.1-8b, bf16, all ranks together
    flops_per_token: float = 16.06e9       # llama-3.1-8b: 2 x 8.03e9 params
    gpu_flops: float = 989e12              # h100 dense bf16
    mfu: float = MFU
    decode_s_per_token: float = 0.0        # a node's time per output token (routers that weigh running requests)
    bw_bytes_s: dict[str, float] = field(default_factory=lambda: {
        "dram": DRAM_BW_BYTES_S, "pool": POOL_BW_BYTES_S, "ssd": SSD_BW_BYTES_S})
    latency_s: dict[str, float] = field(default_factory=lambda: {
        "dram": DRAM_LATENCY_S, "pool": POOL_LATENCY_S, "ssd": SSD_LATENCY_S})
    model: str = "llama-3.1-8b"
    gpu: str = "h100"

    def __post_init__(self) -> None:
        if self.num_nodes <= 0 or self.gpus_per_node <= 0:
            raise UserError("--nodes and --gpus-per-node must be positive")
        for name in TIERS:
            if self.capacity_tokens(name) < 0:
                raise UserError(f"{_OPTION[name]} must be >= 0, got {self.capacity_tokens(name)}")
        if self.block_tokens <= 0:
            raise UserError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.write_policy not in WRITE_POLICIES:
            raise UserError(f"unknown write policy {self.write_policy!r} (use {', '.join(WRITE_POLICIES)})")
        if not 0 < self.mfu <= 1:
            raise UserError(f"--mfu must be in (0, 1], got {self.mfu}")

    def capacity_tokens(self, tier: str) -> int:
        return getattr(self, f"{tier}_tokens")

    @property
    def node_flops(self) -> float:
        """Achievable prefill FLOP/s of one node (all its GPUs serve one TP group)."""
        return self.gpus_per_node * self.gpu_flops * self.mfu

    def transfer_s(self, tier: str, num_tokens: int) -> float:
        """Seconds to bring `num_tokens` of KV from `tier` into HBM (0 for HBM itself)."""
        if tier == "hbm" or num_tokens == 0:
            return 0.0
        bw = self.bw_bytes_s[tier] * (self.gpus_per_node if tier in ("dram", "pool") else 1)
        return self.latency_s[tier] + num_tokens * self.kv_bytes_per_token / bw

    def compute_s(self, num_tokens: int) -> float:
        return num_tokens * self.flops_per_token / self.node_flops


@dataclass(slots=True)
class Access:
    """What one request found: hit tokens per tier (in TIERS order) and the tokens computed."""

    hit_tokens: list[int]
    miss_tokens: int


class Cluster:
    """The tiers of every node as LRUIndex objects; `access` applies one request to one node."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        c = config
        pool = LRUIndex(c.pool_tokens)
        self.nodes: list[list[LRUIndex]] = [
            [LRUIndex(c.hbm_tokens), LRUIndex(c.dram_tokens), pool, LRUIndex(c.ssd_tokens)]
            for _ in range(c.num_nodes)]
        # tier indices that can hold anything: empty tiers cost nothing per lookup
        self._live = [t for t, name in enumerate(TIERS) if c.capacity_tokens(name) > 0]
        self._write_through = c.write_policy == "through"
        self.written_tokens = [0] * len(TIERS)   # tokens stored into each tier (all nodes)

    def prefix_tiers(self, node: int, hash_ids: list[int]) -> list[int]:
        """Tier index holding each block of the longest cached prefix of `hash_ids` on `node`."""
        stack = self.nodes[node]
        live = self._live
        out: list[int] = []
        for key in hash_ids:
            for t in live:
                if key in stack[t]:
                    out.append(t)
                    break
            else:
                break
        return out

    def num_prefix_blocks(self, node: int, hash_ids: list[int]) -> int:
        return len(self.prefix_tiers(node, hash_ids))

    def access(self, node: int, request: Request) -> Access:
        """Look `request` up on `node`, then promote its hits and store its new blocks."""
        tiers = self.prefix_tiers(node, request.hash_ids)
        hit_tokens = [0] * len(TIERS)
        for i, t in enumerate(tiers):
            hit_tokens[t] += request.block_tokens(i, self.config.block_tokens)
        self._update(node, request, tiers)
        return Access(hit_tokens, request.input_length - sum(hit_tokens))

    def _update(self, node: int, request: Request, tiers: list[int]) -> None:
        stack = self.nodes[node]
        num_hits = len(tiers)
        if self.config.root_first_tiers:  # the tiers below first, in prompt order; then HBM, tail first
            for i in range(len(request.hash_ids)):
                if i >= num_hits:
                    self._write_lower(stack, request, i)
                elif tiers[i] > 0:
                    stack[tiers[i]].touch(request.hash_ids[i])
            for i in tail_first(range(len(request.hash_ids))):
                self._store(stack, 0, request.hash_ids[i], request.block_tokens(i, self.config.block_tokens))
            return
        for i in tail_first(range(len(request.hash_ids))):  # see the module docstring
            key = request.hash_ids[i]
            if i < num_hits and tiers[i] > 0:
                stack[tiers[i]].touch(key)  # may be gone already: an earlier store's demotions evicted it
            self._store(stack, 0, key, request.block_tokens(i, self.config.block_tokens))
            if i >= num_hits:
                self._write_lower(stack, request, i)

    def _write_lower(self, stack: list[LRUIndex], request: Request, i: int) -> None:
        """A computed block i into each tier below HBM that lacks it (write-through)."""
        if self._write_through:
            key, size = request.hash_ids[i], request.block_tokens(i, self.config.block_tokens)
            for t in self._live:
                if t > 0 and key not in stack[t]:
                    self._store(stack, t, key, size)

    def _store(self, stack: list[LRUIndex], t: int, key: int, size: int) -> None:
        index = stack[t]
        if index.capacity == 0:
            evicted = [(key, size)]   # a tier that holds nothing passes the block straight down
        else:
            if key not in index:
                self.written_tokens[t] += size
            evicted = index.insert(key, size)
            if evicted is None:       # larger than the whole tier
                evicted = [(key, size)]
        if evicted:
            self._demote(stack, t, evicted)

    def _demote(self, stack: list[LRUIndex], t: int, evicted: list[tuple[int, int]]) -> None:
        if self._write_through:
            if t != 0:
                return                # lower tiers' evictions are dropped
            targets = [u for u in self._live if u > 0]
        else:
            targets = [u for u in self._live if u > t][:1]
        for u in targets:
            for key, size in evicted:
                if key not in stack[u]:
                    self._store(stack, u, key, size)


@dataclass(slots=True)
class NodeSpec:
    """What `kvtier plan` says about one node: its HBM KV capacity and the model's per-token costs."""

    hbm_tokens: int
    kv_bytes_per_token: float   # all TP ranks together: the bytes a restored token moves
    flops_per_token: float
    gpu_flops: float


def node_spec(model: str, gpu: str, gpus_per_node: int, kv_dtype: str = "bf16",
              gpu_mem_util: float = 0.9) -> NodeSpec:
    """HBM left for KV on a node whose GPUs serve `model` as one TP group (plan's budget per GPU)."""
    from kvtier.plan import gpu_spec, model_spec, plan

    m, g = model_spec(model), gpu_spec(gpu)
    result = plan(m, g, context=4096, concurrency=1, kv_dtype=kv_dtype, tp=gpus_per_node,
                  gpu_mem_util=gpu_mem_util)
    per_rank = m.kv_bytes_per_token(kv_dtype, gpus_per_node)
    hbm_tokens = int(result.kv_capacity_bytes_per_gpu // per_rank) if per_rank else 0
    return NodeSpec(hbm_tokens, m.kv_bytes_per_token(kv_dtype, 1), m.flops_per_token, g.bf16_flops)
