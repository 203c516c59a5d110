// The softmax rows of the AVX2 + FMA path (rows_avx2.h): the row maximum,
// the exponentials and their sum, the boolean and float masks, the softcap,
// ALiBi, 8 lanes a register, the same arithmetic as softmax_cpu.cpp's AVX-512
// routines in the same orders where the lanes allow. Before them an AVX2-only
// CPU ran the softmax in scalar C++.
#include "rows_avx2.h"

#include "x86_intrinsics.h"

#if MHA_X86
#include <cstring>
#include <limits>

namespace mha_ext {
namespace cpu {
namespace avx2 {
namespace {
MHA_AVX2_INLINE float hsum(__m256 x) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// 2^x as softmax_cpu.cpp's exp2_scalar and exp2_512: the degree-6 polynomial
// by fused multiply-adds, 2^n put in the exponent bits; 0 below kExp2Lo,
// NaN through.
MHA_AVX2_INLINE __m256 exp2_256(__m256 x) {
  // max / min return their second operand when either is NaN: a NaN lane
  // computes on kExp2Lo and is put back at the end
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExp2Lo)), _mm256_set1_ps(kExp2Hi));
  const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(xc, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP6), r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n, n in [-125, 128]: n = 128 gives the bits of inf
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)),
                                 _mm256_cmp_ps(x, _mm256_set1_ps(kExp2Lo), _CMP_NLT_UQ));  // x >= lo or NaN
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// tanh's series on a >= 0, and tanh, as softmax_cpu.cpp's tanh_series_512 / tanh_512
MHA_AVX2_INLINE __m256 tanh_series_256(__m256 a) {
  const __m256 a2 = _mm256_mul_ps(a, a);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kT13), a2, _mm256_set1_ps(kT11));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(kT9));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(kT7));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(kT5));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(kT3));
  return _mm256_fmadd_ps(_mm256_mul_ps(a, a2), p, a);
}

MHA_AVX2_INLINE __m256 tanh_256(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  const __m256 e = exp2_256(_mm256_mul_ps(a, _mm256_set1_ps(kTanhExp2)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 small = tanh_series_256(a);
  const __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSeriesEnd), _CMP_LT_OQ));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign));  // the sign bit of x on t (t >= 0 or NaN)
}

// 1 - tanh(x)^2 as softmax_cpu.cpp's sech2_512
MHA_AVX2_INLINE __m256 sech2_256(__m256 x) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), one = _mm256_set1_ps(1.0f);
  const __m256 e = exp2_256(_mm256_mul_ps(a, _mm256_set1_ps(kTanhExp2)));
  const __m256 d = _mm256_add_ps(one, e);
  const __m256 big = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(4.0f), e), _mm256_mul_ps(d, d));
  const __m256 t = tanh_series_256(a);
  const __m256 small = _mm256_fnmadd_ps(t, t, one);
  return _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(kTanhSeriesEnd), _CMP_LT_OQ));
}

// fl(mul x), kept an instruction of its own: the compiler would otherwise
// fuse it with the difference that follows (-ffp-contract), and the callers
// need the product rounded (softmax_cpu.cpp, mul_rounded)
MHA_AVX2_INLINE __m256 mul_rounded(__m256 a, __m256 b) {
  __m256 y = _mm256_mul_ps(a, b);
  asm("" : "+x"(y));
  return y;
}

// unit m clamped to [lo, hi], an infinite m as it is (max / min return
// their second operand when either is NaN: NaN stays)
MHA_AVX2_INLINE __m256 mask_units(__m256 m, __m256 unit, __m256 lo, __m256 hi) {
  const __m256 uc = _mm256_min_ps(hi, _mm256_max_ps(lo, mul_rounded(unit, m)));
  const __m256 inf = _mm256_or_ps(_mm256_cmp_ps(m, lo, _CMP_LT_OQ), _mm256_cmp_ps(m, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(uc, m, inf);
}
}  // namespace

MHA_AVX2 float row_max(const float* x, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = neg_inf, m1 = neg_inf;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // max(x, m) is m where x is NaN: NaN ignored
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
  }
  for (; i < n; i += 8) {
    const __m256i t = lanes(n - i);
    m0 = _mm256_max_ps(_mm256_blendv_ps(neg_inf, _mm256_maskload_ps(x + i, t), _mm256_castsi256_ps(t)), m0);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_max_ps(m0, m1));
  float m = t[0];
  for (int k = 1; k < 8; ++k) m = t[k] > m ? t[k] : m;
  return m;
}

