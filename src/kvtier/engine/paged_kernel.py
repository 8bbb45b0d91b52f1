"""A CPU paged-attention kernel: one call per layer for a step's whole flat batch, reading the arena in place.

vLLM's paged kernels take the step's queries packed by sequence (`query_start_loc`), the sequence
lengths and the block tables, and read each key and value where it sits in the paged KV cache: no
gather of the context. This is that kernel for the CPU, in C++ (compiled once by torch's
`cpp_extension` into `$TORCH_EXTENSIONS_DIR`, then loaded from there): FlashAttention-2's online
softmax per (sequence, KV head, tile of queries), the tiles of all sequences spread over torch's
intra-op threads (largest first, taken from a shared counter), prefill chunks and decodes together.
A KV head's query group (GQA) are the rows of one tile, so a block's keys are read once for all of
them. Keys at positions after a query's own are masked (causal by position: a chunk's query i sits at
`seq_len - num_queries + i`). Accumulates in fp32 whatever the KV dtype (fp32, bf16, fp16).

The KV is read through strides (`[num_blocks, H, T, D]`, D contiguous), so the raw arena's layer
(`[num_blocks, H, T, D]`) and a quantized arena's dequantized blocks (`[H, n × T, D]`, viewed per block)
are read alike. `available()` says whether the kernel could be built (a C++ compiler is needed; without
one the engine keeps the gather path, `attention.SDPABackend`).
"""

from __future__ import annotations

import os
import threading

import torch

from kvtier.engine.cpp_build import build

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// BLAS sgemm (column-major), from the MKL that torch's x86 wheels link; weak: absent, the vector path runs
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace {

static inline void gemm(char transa, char transb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                        int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int m_ = m, n_ = n, k_ = k, lda_ = lda, ldb_ = ldb, ldc_ = ldc;
  sgemm_(&transa, &transb, &m_, &n_, &k_, &alpha, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

constexpr int kMaxHeadDim = 256;
constexpr int kMaxQueryTile = 128;  // query positions per work item (x the group's heads = rows)
constexpr int kMinQueryTile = 16;
constexpr int kChunkTokens = 512;  // keys per online-softmax update (whole blocks; at least one)

// exp(x) for x <= 0 (a softmax's shifted scores), branch-free so the loops vectorize:
// 2^(x log2 e) = 2^n 2^f, 2^f by a degree-6 polynomial (rel. error ~2e-7), 2^n in the exponent bits
static inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  float t = x * 1.44269504088896341f;
  float n = std::floor(t);
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// A work item: a KV head's query group for queries q0..q1 of a sequence, over its blocks j_begin..j_end
// (-1: all it sees). part >= 0: one of several items splitting a long decode's blocks, its unnormalized
// result written to the partials (merged after), so one long sequence still keeps every thread busy.
struct Item {
  int64_t seq, head, q0, q1, cost;
  int64_t j_begin = 0, j_end = -1, part = -1;
};

constexpr int kLanes = 16;  // one AVX-512 vector of fp32 (two AVX2 ones)
constexpr int kRows = 8;    // query rows per register block

template <typename kv_t>
static inline float to_float(kv_t x) { return static_cast<float>(x); }

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));  // GCC/clang vector extension

static inline vfloat load(const float* p) {
  vfloat x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

static inline void store(float* p, vfloat x) { std::memcpy(p, &x, sizeof(x)); }

// 16 floats of a key or value row (converted from bf16/fp16)
template <typename kv_t>
static inline vfloat load_kv(const kv_t* p) {
  if constexpr (std::is_same<kv_t, float>::value) {
    return load(p);
  } else {
    vfloat x;
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(p[i]);
    return x;
  }
}

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp_neg of kLanes values at once (the same polynomial and exponent bits; GCC does not vectorize the scalar
// one's loop: its floor and bit copies stay scalar)
static inline vfloat exp_neg_v(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f;
  x = x < lo ? lo : x;
  const vfloat t = x * 1.44269504088896341f;
  vfloat n = __builtin_convertvector(__builtin_convertvector(t, vint), vfloat);  // toward zero
  n = n > t ? n - 1.0f : n;                                                       // floor (t <= 0)
  const vfloat f = t - n;
  vfloat p = vfloat{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  vint bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, vint) << 23;
  vfloat r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

// the cache lines of `rows` rows of D elements, `stride` apart, requested ahead (a decode's next keys and this
// block's values: blocks sit anywhere in the arena, so the hardware's stream prefetcher would start each cold)
template <typename kv_t>
static inline void prefetch_rows(const kv_t* p, int64_t rows, int64_t stride, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * stride);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(kv_t)); b += 64) __builtin_prefetch(row + b);
  }
}

