"""The HBM budget and what happens to the KV that does not fit.

Per GPU (one tensor-parallel rank):  weights/tp + KV + activations + overhead  <=  HBM x utilisation.

Estimates (stated in every report):
- activations: one chunked-prefill step of `max_batched_tokens` (8192, vLLM's default budget) holds
  about (4 x hidden + 2 x intermediate / tp) bf16 values per token, plus fp32 logits for
  `concurrency` sequences (vocab x 4 bytes each);
- overhead: 1 GiB of CUDA context, cuBLAS/NCCL workspaces and allocator slack per GPU.
"""

from __future__ import annotations

import math

from kvtier.errors import UserError
from kvtier.plan.catalog_gpus import gpu_spec
from kvtier.plan.catalog_links import LINKS
from kvtier.plan.catalog_models import model_spec
from kvtier.plan.offload import OffloadOptions, plan_offload
from kvtier.plan.result import PlanResult
from kvtier.plan.specs import GPUSpec, ModelSpec, kv_dtype_note

ESTIMATES = {
    "activations": "one 8192-token chunked-prefill step (vLLM's max_num_batched_tokens) x "
                   "(4*hidden + 2*intermediate/tp) bf16 values per token, + fp32 logits per sequence",
    "overhead": "1 GiB per GPU: CUDA context, cuBLAS/NCCL workspaces, allocator slack",
    "decode_tokens_per_s": "HBM bandwidth / bytes one decode step reads (active weights + all KV), x concurrency; "
                           "an upper bound (MoE batches touch more than the active experts)",
    "kv_dtype": "quantized KV counts its scales: int8 + 4/head_dim B, int4 + 0.125 B per element",
}
GIB = 2**30
OVERHEAD_BYTES = 1 * GIB
MAX_BATCHED_TOKENS = 8192
GPUS_PER_NODE = 8
# Fabrics a restored prefix can come back over, bytes/s per GPU (the link catalog: catalog_links.py).
PCIE5_X16 = LINKS["pcie5-x16"].bytes_s   # host DRAM -> GPU
RDMA_400G = LINKS["rdma-400g"].bytes_s   # pooled memory (Mooncake over RDMA) -> GPU, one 400 Gb/s NIC per GPU
NVME_SEQ = 7e9            # local NVMe SSD, sequential read
POWER_FACTORS = (2.5, 3.0)  # facility watts per GPU TDP watt (host, network, cooling)
HOST_MEM_BYTES_PER_NODE = 2 * 2**40  # a typical 8-GPU node's DRAM (2 TiB)
HOST_KV_FRACTION = 0.8               # of host DRAM given to KV (the rest: OS, pinned buffers, the server)


def _activations(model: ModelSpec, concurrency: int, tp: int) -> float:
    per_token = (4 * model.hidden_size + 2 * model.intermediate_size / tp) * 2
    return MAX_BATCHED_TOKENS * per_token + concurrency * model.vocab_size * 4


def _max_context(model: ModelSpec, kv_budget: float, concurrency: int, kv_dtype: str, tp: int) -> int:
    """Longest context whose KV for `concurrency` sequences fits `kv_budget` (binary search:
    sliding layers make KV non-linear in context). Capped at 64x the model's max context."""
    if concurrency <= 0 or kv_budget <= 0:
        return 0
    lo, hi = 0, model.max_context * 64
    if model.kv_bytes(hi, kv_dtype, tp) * concurrency <= kv_budget:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.kv_bytes(mid, kv_dtype, tp) * concurrency <= kv_budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check(context: int, concurrency: int, tp: int, gpu_mem_util: float, ttft_target_s: float,
           host_mem_bytes_per_node: float) -> None:
    for name, value in (("context", context), ("concurrency", concurrency), ("tp", tp)):
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    if not 0 < gpu_mem_util <= 1:
        raise UserError(f"--gpu-mem-util must be in (0, 1], got {gpu_mem_util}")
    if not ttft_target_s > 0:
        raise UserError(f"--ttft-target must be positive seconds, got {ttft_target_s}")
    if not host_mem_bytes_per_node > 0:
        raise UserError(f"--host-mem must be positive, got {host_mem_bytes_per_node}")


def tp_sizes(model: ModelSpec) -> list[int]:
    """Tensor-parallel sizes a serving engine accepts: the divisors of the attention heads (vLLM's rule)."""
    return [n for n in range(1, model.num_heads + 1) if model.num_heads % n == 0]


def kv_room_bytes(model: ModelSpec, usable_bytes: float, concurrency: int, weight_dtype: str, tp: int) -> float:
    """HBM per GPU left for KV at `tp` (negative: the weights, activations and overhead alone do not fit)."""
    return usable_bytes - model.weights_bytes(weight_dtype) / tp - _activations(model, concurrency, tp) - OVERHEAD_BYTES


