// The softmax rows of the CPU kernels on AVX-512 and in portable C++ (the
// row primitives of gemm_cpu.h): the row maximum, the exponentials and their
// sum (also rounded to bfloat16 for the AMX tiles), the boolean and float
// masks, the softcap (tanh), ALiBi, and dropout's keep mask from Philox, 16
// counters at a time. The AVX2 forms are in softmax_avx2.cpp; the tile GEMM
// and the instruction-set choice in gemm_cpu.cpp.
#include "gemm_cpu.h"

#include "../dropout.h"
#include "rows_avx2.h"

#include <cstring>
#include <limits>

#include "x86_intrinsics.h"

namespace mha_ext {
namespace cpu {
namespace {

inline float exp2_scalar(float x) {  // selects, no branches: the loop vectorises
  const float xc = x < kExp2Lo ? kExp2Lo : (x > kExp2Hi ? kExp2Hi : x);
  const float n = (xc + kRound) - kRound;
  const float r = xc - n;
  float p = kP6;
  p = p * r + kP5;
  p = p * r + kP4;
  p = p * r + kP3;
  p = p * r + kP2;
  p = p * r + kP1;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n = 128: the bits of inf
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const float y = x < kExp2Lo ? 0.0f : p * two_n;
  return x != x ? x : y;
}

float row_max_generic(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

float exp2_sub_sum_generic(float* x, int64_t n, float mul, float sub) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp2_scalar(mul * x[i] - sub);  // two roundings here (std::fma is a libm call without FMA)
    s += x[i];
  }
  return s;
}

#if MHA_X86
__attribute__((target("avx512f"))) inline __mmask16 tail_mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

__attribute__((target("avx512f,fma"))) float row_max_avx512(const float* x, int64_t n) {
  __m512 m0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // max(x, m): a NaN x leaves m
    m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), m1);
  }
  for (; i < n; i += 16) {
    const __mmask16 k = tail_mask16(n - i);
    m0 = _mm512_mask_max_ps(m0, k, _mm512_maskz_loadu_ps(k, x + i), m0);
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

// The mask of a score row, 16 columns a step with 512-bit loads and stores,
// masked only at the row's ragged end. The compiler's loops stored 256 bits
// at a time, and a masked store is no better: row_max's 512-bit load of the
// same row then waits for the stores to retire instead of taking their data
// (row_max went from 1% to 7% of a masked 16 x 16 call's time).
__attribute__((target("avx512f"))) inline void store16(float* dst, __mmask16 t, __m512 x) {
  if (t == __mmask16(0xFFFF))
    _mm512_storeu_ps(dst, x);
  else
    _mm512_mask_storeu_ps(dst, t, x);
}

// s[c] = keep[c] ? s[c] : -inf
__attribute__((target("avx512f,avx512bw"))) void mask_bool_avx512(float* s, const uint8_t* keep, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 t = tail_mask16(n - i);
    const __m512i b = _mm512_maskz_loadu_epi8(static_cast<__mmask64>(t), keep + i);
    const __mmask16 k = static_cast<__mmask16>(_mm512_test_epi8_mask(b, b));
    store16(s + i, t, _mm512_mask_blend_ps(k, neg_inf, _mm512_maskz_loadu_ps(t, s + i)));
  }
}

// s[c] += the float mask value m[c] in units: unit m[c] clamped to the finite
// range, an infinite m[c] as it is, NaN through (mask_in_units in
// kernel_common_cpu.h, the same roundings)
__attribute__((target("avx512f"), always_inline)) inline __m512 mask_units_512(__m512 mv, __m512 u) {
  const __m512 hi = _mm512_set1_ps(std::numeric_limits<float>::max());
  const __m512 lo = _mm512_set1_ps(-std::numeric_limits<float>::max());
  // min / max return their second operand when either is NaN: NaN stays
  const __m512 uc = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(u, mv)));
  const __mmask16 inf = _mm512_cmp_ps_mask(mv, lo, _CMP_LT_OQ) | _mm512_cmp_ps_mask(mv, hi, _CMP_GT_OQ);
  return _mm512_mask_blend_ps(inf, uc, mv);
}

__attribute__((target("avx512f"))) void mask_add_avx512(float* s, const float* m, int64_t n, float unit) {
  const __m512 u = _mm512_set1_ps(unit);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 t = tail_mask16(n - i);
    const __m512 add = mask_units_512(_mm512_maskz_loadu_ps(t, m + i), u);
    store16(s + i, t, _mm512_add_ps(_mm512_maskz_loadu_ps(t, s + i), add));
  }
}