// the largest of s[0 .. n) (-inf if n = 0)
static inline float max_of(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  if (n >= kLanes) {
    vfloat v = load(s);
    for (t = kLanes; t + kLanes <= n; t += kLanes) {
      const vfloat x = load(s + t);
      v = x > v ? x : v;
    }
    for (int i = 0; i < kLanes; ++i) mx = std::max(mx, v[i]);
  }
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// s[t] = exp(s[t] - mx) for t < n; their sum
static inline float exp_shifted(float* s, int64_t n, float mx) {
  vfloat acc = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const vfloat e = exp_neg_v(load(s + t) - mx);
    store(s + t, e);
    acc += e;
  }
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += acc[i];
  for (; t < n; ++t) {
    s[t] = exp_neg(s[t] - mx);
    sum += s[t];
  }
  return sum;
}

// the sums of a0, a1, a2, a3's lanes, as lanes 0, 4, 8, 12 (a transposing tree: no serial lane adds)
static inline vfloat sum4(vfloat a0, vfloat a1, vfloat a2, vfloat a3) {
  const vfloat t01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vfloat t23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vfloat u = __builtin_shufflevector(t01, t23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(t01, t23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vfloat v = u + __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
}

// scores of R (<= 4: a decode's GQA group, or part of it) query rows against `tn` keys read in place, four keys
// at a time: each key's D read once for all R rows, R x 4 vector accumulators (independent FMA chains), each row's
// four reduced together by `sum4`. D a multiple of kLanes. Meanwhile the same rows of the `next` block's keys and of
// this block's values (`vals`, read after the chunk's scores) are requested ahead (null: none).
template <int R, typename kv_t>
static inline void scores_rows(const float* qbuf, int64_t D, const kv_t* kb, int64_t k_st, int64_t tn, float* sc,
                               int64_t sc_stride, const kv_t* next, const kv_t* vals, int64_t v_st) {
  int64_t t = 0;
  for (; t + 4 <= tn; t += 4) {
    const kv_t* k0 = kb + t * k_st;
    if (next != nullptr) prefetch_rows(next + t * k_st, 4, k_st, D);
    if (vals != nullptr) prefetch_rows(vals + t * v_st, 4, v_st, D);
    vfloat a[R][4] = {};
    for (int64_t d = 0; d < D; d += kLanes) {
      const vfloat x0 = load_kv(k0 + d), x1 = load_kv(k0 + k_st + d), x2 = load_kv(k0 + 2 * k_st + d),
                   x3 = load_kv(k0 + 3 * k_st + d);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const vfloat qv = load(qbuf + r * D + d);
        a[r][0] += qv * x0;
        a[r][1] += qv * x1;
        a[r][2] += qv * x2;
        a[r][3] += qv * x3;
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const vfloat total = sum4(a[r][0], a[r][1], a[r][2], a[r][3]);
      float* out = sc + r * sc_stride + t;
      out[0] = total[0];
      out[1] = total[4];
      out[2] = total[8];
      out[3] = total[12];
    }
  }
  for (; t < tn; ++t) {
    const kv_t* kr = kb + t * k_st;
    for (int r = 0; r < R; ++r) {
      vfloat a = {};
      for (int64_t d = 0; d < D; d += kLanes) a += load(qbuf + r * D + d) * load_kv(kr + d);
      float s = 0.f;
      for (int i = 0; i < kLanes; ++i) s += a[i];
      sc[r * sc_stride + t] = s;
    }
  }
}

// scores of `rows` (a decode's few, <= kRows) query rows against `tn` keys read in place: groups of up to four
// rows by `scores_rows` (D a multiple of kLanes; the first group prefetches next_kb and vb), else plain loops
template <typename kv_t>
static inline void scores_direct(const float* qbuf, int64_t rows, const kv_t* kb, int64_t k_st, int64_t tn,
                                 int64_t D, float* sc, int64_t sc_stride, const kv_t* next_kb = nullptr,
                                 const kv_t* vb = nullptr, int64_t v_st = 0) {
  if (D % kLanes == 0) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const float* q0 = qbuf + r0 * D;
      float* s0 = sc + r0 * sc_stride;
      const kv_t* next = r0 == 0 ? next_kb : nullptr;
      const kv_t* vals = r0 == 0 ? vb : nullptr;
      switch (std::min<int64_t>(4, rows - r0)) {
        case 1: scores_rows<1>(q0, D, kb, k_st, tn, s0, sc_stride, next, vals, v_st); break;
        case 2: scores_rows<2>(q0, D, kb, k_st, tn, s0, sc_stride, next, vals, v_st); break;
        case 3: scores_rows<3>(q0, D, kb, k_st, tn, s0, sc_stride, next, vals, v_st); break;
        default: scores_rows<4>(q0, D, kb, k_st, tn, s0, sc_stride, next, vals, v_st); break;
      }
    }
    return;
  }
  for (int64_t t = 0; t < tn; ++t) {
    const kv_t* kr = kb + t * k_st;
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = qbuf + r * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(kr[d]);
      sc[r * sc_stride + t] = s;
    }
  }
}

