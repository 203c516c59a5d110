// Row primitives of the decode kernel (forward_cpu.cpp): scores of a few
// query rows as dot products with each key row, and bfloat16 / float16 rows
// widened to float; on the run-time instruction-set choice of gemm_cpu.h.
#include "gemm_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "x86_intrinsics.h"

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
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
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
