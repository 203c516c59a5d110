// What the CPU forward and backward kernels share (forward_cpu.cpp, decode_cpu.cpp,
// backward_cpu.cpp): tile sizes, the row operations in the kernels' units,
// per-thread buffers, tile loads and transposes, the bfloat16 pair operands' packing, the
// one score transform of the attention variants (transform_row) and the
// visible key ranges. Internal to those two files.
#pragma once

#include "kernels_cpu.h"

#include "../dropout.h"
#include "gemm_cpu.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MHA_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MHA_CPU_CLONES
#endif

namespace mha_ext {
namespace {

// 64 query rows x 256 key columns: the float score tile is 64 KiB, in the
// 2 MiB L2 next to the Q chunk, the key/value tile and the output
// accumulator. kBlockN = 128, 192 and 256 ran within noise of each other here
// (forward, 2 x 12 heads x 1024 x 64, 2 threads: torch time / ours = 0.82 for
// each, on an earlier kernel); 256 does half the online-softmax rescales of 128.
constexpr int64_t kBlockM = 64;
constexpr int64_t kBlockN = 256;
// Forward work items are kChunkM query rows (4 blocks) of a head.
constexpr int64_t kChunkM = 256;
// Up to this many query rows the forward takes scores as dot products with
// K's rows instead of packing K^T of the head (forward_cpu.cpp, row_dots).
// With 4 rows the dot path lost to torch (bench_decode.py, 12 x 64 heads:
// float32 0.61-1.17, bfloat16 0.65-0.80), so only single rows take it.
constexpr int64_t kRowDotRows = 1;

// ---------------------------------------------------------------------------
// Row operations. Float: max and exp come from gemm_cpu (intrinsics on
// AVX-512 and AVX2), the rest are loops cloned per instruction set; double uses plain
// loops with std::exp.
//
// Units of the scores: float kernels keep them in base 2, S2 = log2(e) * S
// (the factor rides on the product's alpha, a float mask is multiplied by it),
// so softmax exponentials are 2^x, cheaper than e^x; the logsumexp they
// return is natural. Double (gradcheck) stays in base e. kUnitsPerNat is the
// factor, expb / logb the matching exponential and logarithm.

// Max that propagates NaN from b (a NaN score must make its row NaN).
template <typename T>
inline T nan_max(T a, T b) {
  return (b > a || b != b) ? b : a;
}

// Row maxima are NaN-blind (they vectorise); callers look for NaN only when
// one comes out -inf, the one case where a NaN would otherwise be lost.
template <typename T>
bool has_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return true;
  return false;
}

MHA_CPU_CLONES void scale_f(float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

// x[i] = keep[i] ? x[i] * s : 0 (dropout); s passed by value so the loop
// vectorises (a captured reference would be reloaded after every store)
MHA_CPU_CLONES void apply_keep_f(float* x, const uint8_t* keep, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] = keep[i] ? x[i] * s : 0.f;
}

// dp[i] = p[i] * (dp[i] - d)
MHA_CPU_CLONES void softmax_grad_f(const float* p, float* dp, int64_t n, float d) {
  for (int64_t i = 0; i < n; ++i) dp[i] = p[i] * (dp[i] - d);
}

// With dropout, in one pass: dp[i] = p[i] * ((keep[i] ? dp[i] * s : 0) - d),
// then p[i] = keep[i] ? p[i] * s : 0 (the dropped, rescaled P that dV takes).
MHA_CPU_CLONES void dropout_softmax_grad_f(float* p, float* dp, const uint8_t* keep, int64_t n, float s, float d) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    dp[i] = pi * ((keep[i] ? dp[i] * s : 0.f) - d);
    p[i] = keep[i] ? pi * s : 0.f;
  }
}

// kLanes independent partial sums (vertical, so the compiler vectorises them
// without reassociating), combined at the end.
constexpr int64_t kLanes = 16;

MHA_CPU_CLONES float dot_f(const float* a, const float* b, int64_t n) {
  float s[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) s[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) s[0] += a[i] * b[i];
  float r = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) r += s[l];
  return r;
}

