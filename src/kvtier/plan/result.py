"""What `kvtier plan` answers, as records: the sizing's `PlanResult` and, when the KV does not fit, its
`OffloadPlan` (one `OffloadMode` each for exact and sparse). Below both `sizing.py` and `offload.py`, which fill
them in: the records import neither."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class OffloadMode:
    """One mode's costs. Bytes per GPU (one TP rank, all requests of the replica); tokens/s per request."""

    name: str
    fetched_tokens_per_request: int   # per layer and KV head, per decode step
    fetch_unit_tokens: int            # ... in units of this many tokens (exact: blocks; sparse: pages)
    link_bytes_per_step: float        # what crosses the link at each decode step
    summary_bytes_per_gpu: float      # key min/max/mean per page kept on the device (sparse only)
    fetch_area_bytes_per_gpu: float
    device_bytes_per_gpu: float       # weights + window KV + fetch area + summaries + activations + overhead
    fits_device: bool
    hbm_bytes_per_step: float         # weights, window KV, summaries; fetched KV twice (written, then read)
    hbm_tokens_per_s: float           # per request, HBM bound alone
    tokens_per_s_by_link: dict = field(default_factory=dict)  # link -> per request, min(link, HBM) bound


@dataclass(slots=True)
class OffloadPlan:
    block_tokens: int
    page_tokens: int                       # sparse's unit
    window_blocks: int
    device_tokens_per_request: int
    off_device_tokens_per_request: int     # whole blocks
    off_device_blocks_per_request: int
    sparse_fraction: float
    host_bytes_per_request: float          # all TP ranks
    host_bytes_total: float                # all requests, all TP ranks
    window_bytes_per_gpu: float            # the windows' KV, all requests of the replica, one rank
    host_kv_capacity_bytes: float          # HOST_KV_FRACTION of the replica's nodes' DRAM
    fits_host: bool
    exact: OffloadMode
    sparse: OffloadMode
    link_bytes_s: dict                     # link -> bytes/s per GPU
    all_on_device_gpus: int                # the existing sizing's cluster
    gpus_to_buy: int                       # beyond this replica's tp GPUs
    all_on_device_tokens_per_s: float      # per request, HBM bound, requests spread over those GPUs
    notes: list



@dataclass(slots=True)
class PlanResult:
    model: str
    gpu: str
    context: int
    concurrency: int
    kv_dtype: str
    weight_dtype: str
    tp: int
    gpu_mem_bytes: int
    usable_bytes: float
    kv_bytes_per_token: float      # one GPU rank; with sliding layers, the average at `context`
    kv_bytes_per_request: float    # all TP ranks (replicated heads / MLA latents counted on each)
    kv_bytes_total: float          # all sequences, all TP ranks
    kv_bytes_per_gpu: float
    weights_bytes: float           # all parameters
    weights_bytes_per_gpu: float
    activations_bytes: float
    overhead_bytes: float
    needed_bytes_per_gpu: float
    fits: bool
    max_concurrency: int
    max_context: int
    spill_bytes: float             # KV that does not fit in the replica's HBM
    kv_capacity_bytes_per_gpu: float
    restore_bandwidth_bytes_s: float  # to bring one request's prefix back within ttft_target_s
    ttft_target_s: float
    restore_s_by_tier: dict
    tier_plan: dict
    decode_tokens_per_s: float     # memory-bandwidth bound, all sequences of the replica together
    cluster_tp: int                # tp of the cluster's replicas: tp, or the smallest above it that holds a request
    replicas: int                  # 0 only when no TP size holds one request's KV (then gpus and nodes are 0 too)
    gpus: int
    nodes: int
    facility_watts: tuple
    notes: list
    estimates: dict                # how activations, overhead and the decode bound are estimated
    tp_chosen: bool = False        # tp was not given: the smallest that holds the weights and one request's KV
    offload: OffloadPlan | None = None  # when the KV does not fit: serving it with cold blocks off the device

    def to_dict(self) -> dict:
        return asdict(self)
