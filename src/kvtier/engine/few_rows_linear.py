"""The decode step's linear layers on the CPU at the speed of their weights.

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model: `x [M, K] @ W[N, K]^T`
with M of 1 to 8 reads all of W once and does two flops per weight, so it is bounded by memory bandwidth. torch's
CPU `linear` hands it to BLAS (MKL in torch's x86 wheels), whose small-M path does not reach that bound everywhere:
on the AMD EPYC (Zen 5) box of 2026-12-07 it read 15.4 GB/s where a plain sum of the same weights read 26-37 GB/s
and OpenBLAS's gemv 41.7 GB/s (docs/benchmarks/engine-attention.md). This kernel reads each weight row once for
all M rows (R rows of W at a time, R x M vector accumulators), the rows of W split over torch's intra-op threads (the
forward's own OpenMP team: no second pool of threads beside it).

`FewRowsLinear` is `nn.Linear` with that path for fp32 CPU inputs of at most `MAX_ROWS` rows (a decode step's batch)
and torch's own `linear` for everything else (prefill chunks, other dtypes, CUDA). The engine's model copy
(`attention.paged_model`) takes it where the kernel could be built; the caller's model is untouched.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from kvtier.engine.cpp_build import build

MAX_ROWS = 8  # rows (tokens of the flat batch) up to which the kernel runs; above, torch's linear (compute-bound)

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
    """Whether the kernel is built (the first time: a few tens of seconds, then cached). `KVTIER_FEW_ROWS_LINEAR=0`
    turns it off."""
    if os.environ.get("KVTIER_FEW_ROWS_LINEAR", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = build("kvtier_linear", _SOURCE, "kvtier's few-rows linear kernel")
        return _state["ok"]


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for fp32 CPU tensors of at most `MAX_ROWS` rows (x [..., K]), by the kernel."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)
    torch.ops.kvtier_linear.few_rows_linear(out, rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(torch.nn.Linear):
    """`nn.Linear` whose few-row fp32 CPU calls (a decode step) go through `few_rows_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and self.weight.stride(-1) == 1
                and not (torch.is_grad_enabled() and self.weight.requires_grad)):
            return few_rows_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_few_rows_linear(model: torch.nn.Module) -> int:
    """Turn the `nn.Linear` modules of `model` (fp32, on the CPU) into `FewRowsLinear`, in place (their weights
    unchanged); how many. Nothing where the kernel cannot be built."""
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype == torch.float32):
            module.__class__ = FewRowsLinear
            count += 1
    return count