template <typename T>
struct RowOps;

template <>
struct RowOps<float> {
  static constexpr float kUnitsPerNat = 1.44269504088896341f;  // log2(e)
  static float expb(float x) { return std::exp2(x); }
  static float logb(float x) { return std::log2(x); }
  static float max(const float* x, int64_t n) { return cpu::row_max(x, n); }
  static float exp_sub_sum(float* x, int64_t n, float mul, float sub) { return cpu::exp2_sub_sum(x, n, mul, sub); }
  static void scale(float* x, int64_t n, float a) { scale_f(x, n, a); }
  static void softmax_grad(const float* p, float* dp, int64_t n, float d) {
    softmax_grad_f(p, dp, n, d);
  }
  static void apply_keep(float* x, const uint8_t* keep, int64_t n, float s) { apply_keep_f(x, keep, n, s); }
  static void dropout_softmax_grad(float* p, float* dp, const uint8_t* keep, int64_t n, float s, float d) {
    dropout_softmax_grad_f(p, dp, keep, n, s, d);
  }
  static float dot(const float* a, const float* b, int64_t n) { return dot_f(a, b, n); }
};

template <>
struct RowOps<double> {
  static constexpr double kUnitsPerNat = 1.0;
  static double expb(double x) { return std::exp(x); }
  static double logb(double x) { return std::log(x); }
  static double max(const double* x, int64_t n) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }
  static double exp_sub_sum(double* x, int64_t n, double mul, double sub) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      x[i] = std::exp(mul * x[i] - sub);
      s += x[i];
    }
    return s;
  }
  static void scale(double* x, int64_t n, double a) {
    for (int64_t i = 0; i < n; ++i) x[i] *= a;
  }
  static void softmax_grad(const double* p, double* dp, int64_t n, double d) {
    for (int64_t i = 0; i < n; ++i) dp[i] = p[i] * (dp[i] - d);
  }
  static void apply_keep(double* x, const uint8_t* keep, int64_t n, double s) {
    for (int64_t i = 0; i < n; ++i) x[i] = keep[i] ? x[i] * s : 0.0;
  }
  static void dropout_softmax_grad(double* p, double* dp, const uint8_t* keep, int64_t n, double s, double d) {
    for (int64_t i = 0; i < n; ++i) {
      const double pi = p[i];
      dp[i] = pi * ((keep[i] ? dp[i] * s : 0.0) - d);
      p[i] = keep[i] ? pi * s : 0.0;
    }
  }
  static double dot(const double* a, const double* b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
};

// Per-thread buffers: cpu::Buffer (gemm_cpu.h), on a cache line.
using cpu::Buffer;

template <typename scalar_t, typename acc_t>
constexpr bool tile_needs_pack(int64_t col_stride) {
  return !(std::is_same_v<scalar_t, acc_t> && col_stride == 1);
}

// Rows of K and V read in place or widened are prefetched this many rows
// ahead: rows that are not adjacent in memory (a (B, S, H, D) cache, a head of
// it every H D elements) are not followed by the hardware prefetcher (the
// bfloat16 decode of a (B, S, H, D) cache read K at a third of the speed of
// a (B, H, S, D) one without it).
constexpr int64_t kPrefetchRows = 8;

// Prefetches the cache lines of `bytes` bytes from p (locality 3: L1, 1: L2).
inline void prefetch_row(const void* p, int64_t bytes, int locality) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if (locality == 3) {
      __builtin_prefetch(c + o, 0, 3);
    } else {
      __builtin_prefetch(c + o, 0, 1);
    }
  }
}

