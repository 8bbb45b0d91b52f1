"""The engine's linear layers on the CPU at the speed of the machine, whatever BLAS torch was built with.

torch's CPU `linear` (fp32) hands its GEMMs to MKL in torch's x86 wheels. On the AMD EPYC (Zen 5) box of 2026-12-07
that path ran at about half of what the CPU does (docs/benchmarks/engine-attention.md), in both regimes a step has:
- **A decode step** (one row per sequence, M <= `MAX_ROWS`): `x [M, K] @ W[N, K]^T` reads all of W once for two flops
  per weight, so it is bounded by memory bandwidth. MKL's small-M path read the weights at 15-16 GB/s where a plain
  sum of them read 26-37 GB/s. The C++ kernel here reads each weight row once for all M rows (R rows of W at a
  time, R x M vector accumulators), W's rows split over torch's intra-op threads (the forward's own OpenMP team:
  no second pool of threads beside it): 29-33 GB/s.
- **A prefill step** (more rows): compute-bound; oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, what
  torch's inductor and vLLM's CPU backend call, on the weight as it is: no packed copy) ran 2.2-2.4x MKL's.

`CpuLinear` is `nn.Linear` taking those two paths for fp32 CPU inputs; anything else (bf16, CUDA, training) is
torch's own `linear`. The engine's model copy (`attention.paged_model`) takes it; the caller's model is untouched.
`KVTIER_CPU_LINEAR=0` keeps torch's linear everywhere (for side-by-side runs).
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from kvtier.engine.cpp_build import build

MAX_ROWS = 8  # rows (tokens of the flat batch) up to which the few-rows kernel runs; above, oneDNN (compute-bound)

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));  // GCC/clang vector extension

static inline vfloat loadu(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// out[m, n0 .. n0 + R) for m < M: each of the R weight rows read once for all M input rows
template <int M, int R>
static inline void rows(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, const float* bias,
                        float* out, int64_t ldo, int64_t n0) {
  vfloat acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vfloat{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vfloat xv[M];
    for (int m = 0; m < M; ++m) xv[m] = loadu(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const vfloat wv = loadu(w + (n0 + r) * ldw + k);
      for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* wr = w + (n0 + r) * ldw;
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += wr[kk] * x[m * ldx + kk];
      out[m * ldo + n0 + r] = bias ? s + bias[n0 + r] : s;
    }
  }
}

template <int M>
void run(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t N, int64_t K, const float* bias,
         float* out, int64_t ldo) {
  constexpr int R = M <= 4 ? 4 : 2;  // R x M accumulators: at most 16 of the 32 vector registers
  const int64_t groups = (N + R - 1) / R;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * R;
      if (n0 + R <= N) {
        rows<M, R>(x, ldx, w, ldw, K, bias, out, ldo, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) rows<M, 1>(x, ldx, w, ldw, K, bias, out, ldo, n);
      }
    }
  });
}

void few_rows_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "fp32 only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "shapes disagree");
  TORCH_CHECK(M >= 1 && M <= 8, "1 to 8 rows");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1, "rows contiguous");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "bias [N] fp32");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldo = out.stride(0);
  switch (M) {
    case 1: run<1>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    case 2: run<2>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    case 3: run<3>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    case 4: run<4>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    case 5: run<5>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    case 6: run<6>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    case 7: run<7>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
    default: run<8>(xp, ldx, wp, ldw, N, K, b, op, ldo); break;
  }
}

}  // namespace

TORCH_LIBRARY(kvtier_linear, m) {
  m.def("few_rows_linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier_linear, CPU, m) {
  m.impl("few_rows_linear", &few_rows_linear);
}
"""

_lock = threading.Lock()
_state: dict[str, bool] = {}


def available() -> bool:
    """Whether the few-rows kernel is built (the first time: a few tens of seconds, then cached)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = build("kvtier_linear", _SOURCE, "kvtier's few-rows linear kernel")
        return _state["ok"]


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear (x86 and aarch64 wheels do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for fp32 CPU tensors of 1 to `MAX_ROWS` rows (x [..., K]), by the kernel."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
    torch.ops.kvtier_linear.few_rows_linear(out, rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for fp32 CPU tensors by oneDNN's matmul (weight [N, K] as it is)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


class CpuLinear(torch.nn.Linear):
    """`nn.Linear` whose fp32 CPU inference calls take `few_rows_linear` (at most `MAX_ROWS` rows, a decode step)
    or `onednn_linear` (more rows); anything else torch's `linear`."""

    few_rows = True  # set per class by `use_cpu_linear`: what this process could build
    onednn = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 and w.stride(-1) == 1
                and x.numel() > 0 and not (torch.is_grad_enabled() and w.requires_grad)):
            if self.few_rows and x.numel() <= MAX_ROWS * x.shape[-1]:
                return few_rows_linear(x, w, self.bias)
            if self.onednn:
                return onednn_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)


def use_cpu_linear(model: torch.nn.Module) -> int:
    """Turn the `nn.Linear` modules of `model` (fp32, on the CPU) into `CpuLinear`, in place (their weights
    unchanged); how many. None where neither path is available or `KVTIER_CPU_LINEAR=0`."""
    CpuLinear.few_rows, CpuLinear.onednn = available(), onednn_available()
    if os.environ.get("KVTIER_CPU_LINEAR", "1") == "0" or not (CpuLinear.few_rows or CpuLinear.onednn):
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32):
            module.__class__ = CpuLinear
            count += 1
    return count