def _smallest_tp(model: ModelSpec, usable_bytes: float, concurrency: int, weight_dtype: str,
                 kv_bytes_of_tp, start: int = 1) -> int | None:
    """The smallest TP size >= `start` whose KV room holds `kv_bytes_of_tp(tp)` (None: none does)."""
    for tp in tp_sizes(model):
        if tp >= start and kv_room_bytes(model, usable_bytes, concurrency, weight_dtype, tp) >= kv_bytes_of_tp(tp):
            return tp
    return None


def weights_tp(model: ModelSpec, usable_bytes: float, concurrency: int, weight_dtype: str) -> int | None:
    """The smallest TP size whose weights, activations and overhead fit one GPU with some room for KV."""
    return _smallest_tp(model, usable_bytes, concurrency, weight_dtype, lambda tp: 1)


def request_tp(model: ModelSpec, usable_bytes: float, context: int, concurrency: int, kv_dtype: str,
               weight_dtype: str, start: int = 1) -> int | None:
    """The smallest TP size >= `start` that holds the weights and one request's KV."""
    return _smallest_tp(model, usable_bytes, concurrency, weight_dtype,
                        lambda tp: model.kv_bytes(context, kv_dtype, tp), start)


def _choose_tp(model: ModelSpec, gpu: GPUSpec, usable: float, context: int, concurrency: int, kv_dtype: str,
               weight_dtype: str, tp: int | None) -> int:
    """`tp` when it holds the weights; when None, the smallest TP that holds the weights and one request's KV
    (or else the weights alone: the KV then spills). A `tp` too small for the weights is a one-line error."""
    least = weights_tp(model, usable, concurrency, weight_dtype)
    if least is None:
        raise UserError(f"{model.name}'s {weight_dtype} weights do not fit {gpu.name} at any tensor-parallel size "
                        f"(up to tp{model.num_heads}): lower --weight-dtype or take a larger --gpu")
    if tp is None:
        return request_tp(model, usable, context, concurrency, kv_dtype, weight_dtype) or least
    if kv_room_bytes(model, usable, concurrency, weight_dtype, tp) <= 0:
        raise UserError(f"{model.name}'s {weight_dtype} weights need tp >= {least} on {gpu.name} "
                        f"(at tp{tp} weights + activations + overhead exceed the usable "
                        f"{usable / GIB:.1f} GiB per GPU); leave --tp out to choose it")
    return tp