// A (rows x cols) tile of a strided operand, as acc_t with a leading dimension:
// the operand itself when it already is acc_t with unit column stride, else a
// packed copy in `buf`.
template <typename scalar_t, typename acc_t>
const acc_t* load_tile(const scalar_t* base, int64_t row_stride, int64_t col_stride,
                       int64_t rows, int64_t cols, acc_t* buf, int64_t* ld) {
  if (!tile_needs_pack<scalar_t, acc_t>(col_stride)) {
    *ld = row_stride;
    return reinterpret_cast<const acc_t*>(base);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* src = base + r * row_stride;
    acc_t* dst = buf + r * cols;
    if constexpr (std::is_same_v<acc_t, float> && sizeof(scalar_t) == 2) {  // bfloat16, float16: vector widening
      if (col_stride == 1) {
        if (r + kPrefetchRows < rows) prefetch_row(src + kPrefetchRows * row_stride, cols * sizeof(scalar_t), 3);
        const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
        std::is_same_v<scalar_t, c10::BFloat16> ? cpu::widen_bf16(bits, cols, dst) : cpu::widen_half(bits, cols, dst);
        continue;
      }
    }
    if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<acc_t>(src[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<acc_t>(src[c * col_stride]);
    }
  }
  *ld = cols;
  return buf;
}

// Row stride of a transposed (cols x rows) tile that is the B operand of a
// product: rows rounded up to whole cache lines (every row starts on one),
// plus one line. With exactly 256 floats (1 KiB) the rows of a 64-column B
// panel fall on 16 of the 64 L1 sets and evict each other: a 64 x 256 x 64
// product ran at 79 GFLOP/s with ldb = 256 and 96 with ldb = 272 (one core).
inline int64_t transposed_ld(int64_t rows) { return (rows + 15) / 16 * 16 + 16; }

// The transpose of a (rows x cols) strided tile: dst[c * ldd + r].
// Blocks of 16 source rows: their cache lines stay in L1 while each output
// row segment is written contiguously.
template <typename scalar_t, typename acc_t>
void load_tile_transposed(const scalar_t* base, int64_t row_stride, int64_t col_stride,
                          int64_t rows, int64_t cols, acc_t* dst, int64_t ldd) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (col_stride == 1) return cpu::transpose(base, row_stride, rows, cols, dst, ldd);
  }
  constexpr int64_t kRows = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    const scalar_t* src = base + r0 * row_stride;
    for (int64_t c = 0; c < cols; ++c) {
      acc_t* d = dst + c * ldd + r0;
      const scalar_t* sc = src + c * col_stride;
      for (int64_t t = 0; t < nr; ++t) d[t] = static_cast<acc_t>(sc[t * row_stride]);
    }
  }
}

// A float mask value in the scores' units (times `unit`). In base 2 a finite
// value beyond max / log2(e) (finfo.min, as padding masks use) would overflow
// to -inf and count as "masked out"; it is clamped to the largest finite value
// instead. A row masked everywhere with finfo.min then stays uniform, as
// torch's float softmax gives (finfo.min + s rounds to finfo.min). Values
// between -max and -max / log2(e) become equal, where torch would still order
// them. Compares and selects only, so loops over it vectorise; infinite mask
// values stay infinite and NaN falls through.
template <typename T>
inline T mask_in_units(T mv, T unit) {
  constexpr T kMax = std::numeric_limits<T>::max();
  const T u = unit * mv;
  const T uc = u < -kMax ? -kMax : (u > kMax ? kMax : u);
  return (mv < -kMax || mv > kMax) ? mv : uc;
}

// s[c] += mask_in_units(m[c]) over contiguous float mask columns, cloned per
// instruction set (the generic loop in transform_row ran 4 lanes wide and cost a
// third of a masked forward); on AVX-512 and AVX2, cpu::mask_add instead.
MHA_CPU_CLONES void add_float_mask_f(float* s, const float* m, int64_t n, float unit) {
  for (int64_t c = 0; c < n; ++c) s[c] += mask_in_units(m[c], unit);
}

// s[c] = keep[c] ? s[c] : -inf, contiguous bool mask columns (cpu::mask_bool on AVX-512 and AVX2)
MHA_CPU_CLONES void apply_bool_mask_f(float* s, const bool* m, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c) s[c] = m[c] ? s[c] : kNegInf;
}