// acc[r, d0 : d0 + NV kLanes] += sum_t p[r, t] v[t] for R (<= 4) rows over the block's first `n` keys: each value
// slice read once for all rows, R x NV vector accumulators (independent FMA chains) held across the keys
template <int R, int NV, typename kv_t>
static inline void values_rows(const float* sc, int64_t sc_stride, const kv_t* vb, int64_t v_st, int64_t n,
                               int64_t d0, int64_t D, float* acc) {
  vfloat o[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) o[r][j] = load(acc + r * D + d0 + j * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const kv_t* vt = vb + t * v_st + d0;
    vfloat x[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) x[j] = load_kv(vt + j * kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float p = sc[r * sc_stride + t];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) o[r][j] += p * x[j];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) store(acc + r * D + d0 + j * kLanes, o[r][j]);
}

template <int R, typename kv_t>
static inline void values_rows_d(const float* sc, int64_t sc_stride, const kv_t* vb, int64_t v_st, int64_t n,
                                 int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 4 * kLanes) {
    switch (std::min<int64_t>(4, (D - d0) / kLanes)) {
      case 1: values_rows<R, 1>(sc, sc_stride, vb, v_st, n, d0, D, acc); break;
      case 2: values_rows<R, 2>(sc, sc_stride, vb, v_st, n, d0, D, acc); break;
      case 3: values_rows<R, 3>(sc, sc_stride, vb, v_st, n, d0, D, acc); break;
      default: values_rows<R, 4>(sc, sc_stride, vb, v_st, n, d0, D, acc); break;
    }
  }
}

// acc[r] += sum_t p[r, t] v[t] for a decode's few rows (<= kRows), the values read in place: groups of up to four
// rows by `values_rows` over the block's keys the longest row sees (the others' probabilities past their own keys
// are zero: attend_item clears them), D a multiple of kLanes; else plain loops
template <typename kv_t>
static inline void values_direct(const float* sc, int64_t sc_stride, const kv_t* vb, int64_t v_st,
                                 const int64_t* count, int64_t rows, int64_t D, float* acc) {
  if (D % kLanes == 0) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      int64_t n = 0;
      for (int64_t r = r0; r < r0 + nr; ++r) n = std::max(n, count[r]);
      const float* s0 = sc + r0 * sc_stride;
      float* a0 = acc + r0 * D;
      switch (nr) {
        case 1: values_rows_d<1>(s0, sc_stride, vb, v_st, n, D, a0); break;
        case 2: values_rows_d<2>(s0, sc_stride, vb, v_st, n, D, a0); break;
        case 3: values_rows_d<3>(s0, sc_stride, vb, v_st, n, D, a0); break;
        default: values_rows_d<4>(s0, sc_stride, vb, v_st, n, D, a0); break;
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = sc + r * sc_stride;
    float* a = acc + r * D;
    for (int64_t t = 0; t < count[r]; ++t)
      for (int64_t d = 0; d < D; ++d) a[d] += p[t] * to_float(vb[t * v_st + d]);
  }
}

// scores of row blocks of kRows against a transposed block kt [D, Tp] (Tp a multiple of kLanes,
// zero past the block's keys): kRows vector accumulators in registers (enough independent FMAs to
// cover their latency), one key load per kRows FMAs
static inline void scores_tiled(const float* qbuf, int64_t rows_padded, const float* kt, int64_t Tp, int64_t D,
                                float* sc, int64_t sc_stride) {
  for (int64_t r0 = 0; r0 < rows_padded; r0 += kRows) {
    const float* q0 = qbuf + r0 * D;
    for (int64_t t0 = 0; t0 < Tp; t0 += kLanes) {
      vfloat a[kRows] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vfloat kd = load(kt + d * Tp + t0);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) a[r] += q0[r * D + d] * kd;
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) store(sc + (r0 + r) * sc_stride + t0, a[r]);
    }
  }
}

