// Row primitives of the decode kernel (decode_cpu.cpp), the score side: S =
// Q K^T for a few query rows as dot products with each key row, each key row
// read whole and in address order (bfloat16 / float16 rows widened in
// registers, or bfloat16 pairs on AVX512-BF16), and the widening of 16-bit
// rows to float; on the run-time instruction-set choice of gemm_cpu.h.
// Groups of 16 float32 rows, and of 16 bfloat16 rows on AVX512-BF16, go to
// rows_lanes_cpu.cpp (one row a vector lane); P V is in rows_values_cpu.cpp.
#include "gemm_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "rows_avx2.h"
#include "rows_avx512.h"
#include "x86_intrinsics.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

namespace mha_ext {
namespace cpu {
namespace {
#if MHA_X86
using rows::PageFetch;
using rows::fetch_row_l2;
using rows::fetch_rows_l2;
using rows::lanes;
using rows::lanes32;
#endif

float bits_to_float(uint16_t x, bool bf16) {
  return bf16 ? static_cast<float>(c10::BFloat16(x, c10::BFloat16::from_bits()))
              : static_cast<float>(c10::Half(x, c10::Half::from_bits()));
}

void dot_rows_generic(const float* q, int64_t R, int64_t E, const float* k, int64_t ldk, int64_t n, float* s,
                      int64_t lds) {
  for (int64_t c = 0; c < n; ++c)
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t e = 0; e < E; ++e) acc += q[r * E + e] * k[c * ldk + e];
      s[r * lds + c] = acc;
    }
}

void dot_rows_16_generic(const float* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                         int64_t lds, bool bf16) {
  for (int64_t c = 0; c < n; ++c)
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t e = 0; e < E; ++e) acc += q[r * E + e] * bits_to_float(k[c * ldk + e], bf16);
      s[r * lds + c] = acc;
    }
}

#if MHA_X86
// Sixteen sums at once: lane l of the result is the sum of the lanes of
// x[l]. A tree of 15 steps, each two shuffles and an add (halves, quarters,
// pairs, single lanes), in place of a horizontal sum per vector; its order
// is fixed, so each sum is the same for any caller. Always inlined: out of
// line (as g++ 12 left it in both builds), the pointer to score_block's
// accumulators kept them on the stack, a store after every multiply-add;
// inlined, they stay in registers (1.03-1.22x whole decode steps, Intel Xeon
// with AMX, bit-identical).
__attribute__((target("avx512f"), always_inline)) inline __m512 sum16(const __m512* x) {
  // after the four steps lane 4 j + m holds the sum of input 4 m + j: inputs in that order
  __m512 a[16], b[8], c[4], d[2];
  for (int i = 0; i < 16; ++i) a[i] = x[4 * (i % 4) + i / 4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// Score kinds: 0 float32; 1 bfloat16 and 2 float16 key rows widened in the
// register (no widened copy of the tile goes through the caches); 3
// bfloat16 query and key rows multiplied in pairs by AVX512-BF16's vdpbf16ps
// (products exact in float, summed in float; 32 columns an instruction, no
// widening; only where the CPU has it).
template <int kKind>
struct ScoreKind {
  using Q = std::conditional_t<kKind == 3, uint16_t, float>;
  using K = std::conditional_t<kKind == 0, float, uint16_t>;
  static constexpr int64_t kCols = kKind == 3 ? 32 : 16;  // columns a step
};

// Columns e .. e + kCols of a query or key row (the first `left` real, the
// rest zero) in one register.
template <int kKind, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_cols(const T* row, int64_t e, int64_t left) {
  if constexpr (kKind == 3) {
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(lanes32(left), row + e));
  } else if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(lanes(left), row + e);
  } else {
    const __m256i x = _mm256_maskz_loadu_epi16(lanes(left), row + e);
    if constexpr (kKind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
    return _mm512_cvtph_ps(x);
  }
}

// acc += q k over one step of columns: a fused multiply-add, or for kind 3
// vdpbf16ps (written out, so that this template needs no AVX512-BF16 target
// and stays callable on CPUs without it, where kind 3 is never used)
template <int kKind>
__attribute__((target("avx512f"))) inline __m512 dot_step(__m512 acc, __m512 q, __m512 k) {
  if constexpr (kKind == 3) {
    asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(q), "v"(k));
    return acc;
  } else {
    return _mm512_fmadd_ps(q, k, acc);
  }
}