// Whether a bool mask hides keys [j0, j0 + n) from query rows i0 .. i0 +
// rows - 1 of heads h0 .. h0 + G - 1 of batch b (every entry false): such a
// tile adds nothing to those rows (transform_row would make all its scores
// -inf), so a kernel may skip it without reading K or V, as it skips the
// tiles a window or causal alignment hides. The case: transformers' mask
// over a StaticCache's rows past its length; a decode step against 256 keys
// of a 4096-row cache read all 4096 (1,016 us where the call on the 256 rows
// took 74; float32, 32 x 8 x 128 heads, bench/results/2026-12-07/hf-static-zen4.md).
// Rows and heads a broadcast (stride 0) repeats are checked once.
inline bool bool_mask_hides_tile(const AttentionFwdParams& p, int64_t b, int64_t h0, int64_t G, int64_t i0,
                                 int64_t rows, int64_t j0, int64_t n) {
  const unsigned char* base = static_cast<const unsigned char*>(p.mask) + b * p.mask_stride.b +
                              h0 * p.mask_stride.h + i0 * p.mask_stride.row + j0 * p.mask_stride.col;
  const int64_t heads = p.mask_stride.h == 0 ? 1 : G, cs = p.mask_stride.col;
  rows = p.mask_stride.row == 0 ? std::min<int64_t>(rows, 1) : rows;
  for (int64_t g = 0; g < heads; ++g)
    for (int64_t i = 0; i < rows; ++i) {
      const unsigned char* m = base + g * p.mask_stride.h + i * p.mask_stride.row;
      uint64_t any = 0;
      int64_t c = 0;
      if (cs == 1) {  // eight entries a load
        for (; c + 8 <= n; c += 8) {
          uint64_t w;
          std::memcpy(&w, m + c, 8);
          any |= w;
        }
      }
      for (; c < n; ++c) any |= m[c * cs];
      if (any != 0) return false;
    }
  return true;
}

// The end of the last tile of kBlockN keys from j_begin (j_begin a multiple
// of kBlockN, the tiles before j_end) that a bool mask shows some of those
// rows, or j_begin where it shows them none: the tiles from the end backwards.
inline int64_t bool_mask_keys_end(const AttentionFwdParams& p, int64_t b, int64_t h0, int64_t G, int64_t i0,
                                  int64_t rows, int64_t j_begin, int64_t j_end) {
  if (j_end <= j_begin) return j_begin;
  for (int64_t j0 = j_begin + (j_end - j_begin - 1) / kBlockN * kBlockN; j0 >= j_begin; j0 -= kBlockN)
    if (!bool_mask_hides_tile(p, b, h0, G, i0, rows, j0, std::min(kBlockN, j_end - j0)))
      return std::min(j0 + kBlockN, j_end);
  return j_begin;
}