// The same for a bfloat16 or float16 mask (its bits), widened 16 at a time
// (bfloat16 by a shift, float16 by vcvtph2ps: both exact); the ragged end by
// a masked load of the entries there are
template <bool kBf16>
__attribute__((target("avx512f,avx512bw"))) void mask_add16_avx512(float* s, const uint16_t* m, int64_t n, float unit) {
  const __m512 u = _mm512_set1_ps(unit);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 t = tail_mask16(n - i);
    const __m256i h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(static_cast<__mmask32>(t), m + i));
    const __m512 mv =
        kBf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
    store16(s + i, t, _mm512_add_ps(_mm512_maskz_loadu_ps(t, s + i), mask_units_512(mv, u)));
  }
}

// Degree 4 (2.9e-6 relative in float): for probabilities that are rounded to
// bfloat16 (2^-9) before their product.
constexpr float kQ4 = 9.58285294e-3f, kQ3 = 5.59064262e-2f, kQ2 = 0.240240991f, kQ1 = 0.693124175f;

// The same polynomial (or the short one); 2^n applied by vscalefps, lanes
// below kExp2Lo zeroed by its mask.
template <bool kShort = false>
__attribute__((target("avx512f,fma"))) inline __m512 exp2_512(__m512 x) {
  // max/min return their second operand when it is NaN: NaN flows through
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(kExp2Hi), _mm512_max_ps(_mm512_set1_ps(kExp2Lo - 1.0f), x));
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(xc, n);
  __m512 p;
  if constexpr (kShort) {
    p = _mm512_fmadd_ps(_mm512_set1_ps(kQ4), r, _mm512_set1_ps(kQ3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kQ2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kQ1));
  } else {
    p = _mm512_fmadd_ps(_mm512_set1_ps(kP6), r, _mm512_set1_ps(kP5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  }
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExp2Lo), _CMP_NLT_UQ);  // x >= lo or NaN
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// fl(mul x) as an instruction of its own: an explicit rounding mode keeps the
// compiler from fusing it with the difference below (-ffp-contract)
__attribute__((target("avx512f"), always_inline)) inline __m512 mul_rounded(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// mul x - sub in two roundings, not one fused: the callers take a row's max
// as fl(mul max x) (the scale folded into the exponential on AMX), and only
// fl(mul x) - that max is exactly 0 at the max. Fused, logits of 1e10 and up
// in bfloat16 left the max at 2^(+-512): inf or 0, and NaN rows.
__attribute__((target("avx512f,fma"))) float exp2_sub_sum_avx512(float* x, int64_t n, float mul, float sub) {
  const __m512 vs = _mm512_set1_ps(sub), vm = _mm512_set1_ps(mul);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 y0 = exp2_512(_mm512_sub_ps(mul_rounded(vm, _mm512_loadu_ps(x + i)), vs));
    const __m512 y1 = exp2_512(_mm512_sub_ps(mul_rounded(vm, _mm512_loadu_ps(x + i + 16)), vs));
    _mm512_storeu_ps(x + i, y0);
    _mm512_storeu_ps(x + i + 16, y1);
    s0 = _mm512_add_ps(s0, y0);
    s1 = _mm512_add_ps(s1, y1);
  }
  for (; i < n; i += 16) {
    const __mmask16 k = tail_mask16(n - i);
    const __m512 y = exp2_512(_mm512_sub_ps(mul_rounded(vm, _mm512_maskz_loadu_ps(k, x + i)), vs));
    _mm512_mask_storeu_ps(x + i, k, y);
    s0 = _mm512_add_ps(s0, _mm512_maskz_mov_ps(k, y));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
// 2^(mul x - sub) rounded to bfloat16 into dst (zeros from n to n_pad, a
// multiple of 16), with the short polynomial; the sum is of the float values.
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,fma"))) float exp2_sub_sum_bf16_avx512(
    const float* x, int64_t n, float mul, float sub, uint16_t* dst, int64_t n_pad) {
  const __m512 vs = _mm512_set1_ps(sub), vm = _mm512_set1_ps(mul);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 k = tail_mask16(n - i);
    const __m512 d = _mm512_sub_ps(mul_rounded(vm, _mm512_maskz_loadu_ps(k, x + i)), vs);
    const __m512 y = _mm512_maskz_mov_ps(k, exp2_512<true>(d));
    sum = _mm512_add_ps(sum, y);
    const __m256bh h = _mm512_cvtneps_pbh(y);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(h));
  }
  for (; i < n_pad; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(sum);
}