// acc[r] += sum_t p[r, t] v[t] for row blocks of kRows over D in kLanes chunks (D a multiple of kLanes);
// row r sees count[r] of the block's tn keys
static inline void values_tiled(const float* sc, int64_t sc_stride, const float* vb, int64_t v_st,
                                const int64_t* count, int64_t rows_padded, int64_t D, float* acc) {
  for (int64_t r0 = 0; r0 < rows_padded; r0 += kRows) {
    int64_t tmax = 0;
    for (int r = 0; r < kRows; ++r) tmax = std::max(tmax, count[r0 + r]);
    const float* p0 = sc + r0 * sc_stride;
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
      float* o = acc + r0 * D + d0;
      vfloat a[kRows];
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) a[r] = load(o + r * D);
      for (int64_t t = 0; t < tmax; ++t) {
        const vfloat vt = load(vb + t * v_st + d0);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) a[r] += p0[r * sc_stride + t] * vt;
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) store(o + r * D, a[r]);
    }
  }
}

// One work item: rows = the tile's queries x the KV head's query group, over the sequence's blocks in
// chunks of up to kChunkTokens keys (scores of each block into the chunk's columns, one online-softmax
// update per chunk, then each block's values), so the per-row softmax work is paid once per chunk.
// Paths per block: a BLAS gemm reading the block in place (fp32, many rows), register-blocked vector
// code on a transposed copy (bf16/fp16, many rows), or dot products in place (a decode's few rows).
template <typename kv_t>
void attend_item(const Item& it, const float* q, int64_t q_sn, int64_t q_sh, float* out, int64_t o_sn, int64_t o_sh,
                 const kv_t* k, const kv_t* v, const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
                 const int64_t* q_start, const int64_t* q_lens, int64_t group, int64_t block_tokens, int64_t head_dim,
                 int64_t k_sb, int64_t k_sh, int64_t k_st, int64_t v_sb, int64_t v_sh, int64_t v_st,
                 float scale, std::vector<float>& scratch, std::vector<int64_t>& counts, float* partials) {
  const int64_t D = head_dim, T = block_tokens, G = group;
  const int64_t nq = q_lens[it.seq];
  const int64_t first_pos = seq_lens[it.seq] - nq;  // position of the sequence's first query this step
  const int64_t rows = (it.q1 - it.q0) * G;         // row r = (query q0 + r / G, head h G + r % G)
  const int64_t rows_padded = (rows + kRows - 1) / kRows * kRows;
  const int64_t kv_end = first_pos + it.q1;         // keys the tile's last query sees
  const int64_t blocks_per_chunk = std::max<int64_t>(1, kChunkTokens / T);
  const int64_t C = blocks_per_chunk * T;           // a chunk's columns
  const bool tiled = rows > kRows && D % kLanes == 0 && T % kLanes == 0;
  const bool blas = tiled && std::is_same<kv_t, float>::value && sgemm_ != nullptr;
  const bool convert = tiled && !blas;              // keys transposed (and values converted) per block
  scratch.resize(rows_padded * D * 2 + rows_padded * 2 + rows_padded * C + (convert ? 2 * T * D : 0));
  counts.resize(rows_padded * 2);
  float* qbuf = scratch.data();
  float* acc = qbuf + rows_padded * D;
  float* m = acc + rows_padded * D;
  float* l = m + rows_padded;
  float* sc = l + rows_padded;                      // [rows, C]: the chunk's scores, then probabilities
  float* kt = sc + rows_padded * C;                 // [D, T]: a block's keys, transposed (convert)
  float* vconv = kt + T * D;                        // [T, D]: its values as fp32 (convert)
  int64_t* seen = counts.data();                    // keys of the chunk each row sees (causal)
  int64_t* count = seen + rows_padded;              // ... of the current block
  std::fill(qbuf, qbuf + rows_padded * D, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = q_start[it.seq] + it.q0 + r / G, hq = it.head * G + r % G;
    const float* src = q + n * q_sn + hq * q_sh;
    for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * scale;
  }
  for (int64_t r = 0; r < rows_padded; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    seen[r] = 0;
    count[r] = 0;
  }
  std::fill(acc, acc + rows_padded * D, 0.f);
  const int64_t* table = tables + it.seq * table_stride;
  const int64_t num_blocks = it.j_end < 0 ? (kv_end + T - 1) / T : it.j_end;
  for (int64_t j0 = it.j_begin; j0 < num_blocks; j0 += blocks_per_chunk) {
    const int64_t j1 = std::min(num_blocks, j0 + blocks_per_chunk);
    const int64_t chunk_tokens = std::min(kv_end - j0 * T, (j1 - j0) * T);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t tn = std::min(T, kv_end - j * T);
      const kv_t* kb = k + table[j] * k_sb + it.head * k_sh;
      float* s = sc + (j - j0) * T;
      if (blas) {  // S^T [tn, rows] = K [tn, D] Q^T, column-major: the block's keys read in place
        gemm('T', 'N', tn, rows_padded, D, 1.f, reinterpret_cast<const float*>(kb), k_st, qbuf, D, 0.f, s, C);
      } else if (tiled) {
        for (int64_t d = 0; d < D; ++d)
          for (int64_t t = tn; t < T; ++t) kt[d * T + t] = 0.f;
        for (int64_t t = 0; t < tn; ++t)
          for (int64_t d = 0; d < D; ++d) kt[d * T + t] = to_float(kb[t * k_st + d]);
        scores_tiled(qbuf, rows_padded, kt, T, D, s, C);
      } else {
        scores_direct(qbuf, rows, kb, k_st, tn, D, s, C,
                      j + 1 < num_blocks ? k + table[j + 1] * k_sb + it.head * k_sh : nullptr,
                      v + table[j] * v_sb + it.head * v_sh, v_st);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + it.q0 + r / G;
      const int64_t n_seen = std::max<int64_t>(0, std::min(chunk_tokens, pos - j0 * T + 1));
      seen[r] = n_seen;
      float* s = sc + r * C;
      for (int64_t t = n_seen; t < chunk_tokens; ++t) s[t] = 0.f;  // a row block's value pass runs to its longest row
      if (n_seen == 0) continue;
      const float mx = std::max(m[r], max_of(s, n_seen));
      const float alpha = exp_neg(m[r] - mx);  // ~0 on the first chunk (m = -inf: clamped)
      const float sum = exp_shifted(s, n_seen, mx);
      l[r] = l[r] * alpha + sum;
      m[r] = mx;
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    }
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t off = (j - j0) * T, tn = std::min(T, kv_end - j * T);
      const kv_t* vb = v + table[j] * v_sb + it.head * v_sh;
      const float* s = sc + off;
      int64_t tmax = 0;
      for (int64_t r = 0; r < rows; ++r) {
        count[r] = std::max<int64_t>(0, std::min(tn, seen[r] - off));
        tmax = std::max(tmax, count[r]);
      }
      if (tmax == 0) continue;
      if (blas) {  // acc^T [D, rows] += V^T [D, tmax] P^T [tmax, rows], column-major: the values read in place
        gemm('N', 'N', D, rows_padded, tmax, 1.f, reinterpret_cast<const float*>(vb), v_st, s, C, 1.f, acc, D);
      } else if (tiled) {
        for (int64_t t = 0; t < tmax; ++t)
          for (int64_t d = 0; d < D; ++d) vconv[t * D + d] = to_float(vb[t * v_st + d]);
        values_tiled(s, C, vconv, D, count, rows_padded, D, acc);
      } else {
        values_direct(s, C, vb, v_st, count, rows, D, acc);
      }
    }
  }
  if (it.part >= 0) {  // [kRows, D + 2] a part (split items have at most kRows rows): acc, m, l
    float* dst = partials + it.part * kRows * (D + 2);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(dst + r * (D + 2), acc + r * D, D * sizeof(float));
      dst[r * (D + 2) + D] = m[r];
      dst[r * (D + 2) + D + 1] = l[r];
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = q_start[it.seq] + it.q0 + r / G, hq = it.head * G + r % G;
    float* dst = out + n * o_sn + hq * o_sh;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

// the parts of a split item merged by their log-sum-exp into its rows of out
static void merge_parts(const Item& it, int64_t num_parts, const float* partials, float* out, int64_t o_sn,
                        int64_t o_sh, const int64_t* q_start, int64_t group, int64_t D) {
  const int64_t rows = (it.q1 - it.q0) * group;
  std::vector<float> acc(D);
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) mx = std::max(mx, partials[((it.part + p) * kRows + r) * (D + 2) + D]);
    float l = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* src = partials + ((it.part + p) * kRows + r) * (D + 2);
      const float w = exp_neg(src[D] - mx);
      l += w * src[D + 1];
      for (int64_t d = 0; d < D; ++d) acc[d] += w * src[d];
    }
    const int64_t n = q_start[it.seq] + it.q0 + r / group, hq = it.head * group + r % group;
    float* dst = out + n * o_sn + hq * o_sh;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] / l;
  }
}

