// CPU attention kernels, FlashAttention-2 style.
//
// Forward: work items are (batch, query head, chunk of kChunkM query rows),
// spread over threads with at::parallel_for. A chunk streams key/value tiles of
// kBlockN rows (from K^T packed once per head and thread, or per item when a
// shared mask orders the items heads-inner); each of its kBlockM-row
// query blocks multiplies into a kBlockM x kBlockN score tile, runs the online
// softmax (running row max and sum) and accumulates its output rows. Extra
// memory: per-thread tiles and packed key head (O(S)) plus the O(L)
// logsumexp per head.
//
// Backward: work items are (batch, query head), or two heads run side by side
// with a shared mask larger than L2. Key/value tiles are the outer loop (K,
// K^T, V^T packed once per tile and head), query blocks the inner one; each
// step recomputes P = exp(S - lse), accumulates dV and dK of the tile and dQ of
// the block (dQ for the whole head in an O(L) float buffer). No two items
// write the same memory and every sum runs in a fixed order, so results do not
// depend on the number of threads.
//
// Matrix products on tiles go to cpu::gemm (gemm_cpu.h): register-blocked,
// deterministic, with the instruction set chosen at run time; half and
// bfloat16 tiles are widened to float first.
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

// ---------------------------------------------------------------------------
// Row operations. Float: max and exp come from gemm_cpu (intrinsics on
// AVX-512), the rest are loops cloned per instruction set; double uses plain
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

// ---------------------------------------------------------------------------
// Per-thread buffers start on a cache line (64 bytes): std::vector's storage
// is only 16-byte aligned, and a misaligned start makes every zmm load of a
// packed tile span two lines.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* ptr, std::size_t) { ::operator delete(ptr, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, LineAllocator<T>>;

template <typename scalar_t, typename acc_t>
constexpr bool tile_needs_pack(int64_t col_stride) {
  return !(std::is_same_v<scalar_t, acc_t> && col_stride == 1);
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
// third of a masked forward).
MHA_CPU_CLONES void add_float_mask_f(float* s, const float* m, int64_t n, float unit) {
  for (int64_t c = 0; c < n; ++c) s[c] += mask_in_units(m[c], unit);
}

// s[c] = keep[c] ? s[c] : -inf, contiguous bool mask columns
MHA_CPU_CLONES void apply_bool_mask_f(float* s, const bool* m, int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c) s[c] = m[c] ? s[c] : kNegInf;
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
    for (int64_t c = 0; c < n; ++c) s[c] = cap * std::tanh(s[c] * inv);
  }
  if (w.alibi != nullptr) {  // - slope |i + diag_offset - j|
    const acc_t slope = static_cast<const acc_t*>(w.alibi)[b * w.alibi_stride_b + h * w.alibi_stride_h] * unit;
    const int64_t d0 = i + w.diag_offset - j0;
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
        if (cs == 1) apply_bool_mask_f(s, m, n), done = true;
      }
      if (!done)
        for (int64_t c = 0; c < n; ++c) s[c] = m[c * cs] ? s[c] : kNegInf;
    } else {
      const scalar_t* m = static_cast<const scalar_t*>(p.mask) + off;
      bool done = false;
      if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
        if (cs == 1) add_float_mask_f(s, m, n, unit), done = true;
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
  for (int64_t c = 0; c < n; ++c) {
    const acc_t t = std::tanh(raw[c] * inv);
    ds[c] *= acc_t(1) - t * t;
  }
}

}  // namespace

void dropout_keep_row_cpu(const DropoutParams& d, uint64_t row, int64_t j0, int64_t n, uint8_t* keep) {
  int64_t t = 0;
  const int64_t head = std::min<int64_t>(n, (4 - (j0 & 3)) & 3);  // up to a multiple of 4
  if (head > 0) dropout_keep_row(d.seed, d.offset, row, j0, head, d.drop_threshold, keep);
  t = head;
  const int64_t blocks = (n - t) / 64;
  if (blocks > 0)
    cpu::philox_keep64(d.seed, row, d.offset + static_cast<uint64_t>((j0 + t) >> 2), d.drop_threshold, blocks, keep + t);
  t += 64 * blocks;
  if (t < n) dropout_keep_row(d.seed, d.offset, row, j0 + t, n - t, d.drop_threshold, keep + t);
}