// acc[r KB + C] += the dot products of key row k with query rows qr[r]:
// the key row read whole, in address order (its columns once for the RB
// rows; the query columns come from L1 each time); meanwhile the row at
// `ahead` (unless null) is fetched into L2, and `page` takes its page-ahead
// share (the row a page on, or a few of the block's lines).
// C is a constant, so that the accumulators stay in registers.
template <int kKind, int RB, int KB, int C>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void key_dot(
    __m512* acc, const typename ScoreKind<kKind>::Q* const* qr, const typename ScoreKind<kKind>::K* k, int64_t E,
    const void* ahead, PageFetch& page) {
  constexpr int64_t kStep = ScoreKind<kKind>::kCols;
  page(k);
  if (ahead != nullptr) fetch_row_l2(ahead, E * static_cast<int64_t>(sizeof(*k)));
  int64_t e = 0;
  for (; e + kStep <= E; e += kStep) {
    const __m512 kv = load_cols<kKind>(k, e, kStep);
    for (int r = 0; r < RB; ++r) acc[r * KB + C] = dot_step<kKind>(acc[r * KB + C], load_cols<kKind>(qr[r], e, kStep), kv);
  }
  if (e < E) {
    const __m512 kv = load_cols<kKind>(k, e, E - e);
    for (int r = 0; r < RB; ++r) acc[r * KB + C] = dot_step<kKind>(acc[r * KB + C], load_cols<kKind>(qr[r], e, E - e), kv);
  }
}

template <int kKind, int RB, int KB, bool kFetch, int... C>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void keys_dot(
    __m512* acc, const typename ScoreKind<kKind>::Q* const* qr, const typename ScoreKind<kKind>::K* k, int64_t ldk,
    int64_t nk, int64_t E, int64_t n_ahead, PageFetch& page, std::integer_sequence<int, C...>) {
  (key_dot<kKind, RB, KB, C>(acc, qr, k + std::min<int64_t>(C, nk - 1) * ldk, E,
                             kFetch && C < n_ahead ? k + (C + 16) * ldk : nullptr, page),
   ...);
}

// The scores of RB query rows with 16 keys, in 16 / RB sub-blocks of KB keys:
// each sub-block keeps its RB x KB dot products in 16 registers, sums them
// with sum16 and stores row r's KB sums from lanes r KB .. Key rows are read
// one after the other: read row-interleaved, four key rows go at 7 GB/s on
// one core where in order they go as fast as a plain sum, 19 (AMD EPYC,
// float32, E = 128: bench/row_order.cpp; software prefetches helped neither
// order). Keys past nc repeat the last real one (read, never stored). The
// first n_ahead rows of the next block (16 keys on) are fetched into L2
// where kFetch (an instantiation of its own: the fetches cost the others
// registers, and those passes never fetch); `page`, the page-ahead fetch at
// each key.
template <int kKind, int RB, bool kFetch>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void score_block_e(
    const typename ScoreKind<kKind>::Q* q, int64_t E, const typename ScoreKind<kKind>::K* k, int64_t ldk, int64_t nc,
    float* s, int64_t lds, int64_t n_ahead, const PageFetch& page_in) {
  PageFetch page = page_in;  // (a local: its count and place stay in registers)
  constexpr int KB = 16 / RB;
  const typename ScoreKind<kKind>::Q* qr[RB];
  for (int r = 0; r < RB; ++r) qr[r] = q + r * E;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t k0 = 0; k0 < nc; k0 += KB) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    keys_dot<kKind, RB, KB, kFetch>(acc, qr, k + k0 * ldk, ldk, nc - k0, E, n_ahead - k0, page,
                                    std::make_integer_sequence<int, KB>{});
    const __m512 sums = sum16(acc);  // lane r KB + c: row r, key k0 + c
    const __mmask16 kc = lanes(nc - k0);
    for (int r = 0; r < RB; ++r) {  // row r's lanes down to 0, then stored
      const __m512 row = r == 0 ? sums : _mm512_permutexvar_ps(_mm512_add_epi32(iota, _mm512_set1_epi32(r * KB)), sums);
      _mm512_mask_storeu_ps(s + r * lds + k0, KB == 16 ? kc : __mmask16(kc & ((1u << KB) - 1)), row);
    }
  }
}