// out, q: [N, Hq, D] fp32 (D contiguous); k, v: [num_blocks, H, T, D] (D contiguous); block_tables
// [S, max_blocks], seq_lens [S], query_start [S], query_lens [S]: int64 (sequence s's queries are rows
// query_start[s] ... + query_lens[s] of q, the last ones of its seq_lens[s] tokens). Rows of no listed
// sequence are left as they are.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
                     const at::Tensor& query_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1 &&
              q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "q and out: [N, Hq, D] fp32");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(),
              "k, v: [B, H, T, D], D contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v: one dtype");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start, &query_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "metadata: contiguous int64");
  const int64_t S = seq_lens.size(0), H = k.size(1), T = k.size(2), D = k.size(3), Hq = q.size(1);
  TORCH_CHECK(D <= kMaxHeadDim && Hq % H == 0 && q.size(2) == D && block_tables.size(0) == S &&
              query_start.size(0) == S && query_lens.size(0) == S, "shapes");
  const int64_t G = Hq / H;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* nqs = query_lens.data_ptr<int64_t>();
  // query tiles as large as kMaxQueryTile (fewer passes over the keys) while every thread still gets a
  // few items (down to kMinQueryTile)
  const int64_t num_threads = at::get_num_threads();
  int64_t tile = kMaxQueryTile;
  auto num_items_of = [&](int64_t tile_) {
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s) n += (nqs[s] + tile_ - 1) / tile_ * H;
    return n;
  };
  while (tile > kMinQueryTile && num_items_of(tile) < 4 * num_threads) tile /= 2;
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nq = nqs[s];
    TORCH_CHECK(nq <= lens[s] && (lens[s] + T - 1) / T <= block_tables.size(1), "sequence ", s, ": its lengths");
    for (int64_t q0 = 0; q0 < nq; q0 += tile) {
      const int64_t q1 = std::min(nq, q0 + tile);
      const int64_t cost = (q1 - q0) * (lens[s] - nq + q1) + lens[s];
      for (int64_t h = 0; h < H; ++h) items.push_back({s, h, q0, q1, cost});
    }
  }
  // too few items for the threads (one or two long decodes): split each decode's blocks into parts of whole
  // chunks (flash-decoding), merged after
  std::vector<std::pair<Item, int64_t>> splits;  // (the item, with part = its first part), its number of parts
  int64_t num_parts = 0;
  const int64_t blocks_per_chunk = std::max<int64_t>(1, kChunkTokens / T);
  if (static_cast<int64_t>(items.size()) < 2 * num_threads) {
    const int64_t want = (4 * num_threads + items.size() - 1) / items.size();
    std::vector<Item> split_items;
    for (const Item& it : items) {
      const int64_t blocks = (lens[it.seq] - nqs[it.seq] + it.q1 + T - 1) / T;
      const int64_t parts = std::min(want, blocks / blocks_per_chunk);
      if ((it.q1 - it.q0) * G > kRows || parts < 2) {
        split_items.push_back(it);
        continue;
      }
      Item first = it;
      first.part = num_parts;
      splits.push_back({first, parts});
      const int64_t per_part = (blocks + parts - 1) / parts;
      for (int64_t p = 0; p < parts; ++p) {
        Item part = it;
        part.j_begin = p * per_part;
        part.j_end = std::min(blocks, (p + 1) * per_part);
        part.part = num_parts++;
        part.cost = it.cost / parts;
        if (part.j_begin < part.j_end) split_items.push_back(part);
      }
    }
    items.swap(split_items);
  }
  std::vector<float> partials(num_parts * kRows * (D + 2));
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_items));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "kvtier_paged_attention", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch;
      std::vector<int64_t> counts;
      for (int64_t i = next++; i < num_items; i = next++) {
        attend_item<scalar_t>(items[i], q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(),
                              out.stride(0), out.stride(1), kp, vp, block_tables.data_ptr<int64_t>(),
                              block_tables.size(1), lens, starts, nqs, G, T, D, k.stride(0), k.stride(1),
                              k.stride(2), v.stride(0), v.stride(1), v.stride(2), static_cast<float>(scale),
                              scratch, counts, partials.data());
      }
    });
  });
  for (const auto& sp : splits)
    merge_parts(sp.first, sp.second, partials.data(), out.data_ptr<float>(), out.stride(0), out.stride(1), starts, G, D);
}

