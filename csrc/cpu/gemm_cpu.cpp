#include "gemm_cpu.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define MHA_X86 1
#include <immintrin.h>
#else
#define MHA_X86 0
#endif

namespace mha_ext {
namespace cpu {
namespace {

template <typename T>
void gemm_generic(int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs,
                  const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  // Row of C at a time, k outer so the inner loop streams a row of B.
  constexpr int64_t kCols = 256;
  T acc[kCols];
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j0 = 0; j0 < N; j0 += kCols) {
      const int64_t nb = N - j0 < kCols ? N - j0 : kCols;
      for (int64_t j = 0; j < nb; ++j) acc[j] = T(0);
      for (int64_t k = 0; k < K; ++k) {
        const T av = a[i * a_rs + k * a_cs];
        const T* br = b + k * ldb + j0;
        for (int64_t j = 0; j < nb; ++j) acc[j] += av * br[j];
      }
      T* cr = c + i * ldc + j0;
      if (beta == T(0)) {
        for (int64_t j = 0; j < nb; ++j) cr[j] = alpha * acc[j];
      } else {
        for (int64_t j = 0; j < nb; ++j) cr[j] = alpha * acc[j] + beta * cr[j];
      }
    }
  }
}

#if MHA_X86

// ---- AVX-512: MR rows x 32 columns, 2 * MR zmm accumulators -----------------
template <int MR>
__attribute__((target("avx512f,fma"))) void micro_avx512(int64_t K, int64_t nb, float alpha,
                                                         const float* a, int64_t a_rs,
                                                         int64_t a_cs, const float* b,
                                                         int64_t ldb, float beta, float* c,
                                                         int64_t ldc) {
  const __mmask16 m0 = nb >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nb) - 1);
  const __mmask16 m1 = nb >= 32 ? __mmask16(0xFFFF) : (nb > 16 ? __mmask16((1u << (nb - 16)) - 1) : __mmask16(0));
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* br = b + k * ldb;
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, br);
    const __m512 b1 = _mm512_maskz_loadu_ps(m1, br + 16);
    const float* ak = a + k * a_cs;
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(ak[r * a_rs]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    __m512 o0 = _mm512_mul_ps(va, acc0[r]), o1 = _mm512_mul_ps(va, acc1[r]);
    if (beta != 0.f) {
      o0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cr), o0);
      o1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16), o1);
    }
    _mm512_mask_storeu_ps(cr, m0, o0);
    _mm512_mask_storeu_ps(cr + 16, m1, o1);
  }
}

__attribute__((target("avx512f,fma"))) void gemm_avx512(int64_t M, int64_t N, int64_t K,
                                                        float alpha, const float* a, int64_t a_rs,
                                                        int64_t a_cs, const float* b, int64_t ldb,
                                                        float beta, float* c, int64_t ldc) {
  constexpr int64_t kMR = 6, kNR = 32;
  for (int64_t j = 0; j < N; j += kNR) {
    const int64_t nb = N - j < kNR ? N - j : kNR;
    int64_t i = 0;
    for (; i + kMR <= M; i += kMR)
      micro_avx512<kMR>(K, nb, alpha, a + i * a_rs, a_rs, a_cs, b + j, ldb, beta, c + i * ldc + j, ldc);
    const float* ai = a + i * a_rs;
    float* ci = c + i * ldc + j;
    switch (M - i) {
      case 5: micro_avx512<5>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 4: micro_avx512<4>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 3: micro_avx512<3>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 2: micro_avx512<2>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 1: micro_avx512<1>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      default: break;
    }
  }
}

// ---- AVX2 + FMA: MR rows x 16 columns, 2 * MR ymm accumulators --------------
__attribute__((target("avx2,fma"))) inline __m256i tail_mask8(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

template <int MR>
__attribute__((target("avx2,fma"))) void micro_avx2(int64_t K, int64_t nb, float alpha,
                                                    const float* a, int64_t a_rs, int64_t a_cs,
                                                    const float* b, int64_t ldb, float beta,
                                                    float* c, int64_t ldc) {
  const __m256i m0 = tail_mask8(nb), m1 = tail_mask8(nb - 8);
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* br = b + k * ldb;
    const __m256 b0 = _mm256_maskload_ps(br, m0);
    const __m256 b1 = _mm256_maskload_ps(br + 8, m1);
    const float* ak = a + k * a_cs;
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(ak + r * a_rs);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    __m256 o0 = _mm256_mul_ps(va, acc0[r]), o1 = _mm256_mul_ps(va, acc1[r]);
    if (beta != 0.f) {
      o0 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cr, m0), o0);
      o1 = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cr + 8, m1), o1);
    }
    _mm256_maskstore_ps(cr, m0, o0);
    _mm256_maskstore_ps(cr + 8, m1, o1);
  }
}

__attribute__((target("avx2,fma"))) void gemm_avx2(int64_t M, int64_t N, int64_t K, float alpha,
                                                   const float* a, int64_t a_rs, int64_t a_cs,
                                                   const float* b, int64_t ldb, float beta,
                                                   float* c, int64_t ldc) {
  constexpr int64_t kMR = 4, kNR = 16;
  for (int64_t j = 0; j < N; j += kNR) {
    const int64_t nb = N - j < kNR ? N - j : kNR;
    int64_t i = 0;
    for (; i + kMR <= M; i += kMR)
      micro_avx2<kMR>(K, nb, alpha, a + i * a_rs, a_rs, a_cs, b + j, ldb, beta, c + i * ldc + j, ldc);
    const float* ai = a + i * a_rs;
    float* ci = c + i * ldc + j;
    switch (M - i) {
      case 3: micro_avx2<3>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 2: micro_avx2<2>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 1: micro_avx2<1>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      default: break;
    }
  }
}

#endif  // MHA_X86

Isa detect_isa() {
  Isa best = Isa::kGeneric;
#if MHA_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f")) best = Isa::kAvx512;
#endif
  if (const char* env = std::getenv("MHA_EXT_CPU_ISA")) {
    Isa want = best;
    if (std::strcmp(env, "generic") == 0) want = Isa::kGeneric;
    if (std::strcmp(env, "avx2") == 0) want = Isa::kAvx2;
    if (std::strcmp(env, "avx512") == 0) want = Isa::kAvx512;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;  // never above the CPU
  }
  return best;
}

}  // namespace

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t a_rs, int64_t a_cs,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
#if MHA_X86
  switch (active_isa()) {
    case Isa::kAvx512: return gemm_avx512(M, N, K, alpha, a, a_rs, a_cs, b, ldb, beta, c, ldc);
    case Isa::kAvx2: return gemm_avx2(M, N, K, alpha, a, a_rs, a_cs, b, ldb, beta, c, ldc);
    default: break;
  }
#endif
  gemm_generic<float>(M, N, K, alpha, a, a_rs, a_cs, b, ldb, beta, c, ldc);
}

void gemm(int64_t M, int64_t N, int64_t K, double alpha, const double* a, int64_t a_rs,
          int64_t a_cs, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  gemm_generic<double>(M, N, K, alpha, a, a_rs, a_cs, b, ldb, beta, c, ldc);
}

}  // namespace cpu
}  // namespace mha_ext