// tanh(x): odd, so computed on a = |x| and the sign put back. a < 1/2: its
// Taylor series to x^13 (the next term is 1e-7 of the value at 1/2);
// above: (1 - e) / (1 + e) with e = 2^(-2 a log2 e) by exp2_512 (e = 0 from
// a ~ 44 on, which gives 1). Within 3.1 ulp of tanh over [-12, 12] (against
// float64, 3.8e7 points); NaN stays NaN, +-inf give +-1, -0 stays -0.
// (the series on a >= 0)
__attribute__((target("avx512f,fma"))) inline __m512 tanh_series_512(__m512 a) {
  const __m512 a2 = _mm512_mul_ps(a, a);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kT13), a2, _mm512_set1_ps(kT11));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(kT9));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(kT7));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(kT5));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(kT3));
  return _mm512_fmadd_ps(_mm512_mul_ps(a, a2), p, a);
}

__attribute__((target("avx512f,fma"))) inline __m512 tanh_512(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 e = exp2_512(_mm512_mul_ps(a, _mm512_set1_ps(kTanhExp2)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 small = tanh_series_512(a);
  const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhSeriesEnd), _CMP_LT_OQ);
  const __m512 t = _mm512_mask_blend_ps(is_small, big, small);
  // the sign bit of x on t (t >= 0 or NaN)
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                                             _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
}

// s[c] = cap tanh(s[c] inv)
__attribute__((target("avx512f,fma"))) void softcap_row_avx512(float* s, int64_t n, float cap, float inv) {
  const __m512 vc = _mm512_set1_ps(cap), vi = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 t = tail_mask16(n - i);
    store16(s + i, t, _mm512_mul_ps(vc, tanh_512(_mm512_mul_ps(_mm512_maskz_loadu_ps(t, s + i), vi))));
  }
}

// 1 - tanh(x)^2: below kTanhSeriesEnd from tanh_series_512, above as
// 4 e / (1 + e)^2 with the same e, which keeps its relative precision where
// tanh rounds to 1 (1 - t^2 there is 0 or a few ulp of 1)
__attribute__((target("avx512f,fma"))) inline __m512 sech2_512(__m512 x) {
  const __m512 a = _mm512_abs_ps(x), one = _mm512_set1_ps(1.0f);
  const __m512 e = exp2_512(_mm512_mul_ps(a, _mm512_set1_ps(kTanhExp2)));
  const __m512 d = _mm512_add_ps(one, e);
  const __m512 big = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(4.0f), e), _mm512_mul_ps(d, d));
  const __m512 t = tanh_series_512(a);
  const __m512 small = _mm512_fnmadd_ps(t, t, one);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhSeriesEnd), _CMP_LT_OQ), big, small);
}

// ds[c] *= 1 - tanh(raw[c] inv)^2
__attribute__((target("avx512f,fma"))) void softcap_grad_avx512(const float* raw, int64_t n, float inv, float* ds) {
  const __m512 vi = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 t = tail_mask16(n - i);
    const __m512 g = sech2_512(_mm512_mul_ps(_mm512_maskz_loadu_ps(t, raw + i), vi));
    store16(ds + i, t, _mm512_mul_ps(_mm512_maskz_loadu_ps(t, ds + i), g));
  }
}

// s[c] -= slope |d0 - c| (ALiBi), the distances in 32-bit lanes (the caller
// keeps |d0| + n below 2^31) converted once, as the portable loop converts its
// 64-bit ones
__attribute__((target("avx512f,fma"))) void alibi_row_avx512(float* s, int64_t n, float slope, int64_t d0) {
  const __m512 vs = _mm512_set1_ps(slope);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i d = _mm512_sub_epi32(_mm512_set1_epi32(static_cast<int32_t>(d0)),
                               _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int64_t i = 0; i < n; i += 16, d = _mm512_sub_epi32(d, step)) {
    const __mmask16 t = tail_mask16(n - i);
    const __m512 dist = _mm512_cvtepi32_ps(_mm512_abs_epi32(d));
    store16(s + i, t, _mm512_fnmadd_ps(vs, dist, _mm512_maskz_loadu_ps(t, s + i)));
  }
}