namespace {

// ---------------------------------------------------------------------------
// AMX operands (bfloat16 forward on Isa::kAmx): bfloat16 bits, zero-padded to
// the 32-multiples amx_gemm_bf16 works in.
inline int64_t round32(int64_t x) { return (x + 31) / 32 * 32; }

inline uint16_t bf16_bits(c10::BFloat16 x) { return x.x; }

// A operand: rows [0, rows) x cols [0, cols) of a strided bfloat16 matrix
// into dst (rows_pad x ld), zero elsewhere.
void pack_a_bf16(const c10::BFloat16* src, int64_t rs, int64_t cs, int64_t rows, int64_t cols,
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
void pack_kt_pairs(const c10::BFloat16* k, int64_t rs, int64_t cs, int64_t n, int64_t E, int64_t n_pad,
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
void pack_v_pairs(const c10::BFloat16* v, int64_t rs, int64_t cs, int64_t n, int64_t Ev, int64_t n_pad,
                  int64_t ev_pad, uint16_t* dst) {
  const int64_t ld = 2 * ev_pad;
  if (cs == 1) return cpu::amx_pack_row_pairs(reinterpret_cast<const uint16_t*>(v), rs, n, Ev, n_pad, ev_pad, ld, dst);
  for (int64_t j = 0; j < n_pad; ++j) {
    uint16_t* d = dst + (j / 2) * ld + (j & 1);
    const c10::BFloat16* row = v + j * rs;
    for (int64_t c = 0; c < ev_pad; ++c) d[2 * c] = (j < n && c < Ev) ? bf16_bits(row[c * cs]) : 0;
  }
}


inline uint64_t dropout_row_id(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i);
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

template <typename scalar_t>
void attention_fwd_kernel(const AttentionFwdParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = RowOps<acc_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t H = p.heads_q, L = p.len_q, E = p.head_dim, Ev = p.head_dim_v;
  const int64_t G = p.group_size();
  const int64_t n_chunks = (L + kChunkM - 1) / kChunkM;
  const acc_t unit = Ops::kUnitsPerNat;
  const acc_t scale = static_cast<acc_t>(p.scale) * unit;  // scores in the kernel's units
  const acc_t rescale = static_cast<acc_t>(p.dropout.rescale);
  const scalar_t* q = static_cast<const scalar_t*>(p.q);
  const scalar_t* k = static_cast<const scalar_t*>(p.k);
  const scalar_t* v = static_cast<const scalar_t*>(p.v);
  scalar_t* out = static_cast<scalar_t*>(p.out);
  acc_t* lse = static_cast<acc_t*>(p.lse);

  // bfloat16 on AMX: Q, K, V and P stay bfloat16 and multiply on the tile
  // unit (float accumulation), padded to multiples of 32; S and O are float.
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const bool amx = kBf16 && cpu::active_isa() == cpu::Isa::kAmx;
  const int64_t e_pad = round32(E), ev_pad = round32(Ev);
  const int64_t ldo = amx ? ev_pad : Ev;  // o_acc row stride
  // On AMX the products give unscaled scores: without a float mask (added to
  // scaled scores) and with scale > 0 (so the row max scales with it), the
  // scale moves into the exponential's argument instead of a pass of its own.
  const bool fold_scale = amx && p.mask_kind != MaskKind::kFloat && !p.variant.changes_scores() && scale > acc_t(0);
  // and without dropout, the exponential writes P in bfloat16 straight away
  const bool fuse_p = amx && !p.dropout.enabled();

  // Work item: (batch, head, chunk of kChunkM query rows). K^T of the whole
  // key head (on AMX: K and V in the tile unit's pair layouts) is packed when
  // a thread's item moves to another key head; consecutive items are chunks of
  // one head, so a head is packed about once per thread rather than once per
  // chunk (O(S) memory per thread; with a mask shared by the heads the order
  // is different, see heads_inner). Each kBlockM-row query block of a chunk
  // then reads its key/value tile from there.
  const int64_t S_kv = p.len_kv, s32 = round32(S_kv);
  // K's pair rows on AMX, 32 bf16 longer than the head: at exactly 2 s32 a
  // long head put the 16 rows of a tile load 8 KiB apart, all in one L1 set
  // (the tile loads of S = Q K^T were two thirds of the forward's product time)
  const int64_t ld_kbf = 2 * s32 + 32;
  const int64_t ldkt = transposed_ld(S_kv);  // K^T row stride
  // With a shared mask that outgrows L2, items go chunk-major, heads inner: a
  // chunk's mask rows (256 x S) are still in L2 for the next head, at the
  // price of packing K^T whenever the key head changes (every item unless GQA
  // groups the heads). In-process A/B, 1 thread, forward with
  // a (1, L, L) float mask, 12 heads x 64: L = 1024 53.2 vs 59.3 ms, L = 2048
  // 221 vs 228; at L = 512 (a 1 MiB mask) 18.4 vs 18.3 with 20 heads.
  const bool heads_inner = shared_mask_outgrows_l2<scalar_t>(p);
  at::parallel_for(0, p.batch * H * n_chunks, 1, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> q_buf(amx ? 0 : kChunkM * E), kt_head(amx ? 0 : E * ldkt), v_buf(amx ? 0 : kBlockN * Ev);
    Buffer<acc_t> s_buf(kBlockM * kBlockN), o_acc(kChunkM * ldo), row_max(kChunkM),
        row_sum(kChunkM);
    Buffer<uint16_t> q_bf(amx ? kChunkM * e_pad : 0), k_bf(amx ? e_pad / 2 * ld_kbf : 0),
        v_bf(amx ? s32 * ev_pad : 0), v_edge(amx ? kBlockN * ev_pad : 0), p_bf(amx ? kBlockM * kBlockN : 0);
    std::vector<uint8_t> keep(kBlockN);
    int64_t packed_head = -1;
    for (int64_t w = begin; w < end; ++w) {
      int64_t chunk = w % n_chunks, bh = w / n_chunks;  // w = (b, h, chunk)
      if (heads_inner) {  // w = (b, chunk, h)
        const int64_t bc = w / H;
        chunk = bc % n_chunks;
        bh = (bc / n_chunks) * H + w % H;
      }
      const int64_t h = bh % H, b = bh / H, hk = h / G;
      const int64_t c0 = chunk * kChunkM, cm = std::min(kChunkM, L - c0);
      if (b * p.heads_kv + hk != packed_head) {
        packed_head = b * p.heads_kv + hk;
        const scalar_t* k_head = k + b * p.k_stride.b + hk * p.k_stride.h;
        if constexpr (kBf16) {
          if (amx) {
            pack_kt_pairs(k_head, p.k_stride.row, p.k_stride.col, S_kv, E, s32, e_pad, ld_kbf, k_bf.data());
            pack_v_pairs(v + b * p.v_stride.b + hk * p.v_stride.h, p.v_stride.row, p.v_stride.col, S_kv, Ev, s32,
                         ev_pad, v_bf.data());
          }
        }
        if (!amx) load_tile_transposed(k_head, p.k_stride.row, p.k_stride.col, S_kv, E, kt_head.data(), ldkt);
      }
      int64_t ldq = 0, ldv = 0;
      const scalar_t* q_chunk = q + b * p.q_stride.b + h * p.q_stride.h + c0 * p.q_stride.row;
      const acc_t* qc = nullptr;
      if constexpr (kBf16) {
        if (amx) pack_a_bf16(q_chunk, p.q_stride.row, p.q_stride.col, cm, E, round32(cm), e_pad, q_bf.data());
      }
      if (!amx) qc = load_tile(q_chunk, p.q_stride.row, p.q_stride.col, cm, E, q_buf.data(), &ldq);
      std::fill(o_acc.begin(), o_acc.begin() + round32(cm) * ldo, acc_t(0));
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));

      // key tiles some row of the chunk may see (a window skips the others;
      // tiles start on multiples of kBlockN, where the packed layouts expect them)
      const int64_t chunk_kv_end = visible_kv_end(p, c0, cm);
      for (int64_t j0 = visible_kv_begin(p, c0) / kBlockN * kBlockN; j0 < chunk_kv_end; j0 += kBlockN) {
        const int64_t n = std::min(kBlockN, chunk_kv_end - j0);
        const scalar_t* v_tile = v + b * p.v_stride.b + hk * p.v_stride.h + j0 * p.v_stride.row;
        const acc_t* k_t = kt_head.data() + j0;  // K^T of the tile, (E x n), row stride ldkt
        const uint16_t* k_bf_tile = k_bf.data() + 2 * j0;  // AMX: pair rows, ld_kbf apart
        const uint16_t* v_bf_tile = v_bf.data() + j0 * ev_pad;  // AMX: pair rows from key j0
        const acc_t* vt = amx ? nullptr : load_tile(v_tile, p.v_stride.row, p.v_stride.col, n, Ev, v_buf.data(), &ldv);
        for (int64_t r0 = 0; r0 < cm; r0 += kBlockM) {
          const int64_t i0 = c0 + r0, m = std::min(kBlockM, cm - r0);
          const int64_t nq = std::min(n, visible_kv_end(p, i0, m) - j0);  // causal: fewer columns
          if (nq <= 0 || visible_kv_begin(p, i0) >= j0 + n) continue;     // the block sees none of the tile
          acc_t* s = s_buf.data();
          acc_t* o_blk = o_acc.data() + r0 * ldo;
          const int64_t lds = amx ? round32(nq) : nq;  // S row stride
          if (amx) {  // S = Q K^T on tiles, then the scale (unless it rides in the exponential)
            if constexpr (std::is_same_v<acc_t, float>) {
              cpu::amx_gemm_bf16(round32(m), lds, e_pad, q_bf.data() + r0 * e_pad, e_pad, k_bf_tile, ld_kbf, s,
                                 lds, false);
              if (!fold_scale)
                for (int64_t r = 0; r < m; ++r) Ops::scale(s + r * lds, nq, scale);
            }
          } else {
            cpu::gemm(m, nq, E, scale, qc + r0 * ldq, ldq, 1, k_t, ldkt, acc_t(0), s, nq);  // S2 = log2(e) scale Q K^T
          }
          for (int64_t r = 0; r < m; ++r) {
            acc_t* srow = s + r * lds;
            const int64_t i = i0 + r;
            acc_t& rmax = row_max[r0 + r];
            transform_row<scalar_t>(p, b, h, i, j0, nq, unit, srow);
            acc_t tile_max = Ops::max(srow, nq) * (fold_scale ? scale : acc_t(1));
            if (tile_max == kNegInf && has_nan(srow, nq)) tile_max = std::numeric_limits<acc_t>::quiet_NaN();
            const acc_t new_max = nan_max(rmax, tile_max);
            if (new_max == kNegInf) {  // every key so far is masked: P = 0
              std::fill(srow, srow + nq, acc_t(0));
              if (fuse_p) std::fill(p_bf.begin() + r * lds, p_bf.begin() + (r + 1) * lds, uint16_t(0));
              continue;
            }
            const acc_t alpha = rmax == kNegInf ? acc_t(0) : Ops::expb(rmax - new_max);
            const acc_t mul = fold_scale ? scale : acc_t(1);
            acc_t sum;
            if constexpr (kBf16) {
              sum = fuse_p ? cpu::amx_exp2_sub_sum_bf16(srow, nq, mul, new_max, p_bf.data() + r * lds, lds)
                           : Ops::exp_sub_sum(srow, nq, mul, new_max);
            } else {
              sum = Ops::exp_sub_sum(srow, nq, mul, new_max);
            }
            row_sum[r0 + r] = row_sum[r0 + r] * alpha + sum;
            rmax = new_max;
            if (alpha != acc_t(1)) Ops::scale(o_blk + r * ldo, Ev, alpha);
            if (p.dropout.enabled()) {
              dropout_keep_row_cpu(p.dropout, dropout_row_id(p, b, h, i), j0, nq, keep.data());
              Ops::apply_keep(srow, keep.data(), nq, rescale);
            }
          }
          if (amx) {  // O += P V on tiles, P rounded to bfloat16
            if constexpr (kBf16) {
              if (!fuse_p) {
                cpu::amx_pack_float_rows(s, lds, m, nq, round32(m), lds, p_bf.data());
              } else if (m < round32(m)) {
                std::fill(p_bf.begin() + m * lds, p_bf.begin() + round32(m) * lds, uint16_t(0));
              }
              const uint16_t* vb = v_bf_tile;
              if (lds > nq && j0 + nq < S_kv) {  // ragged edge with keys after it: the rows past nq must be
                                                 // zero, not those keys (0 * NaN = NaN); past S_kv v_bf is zero
                pack_v_pairs(v_tile, p.v_stride.row, p.v_stride.col, nq, Ev, lds, ev_pad, v_edge.data());
                vb = v_edge.data();
              }
              cpu::amx_gemm_bf16(round32(m), ev_pad, lds, p_bf.data(), lds, vb, 2 * ev_pad, o_blk, ldo, true);
            }
          } else {
            cpu::gemm(m, Ev, nq, acc_t(1), s, nq, 1, vt, ldv, acc_t(1), o_blk, Ev);  // O += P V
          }
        }
      }

      for (int64_t r = 0; r < cm; ++r) {
        const int64_t i = c0 + r;
        const acc_t l = row_sum[r];
        const acc_t inv = l > acc_t(0) ? acc_t(1) / l : acc_t(0);
        scalar_t* orow = out + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
        const acc_t* arow = o_acc.data() + r * ldo;
        for (int64_t e = 0; e < Ev; ++e) orow[e * p.out_stride.col] = static_cast<scalar_t>(arow[e] * inv);
        // l is 0 only when every key of the row is masked: lse = -inf there.
        // A NaN anywhere in the row's scores makes l, and so lse, NaN.
        lse[(b * H + h) * L + i] = l > acc_t(0) ? (row_max[r] + Ops::logb(l)) / unit : (l == l ? kNegInf : l);
      }
    }
  });
}