// score_block_e with the head dim and the page-ahead fetch as constants
// where they are the common ones (E of 64 or 128 columns; a fetch of the
// forms of rows::with_fixed_page): the column loop unrolled and each key's
// fetches straight-line, not loops over run-time counts. A one-row bfloat16
// decode spent about 30 instructions a key on the loops' control against 5
// on its products; against the run-time forms, interleaved in one process
// (Intel Xeon with AMX, 2 threads, 2k keys, K/V in the caches, with
// value_block's own): one row of 12 x 64 heads bfloat16 1.27-1.39x, float32
// 1.05-1.10x; four rows of 12 x 64 heads float32 1.33x, bfloat16 1.11x;
// four rows of 8 x 128 heads (a 32-head GQA query) 0.98-1.06x; from memory,
// 8k keys, 0.99-1.11x (docs/performance.md, "Decoding with constant head dims").
template <int kKind, int RB, bool kFetch = false>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void score_block(const typename ScoreKind<kKind>::Q* q, int64_t E,
                                                                    const typename ScoreKind<kKind>::K* k, int64_t ldk,
                                                                    int64_t nc, float* s, int64_t lds,
                                                                    int64_t n_ahead, const PageFetch& page) {
  constexpr int64_t kb = sizeof(typename ScoreKind<kKind>::K);
  auto fixed = [&](auto e) __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) {
    return E == e && rows::with_fixed_page(page, e * kb, [&](const PageFetch& pg) __attribute__((
                                                             target("avx512f,avx512bw,avx512vl"), always_inline)) {
             score_block_e<kKind, RB, kFetch>(q, e, k, ldk, nc, s, lds, n_ahead, pg);
           });
  };
  if (fixed(std::integral_constant<int64_t, 64>{}) || fixed(std::integral_constant<int64_t, 128>{})) return;
  score_block_e<kKind, RB, kFetch>(q, E, k, ldk, nc, s, lds, n_ahead, page);
}

// S (R x n, row stride lds) = Q K^T by blocks of 16 keys: four query rows at a
// time (4 x 4 sub-blocks), then two (2 x 8), then one (1 x 16). The block's
// key rows stay in L1 for the next query rows; the next block's are fetched
// into L2 (fetch_row_l2, fetch_rows_l2), adjacent rows a page on into L1 by
// the block's first pass (PageFetch).
template <int kKind>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dot_rows_avx512(const typename ScoreKind<kKind>::Q* q,
                                                                        int64_t R, int64_t E,
                                                                        const typename ScoreKind<kKind>::K* k,
                                                                        int64_t ldk, int64_t n, float* s, int64_t lds,
                                                                        bool far_fetch, int64_t rows_after = 0) {
  const bool adjacent = ldk == E;
  // float32, and bfloat16 on AVX512-BF16, groups of 16 rows: one a lane (rows_lanes_cpu.cpp)
  int64_t r_t = 0;
  if constexpr (kKind == 0) r_t = rows::dot_rows_lanes(q, R, E, k, ldk, n, s, lds, rows_after);
  if constexpr (kKind == 3) r_t = rows::dot_rows_lanes_bf16(q, R, E, k, ldk, n, s, lds, rows_after);
  if (r_t >= R) return;
  q += r_t * E, R -= r_t, s += r_t * lds;
  // rows not adjacent in memory: each block's first pass fetches the next
  // block's rows a row a key where it is a pass of four rows, else all at
  // once before it
  const bool spread = !adjacent && R >= 4;
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t nc = std::min<int64_t>(16, n - c0);
    int64_t ahead = std::clamp<int64_t>(n - c0 - 16, 0, 16);  // rows of the next block
    const int64_t row_bytes = E * static_cast<int64_t>(sizeof(*k));
    // the first pass's page-ahead fetch; later passes take none
    const int64_t per_row = R >= 2 ? rows::kPerRowBytes : 0;
    const PageFetch page = adjacent ? PageFetch::first_pass(k + c0 * ldk, row_bytes, row_bytes, nc, sizeof(*k),
                                                            per_row, far_fetch)
                                    : PageFetch::strided(far_fetch, ldk * static_cast<int64_t>(sizeof(*k)), row_bytes),
                    none;
    if (!adjacent && !spread)
      fetch_rows_l2(k + (c0 + 16) * ldk, ldk * static_cast<int64_t>(sizeof(*k)), std::exchange(ahead, 0),
                    E * static_cast<int64_t>(sizeof(*k)));
    for (int64_t r0 = 0; r0 < R;) {
      const int64_t rr = R - r0, rb = rr >= 4 ? 4 : rr >= 2 ? 2 : 1;
      // (adjacent rows: the second of 3 or more passes, of 4 rows, fetches)
      const int64_t na = (spread ? r0 == 0 : r0 > 0 && rr > rb && rb == 4) ? std::exchange(ahead, 0) : 0;
      const auto* qr = q + r0 * E;
      const auto* kc = k + c0 * ldk;
      float* sc = s + r0 * lds + c0;
      const PageFetch& pg = r0 == 0 ? page : none;
      if (na > 0)
        score_block<kKind, 4, true>(qr, E, kc, ldk, nc, sc, lds, na, pg);
      else if (rb == 4)
        score_block<kKind, 4>(qr, E, kc, ldk, nc, sc, lds, 0, pg);
      else if (rb == 2)
        score_block<kKind, 2>(qr, E, kc, ldk, nc, sc, lds, 0, pg);
      else
        score_block<kKind, 1>(qr, E, kc, ldk, nc, sc, lds, 0, pg);
      r0 += rb;
    }
  }
}