MHA_AVX2 float exp2_sub_sum(float* x, int64_t n, float mul, float sub) {
  const __m256 vs = _mm256_set1_ps(sub), vm = _mm256_set1_ps(mul);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 y0 = exp2_256(_mm256_sub_ps(mul_rounded(vm, _mm256_loadu_ps(x + i)), vs));
    const __m256 y1 = exp2_256(_mm256_sub_ps(mul_rounded(vm, _mm256_loadu_ps(x + i + 8)), vs));
    _mm256_storeu_ps(x + i, y0);
    _mm256_storeu_ps(x + i + 8, y1);
    s0 = _mm256_add_ps(s0, y0);
    s1 = _mm256_add_ps(s1, y1);
  }
  for (; i < n; i += 8) {
    const __m256i t = lanes(n - i);
    const __m256 y = exp2_256(_mm256_sub_ps(mul_rounded(vm, _mm256_maskload_ps(x + i, t)), vs));
    _mm256_maskstore_ps(x + i, t, y);
    s0 = _mm256_add_ps(s0, _mm256_and_ps(y, _mm256_castsi256_ps(t)));
  }
  return hsum(_mm256_add_ps(s0, s1));
}

MHA_AVX2 void mask_bool(float* s, const uint8_t* keep, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int64_t bytes;
    std::memcpy(&bytes, keep + i, sizeof(bytes));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
    const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
    _mm256_storeu_ps(s + i, _mm256_blendv_ps(_mm256_loadu_ps(s + i), neg_inf, hidden));
  }
  for (; i < n; ++i) s[i] = keep[i] ? s[i] : -std::numeric_limits<float>::infinity();
}

// as mask_add_avx512 (softmax_cpu.cpp): unit m clamped to the finite range, an
// infinite m as it is, NaN through
MHA_AVX2 void mask_add(float* s, const float* m, int64_t n, float unit) {
  const __m256 u = _mm256_set1_ps(unit), hi = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::max());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(s + i), mask_units(_mm256_loadu_ps(m + i), u, lo, hi)));
  if (i < n) {  // (masked loads and stores only here: on AMD EPYC (Zen 1) they cost 3x in the GEMM)
    const __m256i t = lanes(n - i);
    _mm256_maskstore_ps(s + i, t,
                        _mm256_add_ps(_mm256_maskload_ps(s + i, t), mask_units(_mm256_maskload_ps(m + i, t), u, lo, hi)));
  }
}

// as mask_add, for a bfloat16 or float16 mask (its bits: bfloat16 widened by
// a shift, float16 by F16C); the ragged end through a zeroed copy
MHA_AVX2 void mask_add16(float* s, const uint16_t* m, bool bf16, int64_t n, float unit) {
  const __m256 u = _mm256_set1_ps(unit), hi = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::max());
  for (int64_t i = 0; i < n; i += 8) {
    uint16_t tail[8] = {};
    const uint16_t* src = m + i;
    if (n - i < 8) {
      std::memcpy(tail, src, static_cast<size_t>(n - i) * sizeof(uint16_t));
      src = tail;
    }
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m256 mv =
        bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
    const __m256 add = mask_units(mv, u, lo, hi);
    if (n - i >= 8) {
      _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(s + i), add));
    } else {
      const __m256i t = lanes(n - i);
      _mm256_maskstore_ps(s + i, t, _mm256_add_ps(_mm256_maskload_ps(s + i, t), add));
    }
  }
}

MHA_AVX2 void alibi_row(float* s, int64_t n, float slope, int64_t d0) {
  const __m256 vs = _mm256_set1_ps(slope);
  const __m256i step = _mm256_set1_epi32(8);
  __m256i d =
      _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int32_t>(d0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8, d = _mm256_sub_epi32(d, step))
    _mm256_storeu_ps(s + i, _mm256_fnmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_abs_epi32(d)), _mm256_loadu_ps(s + i)));
  if (i < n) {
    const __m256i t = lanes(n - i);
    _mm256_maskstore_ps(s + i, t,
                        _mm256_fnmadd_ps(vs, _mm256_cvtepi32_ps(_mm256_abs_epi32(d)), _mm256_maskload_ps(s + i, t)));
  }
}

MHA_AVX2 void softcap_row(float* s, int64_t n, float cap, float inv) {
  const __m256 vc = _mm256_set1_ps(cap), vi = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, _mm256_mul_ps(vc, tanh_256(_mm256_mul_ps(_mm256_loadu_ps(s + i), vi))));
  if (i < n) {
    const __m256i t = lanes(n - i);
    _mm256_maskstore_ps(s + i, t, _mm256_mul_ps(vc, tanh_256(_mm256_mul_ps(_mm256_maskload_ps(s + i, t), vi))));
  }
}

MHA_AVX2 void softcap_grad(const float* raw, int64_t n, float inv, float* ds) {
  const __m256 vi = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(ds + i,
                     _mm256_mul_ps(_mm256_loadu_ps(ds + i), sech2_256(_mm256_mul_ps(_mm256_loadu_ps(raw + i), vi))));
  if (i < n) {
    const __m256i t = lanes(n - i);
    const __m256 g = sech2_256(_mm256_mul_ps(_mm256_maskload_ps(raw + i, t), vi));
    _mm256_maskstore_ps(ds + i, t, _mm256_mul_ps(_mm256_maskload_ps(ds + i, t), g));
  }
}

}  // namespace avx2
}  // namespace cpu
}  // namespace mha_ext
#endif  // MHA_X86