// Decodes (one query per sequence) over two sources of keys, merged by log-sum-exp: the attention over both (an
// offloaded sequence's host blocks read where they sit in host memory, and its device window). A source is k, v
// (their data pointers: the bases; D contiguous, tokens `k.stride(-2)` apart), `offsets` [H, S, n] int64: element
// offsets from the base of each unit of `unit` tokens a KV head reads, in order (each head its own: sparse picks
// pages per head; K and V at the same offset from their bases), and `lens` [S] (the source's tokens: whole units
// but the last; 0: none). Every (sequence, head, source) is split into parts of whole chunks over the threads,
// each part's unnormalized result merged after (`merge_parts`). out, q: [N, Hq, D] fp32, sequence s's query in
// row query_start[s]; Hq / H <= kRows.
void paged_decode_two(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k1, const at::Tensor& v1,
                      const at::Tensor& offsets1, const at::Tensor& lens1, int64_t unit1, const at::Tensor& k2,
                      const at::Tensor& v2, const at::Tensor& offsets2, const at::Tensor& lens2, int64_t unit2,
                      const at::Tensor& query_start, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1 &&
              q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "q and out: [N, Hq, D] fp32");
  const at::Tensor* ks[2] = {&k1, &k2};
  const at::Tensor* vs[2] = {&v1, &v2};
  const at::Tensor* offsets[2] = {&offsets1, &offsets2};
  const at::Tensor* lens_t[2] = {&lens1, &lens2};
  const int64_t units[2] = {unit1, unit2};
  const int64_t S = query_start.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t H = offsets1.size(0), G = Hq / H;
  TORCH_CHECK(Hq % H == 0 && G <= kRows && D <= kMaxHeadDim, "heads: Hq / H <= ", kRows);
  TORCH_CHECK(query_start.scalar_type() == at::kLong && query_start.is_contiguous(), "query_start: int64");
  for (int src = 0; src < 2; ++src) {
    const at::Tensor &k = *ks[src], &v = *vs[src], &o = *offsets[src], &l = *lens_t[src];
    TORCH_CHECK(k.size(-1) == D && v.size(-1) == D && k.stride(-1) == 1 && v.stride(-1) == 1 &&
                k.stride(-2) == v.stride(-2) && k.scalar_type() == k1.scalar_type() &&
                v.scalar_type() == k1.scalar_type() && units[src] > 0, "k, v: D contiguous, one dtype and layout");
    TORCH_CHECK(o.dim() == 3 && o.size(0) == H && o.size(1) == S && l.size(0) == S, "offsets [H, S, n], lens [S]");
    for (const at::Tensor* m : {&o, &l})
      TORCH_CHECK(m->scalar_type() == at::kLong && m->is_contiguous(), "metadata: contiguous int64");
    const int64_t* len = l.data_ptr<int64_t>();
    const int64_t* off = o.data_ptr<int64_t>();
    // every unit read lies inside k's and v's storage
    const int64_t last = (units[src] - 1) * k.stride(-2) + D;
    for (const at::Tensor* t : {&k, &v}) {
      const int64_t lo = -t->storage_offset();
      const int64_t hi = static_cast<int64_t>(t->storage().nbytes() / t->element_size()) - t->storage_offset();
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t n = (len[s] + units[src] - 1) / units[src];
          TORCH_CHECK(n <= o.size(2), "sequence ", s, ": more units than offsets");
          for (int64_t j = 0; j < n; ++j) {
            const int64_t x = off[(h * S + s) * o.size(2) + j];
            TORCH_CHECK(x >= lo && x + last <= hi, "an offset outside the KV's storage");
          }
        }
    }
  }
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const std::vector<int64_t> ones(S, 1);
  const int64_t num_threads = at::get_num_threads();
  const int64_t want = std::max<int64_t>(1, (4 * num_threads + S * H - 1) / (S * H));  // parts per (seq, head)
  struct Work { Item item; int src; };
  std::vector<Work> work;
  std::vector<Item> firsts;  // per (seq, head): its rows and first part, for the merge
  std::vector<int64_t> num_parts_of;
  int64_t num_parts = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < H; ++h) {
      Item first{s, h, 0, 1, 0};
      first.part = num_parts;
      for (int src = 0; src < 2; ++src) {
        const int64_t T = units[src], len = lens_t[src]->data_ptr<int64_t>()[s];
        if (len == 0) continue;
        const int64_t blocks = (len + T - 1) / T, per_chunk = std::max<int64_t>(1, kChunkTokens / T);
        const int64_t parts = std::max<int64_t>(1, std::min(want, blocks / per_chunk));
        const int64_t per_part = (blocks + parts - 1) / parts;
        for (int64_t j = 0; j < blocks; j += per_part) {
          Item part{s, h, 0, 1, (std::min(blocks, j + per_part) - j) * T};
          part.j_begin = j;
          part.j_end = std::min(blocks, j + per_part);
          part.part = num_parts++;
          work.push_back({part, src});
        }
      }
      TORCH_CHECK(num_parts > first.part, "sequence ", s, ": no keys");
      firsts.push_back(first);
      num_parts_of.push_back(num_parts - first.part);
    }
  }
  std::vector<float> partials(num_parts * kRows * (D + 2));
  std::stable_sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.item.cost > b.item.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(work.size());
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, num_items));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k1.scalar_type(), "kvtier_paged_decode_two", [&] {
    at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scratch;
      std::vector<int64_t> counts;
      for (int64_t i = next++; i < num_items; i = next++) {
        const Work& w = work[i];
        const at::Tensor &k = *ks[w.src], &v = *vs[w.src], &o = *offsets[w.src];
        // this head's offsets [S, n]; a "block" j of the item is at base + offset (block stride 1, head stride 0)
        const int64_t* table = o.data_ptr<int64_t>() + w.item.head * S * o.size(2);
        attend_item<scalar_t>(w.item, q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(),
                              out.stride(0), out.stride(1), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), table,
                              o.size(2), lens_t[w.src]->data_ptr<int64_t>(), starts, ones.data(), G, units[w.src], D,
                              1, 0, k.stride(-2), 1, 0, v.stride(-2), static_cast<float>(scale), scratch, counts,
                              partials.data());
      }
    });
  });
  for (size_t i = 0; i < firsts.size(); ++i)
    merge_parts(firsts[i], num_parts_of[i], partials.data(), out.data_ptr<float>(), out.stride(0), out.stride(1),
                starts, G, D);
}

}  // namespace