namespace {

// The bfloat16 backward's operands on AMX (one per thread): Q and dO of a
// head as rows (A) and as pair rows (B), the key tile's K and V as
// transposed pairs (B of S and dP) and K as pair rows (B of dQ), the block's
// P^T, dS and dS^T in bfloat16 (A), and float dK / dV of the tile; all
// zero-padded to multiples of 32.
struct AmxBwdBuffers {
  int64_t e_pad = 0, ev_pad = 0;
  Buffer<uint16_t> q_rows, q_pairs, do_rows, do_pairs, k_tp, v_tp, k_pairs, a_bf;
  Buffer<float> tr, dk_tile, dv_tile;

  AmxBwdBuffers(int64_t L, int64_t E, int64_t Ev) : e_pad(round32(E)), ev_pad(round32(Ev)) {
    const int64_t lp = round32(L);
    q_rows.resize(lp * e_pad);
    q_pairs.resize(lp * e_pad);
    do_rows.resize(lp * ev_pad);
    do_pairs.resize(lp * ev_pad);
    k_tp.resize(e_pad * kBlockN);
    v_tp.resize(ev_pad * kBlockN);
    k_pairs.resize(kBlockN * e_pad);
    a_bf.resize(kBlockM * kBlockN);
    tr.resize(kBlockM * kBlockN);
    dk_tile.resize(kBlockN * e_pad);
    dv_tile.resize(kBlockN * ev_pad);
  }