// Philox on 16 counters, as two vectors of 8 with each 32-bit word in the
// low half of a 64-bit lane: vpmuludq then gives the whole 64-bit product,
// whose low half already sits where the next round reads it (the high halves
// of the lanes carry junk that nothing reads), and one shift brings down the
// high half; a three-way xor is one vpternlogd. 12 operations a round for 16
// counters (the packed 32-bit form took 18).
struct Philox8 {
  __m512i c0, c1, c2, c3;
};

__attribute__((target("avx512f"))) inline void philox_round8(Philox8& x, __m512i ma, __m512i mb, __m512i k0,
                                                             __m512i k1) {
  const __m512i pa = _mm512_mul_epu32(x.c0, ma), pb = _mm512_mul_epu32(x.c2, mb);
  x.c0 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pb, 32), x.c1, k0, 0x96);  // hi(B c2) ^ c1 ^ k0
  x.c2 = _mm512_ternarylogic_epi64(_mm512_srli_epi64(pa, 32), x.c3, k1, 0x96);  // hi(A c0) ^ c3 ^ k1
  x.c1 = pb;                                                                    // lo(B c2)
  x.c3 = pa;                                                                    // lo(A c0)
}

// bits l = 0..7 of the words' low halves >= threshold (mask of 8 lanes)
__attribute__((target("avx512f,bmi2"))) inline uint32_t keep_bits8(__m512i w, __m512i thr) {
  return _pext_u32(_mm512_mask_cmpge_epu32_mask(0x5555, w, thr), 0x5555);
}

// NB blocks of 64 columns (16 NB counters) at once: the rounds are a chain
// of dependent multiplies, so independent states are interleaved to keep the
// multiplier busy (one block alone ran at 55 ns, latency-bound).
template <int NB>
__attribute__((target("avx512f,avx512bw,bmi2"))) void philox_keep_avx512(uint64_t seed, uint64_t row, uint64_t group0,
                                                                        uint32_t threshold, uint8_t* keep) {
  const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i r_lo = _mm512_set1_epi64(static_cast<int64_t>(row & 0xFFFFFFFFu));
  const __m512i r_hi = _mm512_set1_epi64(static_cast<int64_t>(row >> 32));
  Philox8 x[2 * NB];
#pragma GCC unroll 8
  for (int i = 0; i < 2 * NB; ++i) {
    const __m512i g = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(group0 + 8 * i)), lane);
    x[i] = Philox8{g, _mm512_srli_epi64(g, 32), r_lo, r_hi};
  }
  const __m512i ma = _mm512_set1_epi64(kPhiloxMulA), mb = _mm512_set1_epi64(kPhiloxMulB);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i vk0 = _mm512_set1_epi64(k0), vk1 = _mm512_set1_epi64(k1);
#pragma GCC unroll 8
    for (int i = 0; i < 2 * NB; ++i) philox_round8(x[i], ma, mb, vk0, vk1);
    k0 += kPhiloxWeylA;
    k1 += kPhiloxWeylB;
  }
  const __m512i thr = _mm512_set1_epi64(threshold);
#pragma GCC unroll 4
  for (int blk = 0; blk < NB; ++blk) {
    const Philox8& lo = x[2 * blk];
    const Philox8& hi = x[2 * blk + 1];
    const uint64_t w0 = keep_bits8(lo.c0, thr) | keep_bits8(hi.c0, thr) << 8;
    const uint64_t w1 = keep_bits8(lo.c1, thr) | keep_bits8(hi.c1, thr) << 8;
    const uint64_t w2 = keep_bits8(lo.c2, thr) | keep_bits8(hi.c2, thr) << 8;
    const uint64_t w3 = keep_bits8(lo.c3, thr) | keep_bits8(hi.c3, thr) << 8;
    // bit 4 * l + w of the 64 columns = bit l of word w's mask
    const uint64_t bits = _pdep_u64(w0, 0x1111111111111111ull) | _pdep_u64(w1, 0x2222222222222222ull) |
                          _pdep_u64(w2, 0x4444444444444444ull) | _pdep_u64(w3, 0x8888888888888888ull);
    _mm512_storeu_si512(keep + 64 * blk, _mm512_maskz_set1_epi8(bits, 1));
  }
}

__attribute__((target("avx512f,avx512bw,bmi2"))) void philox_keep64_avx512(uint64_t seed, uint64_t row, uint64_t group0,
                                                                          uint32_t threshold, int64_t blocks,
                                                                          uint8_t* keep) {
  for (; blocks >= 4; blocks -= 4, group0 += 64, keep += 256) philox_keep_avx512<4>(seed, row, group0, threshold, keep);
  if (blocks >= 2) {
    philox_keep_avx512<2>(seed, row, group0, threshold, keep);
    blocks -= 2, group0 += 32, keep += 128;
  }
  if (blocks == 1) philox_keep_avx512<1>(seed, row, group0, threshold, keep);
}
#endif  // MHA_X86