TORCH_LIBRARY(kvtier, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start, Tensor query_lens, float scale) -> ()");
  m.def("paged_decode_two(Tensor(a!) out, Tensor q, Tensor k1, Tensor v1, Tensor offsets1, Tensor lens1, int unit1, "
        "Tensor k2, Tensor v2, Tensor offsets2, Tensor lens2, int unit2, Tensor query_start, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_decode_two", &paged_decode_two);
}
"""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _build() -> bool:
    return build("kvtier_paged", _SOURCE, "kvtier's paged attention kernel (attention gathers instead)")


def available() -> bool:
    """Whether the kernel is built (building it the first time: a few tens of seconds, then cached).
    `KVTIER_PAGED_KERNEL=0` turns it off."""
    if os.environ.get("KVTIER_PAGED_KERNEL", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
        return bool(_state["ok"])


def paged_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                    query_lens: torch.Tensor, scale: float) -> None:
    """out, q: [N, Hq, D] fp32 (D contiguous, any other strides); k, v: [num_blocks, H, T, D] (D contiguous);
    block_tables [S, max_blocks], seq_lens, query_start, query_lens [S] int64. Fills the rows of `out` of
    the S sequences: sequence s's queries are rows query_start[s] .. + query_lens[s], the last ones of
    its seq_lens[s] tokens; each attends to its sequence's keys up to its own position."""
    torch.ops.kvtier.paged_attention(out, q, k, v, block_tables, seq_lens, query_start, query_lens, scale)



def paged_decode_two(out: torch.Tensor, q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, offsets1: torch.Tensor,
                     lens1: torch.Tensor, unit1: int, k2: torch.Tensor, v2: torch.Tensor, offsets2: torch.Tensor,
                     lens2: torch.Tensor, unit2: int, query_start: torch.Tensor, scale: float) -> None:
    """Decodes over two sources of keys, merged by log-sum-exp (an offloaded sequence's host blocks read in place,
    and its device window). out, q: [N, Hq, D] fp32 (D contiguous), sequence s's one query in row query_start[s].
    A source: k, v (bases; D contiguous, tokens k.stride(-2) apart), offsets [H, S, n] int64 (element offsets
    from the bases of the units of `unit` tokens each KV head reads, in order; checked against the storage),
    lens [S] int64 (its tokens; 0: none). Hq / H <= 8. A new entry point beside `paged_attention` (issue 33)."""
    torch.ops.kvtier.paged_decode_two(out, q, k1, v1, offsets1, lens1, unit1, k2, v2, offsets2, lens2, unit2,
                                      query_start, scale)