// The one score transform of the CPU kernels (AttentionVariant), on scores
// s[0 .. n) of row i against keys j0 .. j0 + n, already scaled into the
// kernel's units (`unit` per natural unit): softcap, ALiBi, then the float
// mask added (mask_in_units) or the bool mask applied, and -inf on the keys
// the row may not see (causal alignment and window).
template <typename scalar_t, typename acc_t>
void transform_row(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                   int64_t n, acc_t unit, acc_t* s) {
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const AttentionVariant& w = p.variant;
  if (w.softcap > 0.0) {  // in units: C tanh(s / C) with C = softcap * unit
    const acc_t cap = static_cast<acc_t>(w.softcap) * unit, inv = acc_t(1) / cap;
    bool done = false;  // float: the vector routine (the scalar loop cost 5 ns a score)
    if constexpr (std::is_same_v<acc_t, float>) done = cpu::softcap_row(s, n, cap, inv);
    if (!done)
      for (int64_t c = 0; c < n; ++c) s[c] = cap * std::tanh(s[c] * inv);
  }
  if (w.alibi != nullptr) {  // - slope |i + diag_offset - j|
    const acc_t slope = static_cast<const acc_t*>(w.alibi)[b * w.alibi_stride_b + h * w.alibi_stride_h] * unit;
    const int64_t d0 = i + w.diag_offset - j0;
    bool done = false;  // float: the vector routine (the loop's 64-bit conversions took a fifth of a forward)
    if constexpr (std::is_same_v<acc_t, float>) done = cpu::alibi_row(s, n, static_cast<float>(slope), d0);
    if (!done)
      for (int64_t c = 0; c < n; ++c) s[c] -= slope * static_cast<acc_t>(d0 > c ? d0 - c : c - d0);
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t off = b * p.mask_stride.b + h * p.mask_stride.h + i * p.mask_stride.row +
                        j0 * p.mask_stride.col;
    const int64_t cs = p.mask_stride.col;
    if (p.mask_kind == MaskKind::kBool) {
      const bool* m = static_cast<const bool*>(p.mask) + off;
      bool done = false;  // contiguous columns: the cloned loop
      if constexpr (std::is_same_v<acc_t, float>) {
        if (cs == 1) {
          if (!cpu::mask_bool(s, reinterpret_cast<const uint8_t*>(m), n)) apply_bool_mask_f(s, m, n);
          done = true;
        }
      }
      if (!done)
        for (int64_t c = 0; c < n; ++c) s[c] = m[c * cs] ? s[c] : kNegInf;
    } else {
      const scalar_t* m = static_cast<const scalar_t*>(p.mask) + off;
      bool done = false;
      if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
        if (cs == 1) {
          if (!cpu::mask_add(s, m, n, unit)) add_float_mask_f(s, m, n, unit);
          done = true;
        }
      } else if constexpr (sizeof(scalar_t) == 2 && std::is_same_v<acc_t, float>) {
        // a bfloat16 / float16 mask: widened in vector registers (the loop
        // below widened one element at a time: a float16 forward took 1.77x
        // the time of one without the mask)
        if (cs == 1)
          done = cpu::mask_add16(s, reinterpret_cast<const uint16_t*>(m), std::is_same_v<scalar_t, c10::BFloat16>, n,
                                 unit);
      }
      if (!done)
        for (int64_t c = 0; c < n; ++c) s[c] += mask_in_units(static_cast<acc_t>(m[c * cs]), unit);
    }
  }
  if (w.limits_keys()) {
    const int64_t lo = std::min(std::max<int64_t>(w.begin(i) - j0, 0), n);
    const int64_t hi = std::max(std::min(w.end(i, p.len_kv) - j0, n), lo);
    std::fill(s, s + lo, kNegInf);
    std::fill(s + hi, s + n, kNegInf);
  }
}

// dS of a row (in place) times the softcap's derivative 1 - tanh^2, from the
// raw scores in the kernel's units (what transform_row started from).
template <typename acc_t>
void softcap_grad_row(const AttentionFwdParams& p, const acc_t* raw, int64_t n, acc_t unit, acc_t* ds) {
  const acc_t inv = acc_t(1) / (static_cast<acc_t>(p.variant.softcap) * unit);
  if constexpr (std::is_same_v<acc_t, float>) {
    if (cpu::softcap_grad(raw, n, inv, ds)) return;
  }
  for (int64_t c = 0; c < n; ++c) {
    const acc_t t = std::tanh(raw[c] * inv);
    ds[c] *= acc_t(1) - t * t;
  }
}


// ---------------------------------------------------------------------------
// Pair-product operands (bfloat16 on Isa::kAvx512Bf16 and above): bfloat16
// bits, zero-padded to the 32-multiples gemm_bf16_pairs works in.
inline int64_t round32(int64_t x) { return (x + 31) / 32 * 32; }

inline uint16_t bf16_bits(c10::BFloat16 x) { return x.x; }

// A operand: rows [0, rows) x cols [0, cols) of a strided bfloat16 matrix
// into dst (rows_pad x ld), zero elsewhere.
inline void pack_a_bf16(const c10::BFloat16* src, int64_t rs, int64_t cs, int64_t rows, int64_t cols,
                        int64_t rows_pad, int64_t ld, uint16_t* dst) {
  for (int64_t r = 0; r < rows_pad; ++r) {
    uint16_t* d = dst + r * ld;
    int64_t c = 0;
    if (r < rows && cs == 1) {
      std::memcpy(d, src + r * rs, cols * sizeof(uint16_t));
      c = cols;
    } else if (r < rows) {
      for (; c < cols; ++c) d[c] = bf16_bits(src[r * rs + c * cs]);
    }
    for (; c < ld; ++c) d[c] = 0;
  }
}