def plan(model: ModelSpec | str, gpu: GPUSpec | str, *, context: int, concurrency: int, kv_dtype: str = "bf16",
         weight_dtype: str = "bf16", tp: int | None = None, gpu_mem_util: float = 0.9, ttft_target_s: float = 1.0,
         host_mem_bytes_per_node: float = HOST_MEM_BYTES_PER_NODE,
         offload: OffloadOptions = OffloadOptions()) -> PlanResult:
    """Size `concurrency` requests of `context` tokens for `model` on `gpu` x `tp` (one replica),
    then the tiers for what spills and the cluster that would hold it all in HBM. When the KV does not
    fit, `offload` sizes the other answer: one replica serving it with cold blocks off the device.
    `tp=None` chooses the smallest TP that holds the weights and one request's KV; a `tp` whose GPUs cannot
    hold the weights is a UserError naming the TP that can."""
    if isinstance(model, str):
        model = model_spec(model)
    if isinstance(gpu, str):
        gpu = gpu_spec(gpu)
    _check(context, concurrency, 1 if tp is None else tp, gpu_mem_util, ttft_target_s, host_mem_bytes_per_node)
    notes = [f"KV {kv_dtype_note(kv_dtype)}"]
    usable = gpu.hbm_bytes * gpu_mem_util
    tp_chosen = tp is None
    tp = _choose_tp(model, gpu, usable, context, concurrency, kv_dtype, weight_dtype, tp)
    if context > model.max_context:
        notes.append(f"context {context} exceeds the model's {model.max_context}")
    if tp > model.num_kv_heads and not model.is_mla:
        notes.append(f"tp {tp} > {model.num_kv_heads} KV heads: KV heads are replicated on every rank")
    if model.is_mla:
        notes.append("MLA: the latent KV is replicated on every TP rank")
    kv_req = model.kv_bytes(context, kv_dtype, tp)            # one request, one rank
    kv_gpu = kv_req * concurrency
    weights = model.weights_bytes(weight_dtype)
    weights_gpu = weights / tp
    act = _activations(model, concurrency, tp)
    fixed = weights_gpu + act + OVERHEAD_BYTES
    kv_capacity = max(0.0, usable - fixed)
    needed = fixed + kv_gpu
    max_conc = int(kv_capacity // kv_req) if kv_req else 0
    spill = max(0.0, kv_gpu - kv_capacity) * tp
    cluster_tp, replicas = _cluster(model, usable, context, concurrency, kv_dtype, weight_dtype, tp, max_conc)
    if tp_chosen:
        holds = "the weights and one request's KV" if max_conc else "the weights (none holds one request's KV too)"
        notes.append(f"tp{tp} chosen: the smallest tensor-parallel size (a divisor of the {model.num_heads} "
                     f"attention heads) that holds {holds}; --tp sets it")
    if not replicas:
        notes.append(f"no tensor-parallel size of {gpu.name} holds one request's KV ({context:,} tokens) beside the "
                     f"weights: no cluster holds it all in HBM (offload, or a shorter context)")
    elif cluster_tp != tp:
        notes.append(f"one request's KV does not fit beside the weights at tp{tp}: the cluster that holds it all "
                     f"in HBM is sized at tp{cluster_tp}")
    gpus = replicas * cluster_tp
    kv_total = kv_gpu * tp
    restore_bw = kv_req / ttft_target_s          # per GPU, each rank restores its shard in parallel
    # one decode step reads the active weights and every sequence's KV once
    step_bytes = weights_gpu * (model.params_active / model.params_total) + kv_gpu
    result = PlanResult(
        model=model.name, gpu=gpu.name, context=context, concurrency=concurrency, kv_dtype=kv_dtype,
        weight_dtype=weight_dtype, tp=tp, gpu_mem_bytes=gpu.hbm_bytes, usable_bytes=usable,
        kv_bytes_per_token=kv_req / context, kv_bytes_per_request=kv_req * tp, kv_bytes_total=kv_total,
        kv_bytes_per_gpu=kv_gpu, weights_bytes=weights, weights_bytes_per_gpu=weights_gpu,
        activations_bytes=act, overhead_bytes=OVERHEAD_BYTES, needed_bytes_per_gpu=needed,
        fits=needed <= usable, max_concurrency=max_conc,
        max_context=_max_context(model, kv_capacity, concurrency, kv_dtype, tp), spill_bytes=spill,
        kv_capacity_bytes_per_gpu=kv_capacity, restore_bandwidth_bytes_s=restore_bw, ttft_target_s=ttft_target_s,
        restore_s_by_tier={"dram (PCIe5 x16)": kv_req / PCIE5_X16, "pool (RDMA 400G)": kv_req / RDMA_400G,
                           "ssd (NVMe)": kv_req / NVME_SEQ},
        tier_plan=_tier_plan(spill, tp, host_mem_bytes_per_node, restore_bw),
        decode_tokens_per_s=concurrency * gpu.hbm_bandwidth_bytes_s / step_bytes,
        cluster_tp=cluster_tp, replicas=replicas, gpus=gpus, nodes=math.ceil(gpus / GPUS_PER_NODE) if gpus else 0,
        facility_watts=tuple(gpus * gpu.tdp_watts * f for f in POWER_FACTORS), notes=notes, estimates=ESTIMATES,
        tp_chosen=tp_chosen)
    if not result.fits:
        host_kv = HOST_KV_FRACTION * host_mem_bytes_per_node * _nodes(tp)
        result.offload = plan_offload(result, model, gpu, offload, host_kv)
    return result


def _cluster(model: ModelSpec, usable: float, context: int, concurrency: int, kv_dtype: str, weight_dtype: str,
             tp: int, max_conc: int) -> tuple[int, int]:
    """(tp, replicas) of the cluster that holds every request's KV in HBM: at `tp` when one request fits
    there, else at the smallest TP above it that holds one; (tp, 0) when none does."""
    if max_conc:
        return tp, math.ceil(concurrency / max_conc)
    bigger = request_tp(model, usable, context, concurrency, kv_dtype, weight_dtype, start=tp + 1)
    if bigger is None:
        return tp, 0
    room = kv_room_bytes(model, usable, concurrency, weight_dtype, bigger)
    return bigger, math.ceil(concurrency / int(room // model.kv_bytes(context, kv_dtype, bigger)))


def _nodes(tp: int) -> int:
    """Nodes one replica spans."""
    return max(1, math.ceil(tp / GPUS_PER_NODE))


def _tier_plan(spill: float, tp: int, host_mem_per_node: float, restore_bw: float) -> dict:
    """Where the spilled KV of one replica goes. Host DRAM of the replica's nodes first
    (HOST_KV_FRACTION of it); what DRAM cannot hold lives in the pool (Mooncake Store / Redis, shared
    by the nodes); local SSD keeps a copy of all spilled KV (the manager writes through to the lowest
    tier), split over the replica's nodes. The `*_meets_ttft` checks compare the restore bandwidth one
    GPU needs with what each tier's fabric delivers per GPU."""
    nodes = _nodes(tp)
    dram = min(spill, HOST_KV_FRACTION * host_mem_per_node * nodes)
    return {
        "host_dram_bytes_per_node": dram / nodes, "pool_bytes": spill - dram, "ssd_bytes_per_node": spill / nodes,
        "dram_meets_ttft": PCIE5_X16 >= restore_bw, "pool_meets_ttft": RDMA_400G >= restore_bw,
        "ssd_meets_ttft": NVME_SEQ >= restore_bw,
    }