void philox_keep64_generic(uint64_t seed, uint64_t row, uint64_t group0, uint32_t threshold, int64_t blocks,
                           uint8_t* keep) {
  for (int l = 0; l < 16 * blocks; ++l) {
    const Philox4 r = philox4x32_10(seed, row, group0 + static_cast<uint64_t>(l));
    for (int w = 0; w < 4; ++w) keep[4 * l + w] = r.w[w] >= threshold ? 1 : 0;
  }
}

}  // namespace

void philox_keep64(uint64_t seed, uint64_t row, uint64_t group0, uint32_t threshold, int64_t blocks, uint8_t* keep) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return philox_keep64_avx512(seed, row, group0, threshold, blocks, keep);
#endif
  philox_keep64_generic(seed, row, group0, threshold, blocks, keep);
}

float row_max(const float* x, int64_t n) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return row_max_avx512(x, n);
  if (active_isa() >= Isa::kAvx2) return avx2::row_max(x, n);
#endif
  return row_max_generic(x, n);
}

bool mask_bool(float* s, const uint8_t* keep, int64_t n) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return mask_bool_avx512(s, keep, n), true;
  if (active_isa() >= Isa::kAvx2) return avx2::mask_bool(s, keep, n), true;
#endif
  (void)s, (void)keep, (void)n;
  return false;
}

bool mask_add(float* s, const float* m, int64_t n, float unit) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return mask_add_avx512(s, m, n, unit), true;
  if (active_isa() >= Isa::kAvx2) return avx2::mask_add(s, m, n, unit), true;
#endif
  (void)s, (void)m, (void)n, (void)unit;
  return false;
}

bool alibi_row(float* s, int64_t n, float slope, int64_t d0) {
#if MHA_X86
  const bool fits = d0 > -(int64_t{1} << 30) && d0 < (int64_t{1} << 30) && n < (int64_t{1} << 30);
  if (fits && active_isa() >= Isa::kAvx512) return alibi_row_avx512(s, n, slope, d0), true;
  if (fits && active_isa() >= Isa::kAvx2) return avx2::alibi_row(s, n, slope, d0), true;
#endif
  (void)s, (void)n, (void)slope, (void)d0;
  return false;
}

bool softcap_row(float* s, int64_t n, float cap, float inv) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return softcap_row_avx512(s, n, cap, inv), true;
  if (active_isa() >= Isa::kAvx2) return avx2::softcap_row(s, n, cap, inv), true;
#endif
  (void)s, (void)n, (void)cap, (void)inv;
  return false;
}

bool softcap_grad(const float* raw, int64_t n, float inv, float* ds) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return softcap_grad_avx512(raw, n, inv, ds), true;
  if (active_isa() >= Isa::kAvx2) return avx2::softcap_grad(raw, n, inv, ds), true;
#endif
  (void)raw, (void)n, (void)inv, (void)ds;
  return false;
}

bool mask_add16(float* s, const uint16_t* m, bool bf16, int64_t n, float unit) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512)
    return (bf16 ? mask_add16_avx512<true>(s, m, n, unit) : mask_add16_avx512<false>(s, m, n, unit)), true;
  if (active_isa() >= Isa::kAvx2) return avx2::mask_add16(s, m, bf16, n, unit), true;
#endif
  (void)s, (void)m, (void)bf16, (void)n, (void)unit;
  return false;
}

float exp2_sub_sum_bf16(const float* x, int64_t n, float mul, float sub, uint16_t* dst, int64_t n_pad) {
#if MHA_X86
  return exp2_sub_sum_bf16_avx512(x, n, mul, sub, dst, n_pad);
#else
  (void)x, (void)n, (void)mul, (void)sub, (void)dst, (void)n_pad;
  return 0.f;
#endif
}

float exp2_sub_sum(float* x, int64_t n, float mul, float sub) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return exp2_sub_sum_avx512(x, n, mul, sub);
  if (active_isa() >= Isa::kAvx2) return avx2::exp2_sub_sum(x, n, mul, sub);
#endif
  return exp2_sub_sum_generic(x, n, mul, sub);
}

}  // namespace cpu
}  // namespace mha_ext
