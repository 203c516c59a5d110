// Row primitives of the decode kernel (forward_cpu.cpp): scores of a few
// query rows as dot products with each key row, P V with bfloat16 / float16
// value rows widened in registers, and such rows widened to float; on the
// run-time instruction-set choice of gemm_cpu.h.
#include "gemm_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "x86_intrinsics.h"

#include <algorithm>

namespace mha_ext {
namespace cpu {
namespace {

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
__attribute__((target("avx512f"))) inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// Blocks of 16 keys: each key row is loaded for up to four query rows at a
// time, whose products accumulate in zmm lanes and are summed at the end; the
// 16 sums gather in a register and go to s in one store. The block's rows stay
// in L1 for the next four query rows. The key rows kAhead keys on are
// prefetched: without it, 3 to 8 query rows read K at 8-10 GB/s on one core
// (AMD EPYC, float32, E = 128), with it 24-31.
constexpr int64_t kAhead = 8;

// The four rows' dot products of key t of a block (the lanes of a0 .. a3
// summed) into lane t of s0 .. s3; the first rr rows are real.
__attribute__((target("avx512f"))) inline void gather_sums(int64_t t, int64_t rr, __m512 a0, __m512 a1, __m512 a2,
                                                           __m512 a3, __m512& s0, __m512& s1, __m512& s2, __m512& s3) {
  const __mmask16 at = __mmask16(1u << t);
  s0 = _mm512_mask_mov_ps(s0, at, _mm512_set1_ps(_mm512_reduce_add_ps(a0)));
  if (rr > 1) s1 = _mm512_mask_mov_ps(s1, at, _mm512_set1_ps(_mm512_reduce_add_ps(a1)));
  if (rr > 2) s2 = _mm512_mask_mov_ps(s2, at, _mm512_set1_ps(_mm512_reduce_add_ps(a2)));
  if (rr > 3) s3 = _mm512_mask_mov_ps(s3, at, _mm512_set1_ps(_mm512_reduce_add_ps(a3)));
}

// The block's nc sums of rr rows into s (row stride lds), one store a row.
__attribute__((target("avx512f"))) inline void store_sums(float* sc, int64_t lds, int64_t nc, int64_t rr, __m512 s0,
                                                          __m512 s1, __m512 s2, __m512 s3) {
  const __mmask16 m = lanes(nc);
  _mm512_mask_storeu_ps(sc, m, s0);
  if (rr > 1) _mm512_mask_storeu_ps(sc + lds, m, s1);
  if (rr > 2) _mm512_mask_storeu_ps(sc + 2 * lds, m, s2);
  if (rr > 3) _mm512_mask_storeu_ps(sc + 3 * lds, m, s3);
}

// 16 key elements as floats: float32 as they are, bfloat16 / float16 widened
// in the register (no widened copy of the tile goes through the caches).
template <int kKind>  // 0: float32, 1: bfloat16, 2: float16
__attribute__((target("avx512f"))) inline __m512 load16(const void* p, int64_t e, __mmask16 m) {
  if constexpr (kKind == 0) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + e);
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p) + e;
    __m256i x;
    if (m == __mmask16(0xFFFF)) {
      x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    } else {
      alignas(32) uint16_t tmp[16] = {};
      for (int i = 0; i < 16; ++i)
        if (m >> i & 1) tmp[i] = h[i];
      x = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
    }
    if constexpr (kKind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
    return _mm512_cvtph_ps(x);
  }
}

template <int kKind, typename K>
__attribute__((target("avx512f"))) void dot_rows_avx512(const float* q, int64_t R, int64_t E, const K* k,
                                                        int64_t ldk, int64_t n, float* s, int64_t lds) {
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t nc = n - c0 < 16 ? n - c0 : 16;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t rr = R - r0 < 4 ? R - r0 : 4;
      const float* q0 = q + r0 * E;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t t = 0; t < nc; ++t) {
        const int64_t c = c0 + t;
        const K* kr = k + c * ldk;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < E; e += 16) {
          const __mmask16 m = lanes(E - e);
          if (r0 == 0 && c + kAhead < n && (e * sizeof(K)) % 64 == 0)
            _mm_prefetch(reinterpret_cast<const char*>(kr + kAhead * ldk + e), _MM_HINT_T0);
          const __m512 kv = load16<kKind>(kr, e, m);
          a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q0 + e), kv, a0);
          if (rr > 1) a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q0 + E + e), kv, a1);
          if (rr > 2) a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q0 + 2 * E + e), kv, a2);
          if (rr > 3) a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q0 + 3 * E + e), kv, a3);
        }
        gather_sums(t, rr, a0, a1, a2, a3, s0, s1, s2, s3);
      }
      store_sums(s + r0 * lds + c0, lds, nc, rr, s0, s1, s2, s3);
    }
  }
}

// bfloat16 query and key rows multiplied in pairs by AVX512-BF16's
// vdpbf16ps (products exact in float, summed in float): 32 columns an
// instruction and no widening at all.
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void dot_rows_bf16_dp(
    const uint16_t* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s, int64_t lds) {
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t nc = n - c0 < 16 ? n - c0 : 16;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t rr = R - r0 < 4 ? R - r0 : 4;
      const uint16_t* q0 = q + r0 * E;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t t = 0; t < nc; ++t) {
        const int64_t c = c0 + t;
        const uint16_t* kr = k + c * ldk;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < E; e += 32) {
          const __mmask32 m = E - e >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (E - e)) - 1);
          if (r0 == 0 && c + kAhead < n) _mm_prefetch(reinterpret_cast<const char*>(kr + kAhead * ldk + e), _MM_HINT_T0);
          const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(m, kr + e);
          a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, q0 + e), kv);
          if (rr > 1) a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, q0 + E + e), kv);
          if (rr > 2) a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_maskz_loadu_epi16(m, q0 + 2 * E + e), kv);
          if (rr > 3) a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_maskz_loadu_epi16(m, q0 + 3 * E + e), kv);
        }
        gather_sums(t, rr, a0, a1, a2, a3, s0, s1, s2, s3);
      }
      store_sums(s + r0 * lds + c0, lds, nc, rr, s0, s1, s2, s3);
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