  // rows and pair rows of a head's (L x D) strided matrix
  static void pack_head(const c10::BFloat16* src, int64_t rs, int64_t cs, int64_t L, int64_t D, int64_t d_pad,
                        uint16_t* rows, uint16_t* pairs) {
    const int64_t lp = round32(L);
    pack_a_bf16(src, rs, cs, L, D, lp, d_pad, rows);
    cpu::amx_pack_row_pairs(rows, d_pad, L, D, lp, d_pad, 2 * d_pad, pairs);
  }

  // C (+)= A^T B where A is a float (m x nq) block: transposed into bfloat16 first
  void gemm_at(const float* a, int64_t lda, int64_t m, int64_t nq, const uint16_t* b_pairs, int64_t n_out,
               float* c, int64_t ldc) {
    cpu::transpose(a, lda, m, nq, tr.data(), m);  // (nq x m), row stride m
    cpu::amx_pack_float_rows(tr.data(), m, nq, m, round32(nq), round32(m), a_bf.data());
    cpu::amx_gemm_bf16(round32(nq), n_out, round32(m), a_bf.data(), round32(m), b_pairs, 2 * n_out, c, ldc, true);
  }
};

}  // namespace

template <typename scalar_t>
void attention_bwd_kernel(const AttentionBwdParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = RowOps<acc_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t H = p.heads_q, L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = p.head_dim_v;
  const int64_t G = p.group_size();
  const acc_t unit = Ops::kUnitsPerNat;
  const acc_t scale = static_cast<acc_t>(p.scale);  // of dS
  const acc_t s_scale = scale * unit;               // of S, in the kernel's units
  const acc_t rescale = static_cast<acc_t>(p.dropout.rescale);
  const scalar_t* q = static_cast<const scalar_t*>(p.q);
  const scalar_t* k = static_cast<const scalar_t*>(p.k);
  const scalar_t* v = static_cast<const scalar_t*>(p.v);
  const scalar_t* o = static_cast<const scalar_t*>(p.out);
  const scalar_t* dout = static_cast<const scalar_t*>(p.grad_out);
  const acc_t* lse = static_cast<const acc_t*>(p.lse);
  scalar_t* dq_out = static_cast<scalar_t*>(p.grad_q);
  acc_t* dk_all = static_cast<acc_t*>(p.grad_k);
  acc_t* dv_all = static_cast<acc_t*>(p.grad_v);
  acc_t* dmask_all = static_cast<acc_t*>(p.grad_mask);
  // bfloat16 on AMX: the five products on the tile unit (AmxBwdBuffers)
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const bool amx = kBf16 && cpu::active_isa() == cpu::Isa::kAmx;
  const int64_t ldq_acc = amx ? round32(E) : E;  // dQ accumulator row stride
  // S's scale inside the exponential on AMX, as in the forward
  const bool fold_scale =
      amx && p.mask_kind != MaskKind::kFloat && !p.variant.changes_scores() && s_scale > acc_t(0);
  const bool softcap = p.variant.softcap > 0.0;

  // Work item: (batch, query head). Key/value tiles are the outer loop, so K,
  // K^T and V^T are packed once per tile (and head); dK and dV of the tile accumulate over
  // the query blocks, dQ of the whole head in an O(L) float buffer.
  //
  // With a shared mask that outgrows L2, an item takes two heads of a batch
  // and runs them side by side, block by block, so the second reads each mask
  // tile from L2. In-process A/B, 1 thread, forward+backward with a (1, L, L)
  // float mask: 12x2048x64 586 vs 629 ms, 16x2048x64 746 vs 802, 12x1024x64
  // 145 vs 149; at L = 512 pairs were slower (65.8 vs 62.7, 20 heads).
  const int64_t kGroup = 2;
  const bool grouped = shared_mask_outgrows_l2<scalar_t>(p) && H % kGroup == 0 &&
                       p.batch * (H / kGroup) >= at::get_num_threads();
  const int64_t group = grouped ? kGroup : 1;

  // One query head's state within an item.
  struct Head {
    int64_t h = 0, hk = 0;
    acc_t* dk = nullptr;
    acc_t* dv = nullptr;
    const acc_t* qh = nullptr;   // Q of the head, (L x E), row stride ldq
    const acc_t* doh = nullptr;  // dO of the head, (L x Ev), row stride lddo
    const acc_t* lse_h = nullptr;
    const acc_t* kt = nullptr;   // K of the tile, (n x E), row stride ldk
    int64_t ldq = 0, lddo = 0, ldk = 0;
    Buffer<acc_t> q_buf, do_buf;  // whole-head copies, only when the input needs packing
    Buffer<acc_t> row_d, dq_acc, k_buf, kt_buf, vt_buf;
    // P = expb(S * mul - row_sub) * row_inv: row_sub = lse in the kernel's
    // units and row_inv = 1, or the row's exact max and 1 / sum where
    // lse_needs_exact_stats (exact_row_stats below)
    Buffer<acc_t> row_sub, row_inv;
    std::vector<uint8_t> exact;  // per row: row_sub / row_inv are exact statistics
    std::unique_ptr<AmxBwdBuffers> ab;
  };

  // Query blocks [first_row, rows_end) may see the key tile [j0, j0 + n) (a
  // causal alignment or window skips the others); blocks start on multiples of kBlockM.
  auto first_row = [&](int64_t j0) -> int64_t { return p.variant.rows_begin(j0) / kBlockM * kBlockM; };
  auto rows_end = [&](int64_t j0, int64_t n) -> int64_t { return p.variant.rows_end(j0 + n - 1, L); };

  // Packs the key/value tile (j0, n rows) of the head's key head for the
  // products: K rows and K^T, V^T (on AMX their pair layouts).
  auto pack_tile = [&](Head& hd, int64_t b, int64_t j0, int64_t n) {
    const int64_t ldt = transposed_ld(n), n32 = round32(n);
    const scalar_t* k_tile = k + b * p.k_stride.b + hd.hk * p.k_stride.h + j0 * p.k_stride.row;
    const scalar_t* v_tile = v + b * p.v_stride.b + hd.hk * p.v_stride.h + j0 * p.v_stride.row;
    if (!amx) {
      hd.kt = load_tile(k_tile, p.k_stride.row, p.k_stride.col, n, E, hd.k_buf.data(), &hd.ldk);
      load_tile_transposed(k_tile, p.k_stride.row, p.k_stride.col, n, E, hd.kt_buf.data(), ldt);
      load_tile_transposed(v_tile, p.v_stride.row, p.v_stride.col, n, Ev, hd.vt_buf.data(), ldt);
    }
    if constexpr (kBf16) {
      if (amx) {
        AmxBwdBuffers* ab = hd.ab.get();
        pack_kt_pairs(k_tile, p.k_stride.row, p.k_stride.col, n, E, n32, ab->e_pad, 2 * n32, ab->k_tp.data());
        pack_kt_pairs(v_tile, p.v_stride.row, p.v_stride.col, n, Ev, n32, ab->ev_pad, 2 * n32, ab->v_tp.data());
        pack_v_pairs(k_tile, p.k_stride.row, p.k_stride.col, n, E, n32, ab->e_pad, ab->k_pairs.data());
        std::fill(ab->dk_tile.begin(), ab->dk_tile.begin() + n32 * ab->e_pad, 0.f);
        std::fill(ab->dv_tile.begin(), ab->dv_tile.begin() + n32 * ab->ev_pad, 0.f);
      }
    }
  };

  // S of query rows i0 .. i0 + m against the packed tile (n keys, nq of them
  // visible) into pt, row stride round32(nq) on AMX, else nq; in the kernel's
  // units, except on AMX with fold_scale (the scale rides in the exponential).
  auto scores = [&](const Head& hd, int64_t i0, int64_t m, int64_t n, int64_t nq, acc_t* pt) {
    if (amx) {
      if constexpr (std::is_same_v<acc_t, float>) {
        const AmxBwdBuffers* ab = hd.ab.get();
        const int64_t lds = round32(nq);
        cpu::amx_gemm_bf16(round32(m), lds, ab->e_pad, ab->q_rows.data() + i0 * ab->e_pad, ab->e_pad,
                           ab->k_tp.data(), 2 * round32(n), pt, lds, false);  // S = Q K^T
        if (!fold_scale)
          for (int64_t r = 0; r < m; ++r) Ops::scale(pt + r * lds, nq, s_scale);
      }
    } else {
      cpu::gemm(m, nq, E, s_scale, hd.qh + i0 * hd.ldq, hd.ldq, 1, hd.kt_buf.data(), transposed_ld(n), acc_t(0), pt,
                nq);  // S2 = log2(e) scale Q K^T
    }
  };

  // row_sub / row_inv of a head (see Head). Rows whose lse is too coarse
  // (lse_needs_exact_stats: finfo.min padding rows, huge logits) get their
  // exact max and sum from a pass over the keys with the same tiles and
  // products as the main loop, so the scores are the same to the bit and
  // S - max <= 0 there. Costs nothing when no row needs it.
  auto exact_row_stats = [&](Head& hd, int64_t b) {
    bool any = false;
    for (int64_t i = 0; i < L; ++i) {
      const acc_t x = hd.lse_h[i];
      hd.exact[i] = lse_needs_exact_stats(x) ? 1 : 0;
      any = any || hd.exact[i];
      hd.row_sub[i] = hd.exact[i] ? kNegInf : x * unit;
      hd.row_inv[i] = hd.exact[i] ? acc_t(0) : acc_t(1);  // the running sum until the end
    }
    if (!any) return;
    Buffer<acc_t> s_buf(kBlockM * kBlockN);
    const acc_t mul = fold_scale ? s_scale : acc_t(1);
    for (int64_t j0 = 0; j0 < S; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, S - j0);
      bool packed = false;
      for (int64_t i0 = first_row(j0); i0 < rows_end(j0, n); i0 += kBlockM) {
        const int64_t m = std::min(kBlockM, L - i0);
        const int64_t nq = std::min(n, visible_kv_end(p, i0, m) - j0);
        if (nq <= 0 || std::find(hd.exact.begin() + i0, hd.exact.begin() + i0 + m, 1) == hd.exact.begin() + i0 + m)
          continue;
        if (!packed) pack_tile(hd, b, j0, n), packed = true;
        const int64_t lds = amx ? round32(nq) : nq;
        scores(hd, i0, m, n, nq, s_buf.data());
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          if (!hd.exact[i]) continue;
          acc_t* srow = s_buf.data() + r * lds;
          transform_row<scalar_t>(p, b, hd.h, i, j0, nq, unit, srow);
          const acc_t new_max = std::max(hd.row_sub[i], Ops::max(srow, nq) * mul);
          if (new_max == kNegInf) continue;
          const acc_t alpha = hd.row_sub[i] == kNegInf ? acc_t(0) : Ops::expb(hd.row_sub[i] - new_max);
          hd.row_inv[i] = hd.row_inv[i] * alpha + Ops::exp_sub_sum(srow, nq, mul, new_max);
          hd.row_sub[i] = new_max;
        }
      }
    }
    for (int64_t i = 0; i < L; ++i)
      if (hd.exact[i]) hd.row_inv[i] = hd.row_inv[i] > acc_t(0) ? acc_t(1) / hd.row_inv[i] : acc_t(0);
  };

  at::parallel_for(0, p.batch * (H / group), 1, [&](int64_t begin, int64_t end) {
    std::vector<Head> heads(group);
    for (Head& hd : heads) {
      // (on AMX the products read AmxBwdBuffers; dO is still read as acc_t for D)
      if (!amx && tile_needs_pack<scalar_t, acc_t>(p.q_stride.col)) hd.q_buf.resize(L * E);
      if (tile_needs_pack<scalar_t, acc_t>(p.grad_out_stride.col)) hd.do_buf.resize(L * Ev);
      hd.row_d.resize(L);
      hd.row_sub.resize(L);
      hd.row_inv.resize(L);
      hd.exact.resize(L);
      hd.dq_acc.resize((amx ? round32(L) : L) * ldq_acc);
      if (amx) hd.ab.reset(new AmxBwdBuffers(L, E, Ev));
      hd.k_buf.resize(amx ? 0 : kBlockN * E);
      hd.kt_buf.resize(amx ? 0 : transposed_ld(kBlockN) * E);  // K^T, (E x n), row stride ldt
      hd.vt_buf.resize(amx ? 0 : transposed_ld(kBlockN) * Ev);  // V^T, (Ev x n), row stride ldt
    }
    Buffer<acc_t> o_buf(kBlockM * Ev);
    Buffer<acc_t> p_buf(kBlockM * kBlockN), dp_buf(kBlockM * kBlockN), raw(softcap ? kBlockN : 0);
    std::vector<uint8_t> keep(kBlockN);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H / group);
      for (int64_t g = 0; g < group; ++g) {  // the heads' setup: zeroed gradients, D, packed Q and dO
        Head& hd = heads[g];
        const int64_t h = (item % (H / group)) * group + g;
        const int64_t bh = b * H + h;
        hd.h = h;
        hd.hk = h / G;
        hd.dk = dk_all + bh * S * E;
        hd.dv = dv_all + bh * S * Ev;
        std::fill(hd.dk, hd.dk + S * E, acc_t(0));
        std::fill(hd.dv, hd.dv + S * Ev, acc_t(0));
        std::fill(hd.dq_acc.begin(), hd.dq_acc.end(), acc_t(0));
        int64_t ldo = 0;
        hd.qh = amx ? nullptr
                    : load_tile(q + b * p.q_stride.b + h * p.q_stride.h, p.q_stride.row, p.q_stride.col, L, E,
                                hd.q_buf.data(), &hd.ldq);
        hd.doh = load_tile(dout + b * p.grad_out_stride.b + h * p.grad_out_stride.h, p.grad_out_stride.row,
                           p.grad_out_stride.col, L, Ev, hd.do_buf.data(), &hd.lddo);
        for (int64_t i0 = 0; i0 < L; i0 += kBlockM) {  // D = rowsum(dO * O)
          const int64_t m = std::min(kBlockM, L - i0);
          const acc_t* ot = load_tile(o + b * p.out_stride.b + h * p.out_stride.h + i0 * p.out_stride.row,
                                      p.out_stride.row, p.out_stride.col, m, Ev, o_buf.data(), &ldo);
          for (int64_t r = 0; r < m; ++r)
            hd.row_d[i0 + r] = Ops::dot(hd.doh + (i0 + r) * hd.lddo, ot + r * ldo, Ev);
        }
        hd.lse_h = lse + bh * L;
        exact_row_stats(hd, b);
        if constexpr (kBf16) {
          if (amx) {
            AmxBwdBuffers::pack_head(q + b * p.q_stride.b + h * p.q_stride.h, p.q_stride.row, p.q_stride.col, L, E,
                                     hd.ab->e_pad, hd.ab->q_rows.data(), hd.ab->q_pairs.data());
            AmxBwdBuffers::pack_head(dout + b * p.grad_out_stride.b + h * p.grad_out_stride.h,
                                     p.grad_out_stride.row, p.grad_out_stride.col, L, Ev, hd.ab->ev_pad,
                                     hd.ab->do_rows.data(), hd.ab->do_pairs.data());
          }
        }
      }

      for (int64_t j0 = 0; j0 < S; j0 += kBlockN) {
        const int64_t n = std::min(kBlockN, S - j0);
        const int64_t ldt = transposed_ld(n);
        const int64_t n32 = round32(n);
        for (Head& hd : heads) pack_tile(hd, b, j0, n);
        for (int64_t i0 = first_row(j0); i0 < rows_end(j0, n); i0 += kBlockM) {
          const int64_t m = std::min(kBlockM, L - i0);
          const int64_t nq = std::min(n, visible_kv_end(p, i0, m) - j0);
          if (nq <= 0) continue;
          const int64_t lds = amx ? round32(nq) : nq;  // P and dP row stride
          for (Head& hd : heads) {
            const int64_t h = hd.h;
            [[maybe_unused]] AmxBwdBuffers* ab = hd.ab.get();
            const acc_t* qt = amx ? nullptr : hd.qh + i0 * hd.ldq;
            const acc_t* dot = hd.doh + i0 * hd.lddo;
            const acc_t* v_t = hd.vt_buf.data();
            acc_t* pt = p_buf.data();
            acc_t* dpt = dp_buf.data();
            scores(hd, i0, m, n, nq, pt);
            if (amx) {
              if constexpr (std::is_same_v<acc_t, float>) {
                cpu::amx_gemm_bf16(round32(m), lds, ab->ev_pad, ab->do_rows.data() + i0 * ab->ev_pad, ab->ev_pad,
                                   ab->v_tp.data(), 2 * n32, dpt, lds, false);  // dP = dO V^T
              }
            } else {
              cpu::gemm(m, nq, Ev, acc_t(1), dot, hd.lddo, 1, v_t, ldt, acc_t(0), dpt, nq);  // dP = dO V^T
            }
            for (int64_t r = 0; r < m; ++r) {
              const int64_t i = i0 + r;
              acc_t* prow = pt + r * lds;
              acc_t* dprow = dpt + r * lds;
              if (hd.lse_h[i] == kNegInf) {  // fully masked row: P = 0, no gradient
                std::fill(prow, prow + nq, acc_t(0));
                std::fill(dprow, dprow + nq, acc_t(0));
                continue;
              }
              if (softcap) std::copy(prow, prow + nq, raw.data());  // for the softcap's derivative
              transform_row<scalar_t>(p, b, h, i, j0, nq, unit, prow);
              Ops::exp_sub_sum(prow, nq, fold_scale ? s_scale : acc_t(1), hd.row_sub[i]);
              if (hd.exact[i]) Ops::scale(prow, nq, hd.row_inv[i]);
              if (p.dropout.enabled()) {
                // O = sum_j P_j z_j V_j / (1 - p): the gradient wrt P_j is z_j dP_j / (1 - p),
                // and dV takes the dropped, rescaled P.
                dropout_keep_row_cpu(p.dropout, dropout_row_id(p, b, h, i), j0, nq, keep.data());
                Ops::dropout_softmax_grad(prow, dprow, keep.data(), nq, rescale, hd.row_d[i]);
              } else {
                Ops::softmax_grad(prow, dprow, nq, hd.row_d[i]);
              }
              if (dmask_all != nullptr) {  // the mask is added after the softcap: its gradient is dS
                acc_t* gm = dmask_all + ((b * H + h) * L + i) * S + j0;
                std::copy(dprow, dprow + nq, gm);
              }
              if (softcap) softcap_grad_row(p, raw.data(), nq, unit, dprow);
            }
            if (amx) {
              if constexpr (std::is_same_v<acc_t, float>) {
                ab->gemm_at(pt, lds, m, nq, ab->do_pairs.data() + i0 * ab->ev_pad, ab->ev_pad, ab->dv_tile.data(),
                            ab->ev_pad);  // dV += P~^T dO
                for (int64_t r = 0; r < m; ++r) Ops::scale(dpt + r * lds, nq, scale);  // scale dS for dQ and dK
                cpu::amx_pack_float_rows(dpt, lds, m, nq, round32(m), lds, ab->a_bf.data());
                cpu::amx_gemm_bf16(round32(m), ab->e_pad, lds, ab->a_bf.data(), lds, ab->k_pairs.data(),
                                   2 * ab->e_pad, hd.dq_acc.data() + i0 * ldq_acc, ldq_acc, true);  // dQ += scale dS K
                ab->gemm_at(dpt, lds, m, nq, ab->q_pairs.data() + i0 * ab->e_pad, ab->e_pad, ab->dk_tile.data(),
                            ab->e_pad);  // dK += scale dS^T Q
              }
            } else {
              cpu::gemm(nq, Ev, m, acc_t(1), pt, 1, nq, dot, hd.lddo, acc_t(1), hd.dv + j0 * Ev, Ev);  // dV += P~^T dO
              cpu::gemm(m, E, nq, scale, dpt, nq, 1, hd.kt, hd.ldk, acc_t(1), hd.dq_acc.data() + i0 * E,
                        E);  // dQ += scale dS K
              cpu::gemm(nq, E, m, scale, dpt, 1, nq, qt, hd.ldq, acc_t(1), hd.dk + j0 * E, E);  // dK += scale dS^T Q
            }
          }
        }
        if (amx) {  // the tile's dK and dV, unpadded
          for (Head& hd : heads) {
            const AmxBwdBuffers* ab = hd.ab.get();
            for (int64_t j = 0; j < n; ++j) {
              std::copy(ab->dk_tile.begin() + j * ab->e_pad, ab->dk_tile.begin() + j * ab->e_pad + E,
                        hd.dk + (j0 + j) * E);
              std::copy(ab->dv_tile.begin() + j * ab->ev_pad, ab->dv_tile.begin() + j * ab->ev_pad + Ev,
                        hd.dv + (j0 + j) * Ev);
            }
          }
        }
      }
      for (const Head& hd : heads) {
        scalar_t* dq_rows = dq_out + (b * H + hd.h) * L * E;
        for (int64_t i = 0; i < L; ++i)
          for (int64_t e = 0; e < E; ++e) dq_rows[i * E + e] = static_cast<scalar_t>(hd.dq_acc[i * ldq_acc + e]);
      }
    }
  });
}

#define MHA_INSTANTIATE(T)                                                \
  template void attention_fwd_kernel<T>(const AttentionFwdParams& p); \
  template void attention_bwd_kernel<T>(const AttentionBwdParams& p);
MHA_INSTANTIATE(double)
MHA_INSTANTIATE(float)
MHA_INSTANTIATE(c10::Half)
MHA_INSTANTIATE(c10::BFloat16)
#undef MHA_INSTANTIATE

}  // namespace mha_ext