// B operand of S = Q K^T from `n` key rows (E columns): pair row t, column j
// holds K[j][2t], K[j][2t + 1]; (e_pad / 2 pair rows) x (2 n_pad) bits, row
// stride ld (even, >= 2 n_pad).
inline void pack_kt_pairs(const c10::BFloat16* k, int64_t rs, int64_t cs, int64_t n, int64_t E, int64_t n_pad,
                          int64_t e_pad, int64_t ld, uint16_t* dst) {
  if (cs == 1 && E % 2 == 0 && rs % 2 == 0 && n == n_pad && reinterpret_cast<uintptr_t>(k) % 4 == 0) {
    // the pairs are 32-bit words: a transpose of (n x E / 2) words, bits moved unchanged
    cpu::transpose(reinterpret_cast<const float*>(k), rs / 2, n, E / 2, reinterpret_cast<float*>(dst), ld / 2);
    std::fill(dst + (E / 2) * ld, dst + (e_pad / 2) * ld, uint16_t(0));
    return;
  }
  for (int64_t t = 0; t < e_pad / 2; ++t) std::fill(dst + t * ld + 2 * n, dst + (t + 1) * ld, uint16_t(0));
  for (int64_t j = 0; j < n; ++j) {
    const c10::BFloat16* row = k + j * rs;
    for (int64_t e = 0; e < e_pad; ++e) dst[(e / 2) * ld + 2 * j + (e & 1)] = e < E ? bf16_bits(row[e * cs]) : 0;
  }
}

// B operand of O = P V from `n` value rows (Ev columns): pair row t, column c
// holds V[2t][c], V[2t + 1][c]; (n_pad / 2) x (2 ev_pad) bits.
inline void pack_v_pairs(const c10::BFloat16* v, int64_t rs, int64_t cs, int64_t n, int64_t Ev, int64_t n_pad,
                         int64_t ev_pad, uint16_t* dst) {
  const int64_t ld = 2 * ev_pad;
  if (cs == 1) return cpu::pack_row_pairs_bf16(reinterpret_cast<const uint16_t*>(v), rs, n, Ev, n_pad, ev_pad, ld, dst);
  for (int64_t j = 0; j < n_pad; ++j) {
    uint16_t* d = dst + (j / 2) * ld + (j & 1);
    const c10::BFloat16* row = v + j * rs;
    for (int64_t c = 0; c < ev_pad; ++c) d[2 * c] = (j < n && c < Ev) ? bf16_bits(row[c * cs]) : 0;
  }
}


// The dropout draws of row i of (b, h): its lse entry's index, or its row in
// the dropout frame.
inline uint64_t dropout_row_id(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i) {
  return p.dropout_row(dropout_frame(p.dropout), b, h, i);
}

// Keys [begin, end) that some row of the block [i0, i0 + m) may see (both
// bounds grow with the row): the tile loops skip the rest.
inline int64_t visible_kv_begin(const AttentionFwdParams& p, int64_t i0) { return p.variant.begin(i0); }
inline int64_t visible_kv_end(const AttentionFwdParams& p, int64_t i0, int64_t m) {
  return p.variant.end(i0 + m - 1, p.len_kv);
}

// A mask shared by the heads (head stride 0) whose rows do not fit in the
// 2 MiB L2: it is read again from memory for every head unless the heads
// that use it run close together (both kernels then change their order).
template <typename scalar_t>
bool shared_mask_outgrows_l2(const AttentionFwdParams& p) {
  if (p.mask_kind == MaskKind::kNone || p.mask_stride.h != 0 || p.mask_stride.row == 0 || p.heads_q < 2)
    return false;
  const int64_t elem = p.mask_kind == MaskKind::kBool ? int64_t(sizeof(bool)) : int64_t(sizeof(scalar_t));
  return p.len_q * p.len_kv * elem > (int64_t(2) << 20);
}

}  // namespace
}  // namespace mha_ext