__attribute__((target("avx512f"))) void widen_bf16_avx512(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)));
  }
  for (; i < n; ++i) dst[i] = bits_to_float(src[i], true);
}

__attribute__((target("avx512f"))) void widen_half_avx512(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = bits_to_float(src[i], false);
}

#endif  // MHA_X86

}  // namespace

void dot_rows(const float* q, int64_t R, int64_t E, const float* k, int64_t ldk, int64_t n, float* s, int64_t lds,
              bool far_fetch, int64_t rows_after) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return dot_rows_avx512<0>(q, R, E, k, ldk, n, s, lds, far_fetch, rows_after);
  if (active_isa() >= Isa::kAvx2) return avx2::dot_rows(q, R, E, k, avx2::RowKind::kFloat, ldk, n, s, lds, far_fetch);
#endif
  (void)rows_after;
  dot_rows_generic(q, R, E, k, ldk, n, s, lds);
}

void dot_rows_16(const float* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                 int64_t lds, bool bf16, bool far_fetch) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512)
    return bf16 ? dot_rows_avx512<1>(q, R, E, k, ldk, n, s, lds, far_fetch)
                : dot_rows_avx512<2>(q, R, E, k, ldk, n, s, lds, far_fetch);
  if (active_isa() >= Isa::kAvx2)
    return avx2::dot_rows(q, R, E, k, bf16 ? avx2::RowKind::kBf16 : avx2::RowKind::kHalf, ldk, n, s, lds, far_fetch);
#endif
  dot_rows_16_generic(q, R, E, k, ldk, n, s, lds, bf16);
}

bool dot_rows_bf16(const uint16_t* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                   int64_t lds, bool far_fetch, int64_t rows_after) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512Bf16) {
    dot_rows_avx512<3>(q, R, E, k, ldk, n, s, lds, far_fetch, rows_after);
    return true;
  }
#endif
  (void)q, (void)R, (void)E, (void)k, (void)ldk, (void)n, (void)s, (void)lds, (void)far_fetch, (void)rows_after;
  return false;
}

void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return widen_bf16_avx512(src, n, dst);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(src[i], true);
}

void widen_half(const uint16_t* src, int64_t n, float* dst) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return widen_half_avx512(src, n, dst);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(src[i], false);
}

}  // namespace cpu
}  // namespace mha_ext