__attribute__((target("avx512f,avx512bw"))) inline __mmask32 lanes32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1);
}

// 64 columns (cols of them real) of a bfloat16 / float16 row widened into
// four registers. bfloat16 widens by pairs of columns (the even ones shifted
// up, the odd ones masked: one instruction for 16 columns), which leaves the
// even columns of each 32 in one register and the odd ones in the next;
// acc_rows_16_avx512 interleaves them back on the way out.
template <int kKind>  // 1: bfloat16, 2: float16
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void widen64(const uint16_t* v, int64_t cols, __m512* w) {
  for (int h = 0; h < 2; ++h) {
    const __m512i x = _mm512_maskz_loadu_epi16(lanes32(cols - 32 * h), v + 32 * h);
    if constexpr (kKind == 1) {
      w[2 * h] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      w[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    } else {
      w[2 * h] = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
      w[2 * h + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1));
    }
  }
}

// O (R x Ev) += P (R x n) V (n x Ev) with V's bfloat16 / float16 rows widened
// in registers: 64 columns of up to 4 rows at a time in 16 accumulators, each
// sum in j order; the value rows kAheadRows on prefetched.
constexpr int64_t kAheadRows = 8;
template <int kKind>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void acc_rows_16_avx512(const float* p, int64_t R, int64_t n,
                                                                             int64_t ldp, const uint16_t* v,
                                                                             int64_t ldv, int64_t Ev, float* o,
                                                                             int64_t ldo) {
  for (int64_t c0 = 0; c0 < Ev; c0 += 64) {
    const int64_t nc = std::min<int64_t>(64, Ev - c0);
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t rr = std::min<int64_t>(4, R - r0);
      const float* pr = p + r0 * ldp;
      __m512 acc[4][4];
      for (int r = 0; r < 4; ++r)
        for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        if (r0 == 0 && c0 == 0 && j + kAheadRows < n)
          for (int64_t b = 0; b < Ev * 2; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(v + (j + kAheadRows) * ldv) + b, _MM_HINT_T0);
        __m512 w[4];
        widen64<kKind>(v + j * ldv + c0, nc, w);
        for (int r = 0; r < rr; ++r) {
          const __m512 pb = _mm512_set1_ps(pr[r * ldp + j]);
          for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_fmadd_ps(pb, w[x], acc[r][x]);
        }
      }
      for (int r = 0; r < rr; ++r) {
        float* orow = o + (r0 + r) * ldo + c0;
        for (int h = 0; h < 2; ++h) {
          __m512 lo = acc[r][2 * h], hi = acc[r][2 * h + 1];
          if constexpr (kKind == 1) {  // even / odd columns back to 0 .. 15 and 16 .. 31
            const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i ih = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
            const __m512 even = lo;
            lo = _mm512_permutex2var_ps(even, il, hi);
            hi = _mm512_permutex2var_ps(even, ih, hi);
          }
          const __mmask16 ml = lanes(nc - 32 * h), mh = lanes(nc - 32 * h - 16);
          float* oc = orow + 32 * h;
          if (ml) _mm512_mask_storeu_ps(oc, ml, _mm512_add_ps(_mm512_maskz_loadu_ps(ml, oc), lo));
          if (mh) _mm512_mask_storeu_ps(oc + 16, mh, _mm512_add_ps(_mm512_maskz_loadu_ps(mh, oc + 16), hi));
        }
      }
    }
  }
}
#endif  // MHA_X86

}  // namespace

void dot_rows(const float* q, int64_t R, int64_t E, const float* k, int64_t ldk, int64_t n, float* s, int64_t lds) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return dot_rows_avx512<0>(q, R, E, k, ldk, n, s, lds);
#endif
  dot_rows_generic(q, R, E, k, ldk, n, s, lds);
}

void dot_rows_16(const float* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                 int64_t lds, bool bf16) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512)
    return bf16 ? dot_rows_avx512<1>(q, R, E, k, ldk, n, s, lds) : dot_rows_avx512<2>(q, R, E, k, ldk, n, s, lds);
#endif
  dot_rows_16_generic(q, R, E, k, ldk, n, s, lds, bf16);
}

bool dot_rows_bf16(const uint16_t* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                   int64_t lds) {
#if MHA_X86
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  if (active_isa() >= Isa::kAvx512 && has_bf16) {
    dot_rows_bf16_dp(q, R, E, k, ldk, n, s, lds);
    return true;
  }
#endif
  (void)q, (void)R, (void)E, (void)k, (void)ldk, (void)n, (void)s, (void)lds;
  return false;
}

bool acc_rows_16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv, int64_t Ev,
                 float* o, int64_t ldo, bool bf16) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) {
    bf16 ? acc_rows_16_avx512<1>(p, R, n, ldp, v, ldv, Ev, o, ldo) : acc_rows_16_avx512<2>(p, R, n, ldp, v, ldv, Ev, o, ldo);
    return true;
  }
#endif
  (void)p, (void)R, (void)n, (void)ldp, (void)v, (void)ldv, (void)Ev, (void)o, (void)ldo, (void)bf16;
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
