// The tile GEMM of gemm_cpu.h (AVX-512, AVX2 + FMA and portable micro-
// kernels), the 16 x 16 float transpose, and the run-time choice of the
// instruction set. The softmax rows are in softmax_cpu.cpp.
#include "gemm_cpu.h"

#include <cstdlib>
#include <cstring>

#include "x86_intrinsics.h"

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

// ---- AVX-512: MR rows x (16 * NV) columns, MR * NV zmm accumulators -------
template <int MR, int NV>
__attribute__((target("avx512f,fma"))) void micro_avx512(int64_t K, int64_t nb, float alpha,
                                                         const float* a, int64_t a_rs,
                                                         int64_t a_cs, const float* b,
                                                         int64_t ldb, float beta, float* c,
                                                         int64_t ldc) {
  __mmask16 mask[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const int64_t left = nb - 16 * v;
    mask[v] = left >= 16 ? __mmask16(0xFFFF) : (left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0));
  }
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* br = b + k * ldb;
    __m512 bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_maskz_loadu_ps(mask[v], br + 16 * v);
    const float* ak = a + k * a_cs;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(ak[r * a_rs]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      __m512 o = _mm512_mul_ps(va, acc[r][v]);
      if (beta != 0.f) o = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask[v], cr + 16 * v), o);
      _mm512_mask_storeu_ps(cr + 16 * v, mask[v], o);
    }
  }
}

template <int NV, int MR>
__attribute__((target("avx512f,fma"))) void rows_avx512(int64_t M, int64_t K, int64_t nb,
                                                        float alpha, const float* a, int64_t a_rs,
                                                        int64_t a_cs, const float* b, int64_t ldb,
                                                        float beta, float* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + MR <= M; i += MR)
    micro_avx512<MR, NV>(K, nb, alpha, a + i * a_rs, a_rs, a_cs, b, ldb, beta, c + i * ldc, ldc);
  if (i == M) return;
  const float* ai = a + i * a_rs;
  float* ci = c + i * ldc;
  switch (M - i) {  // MR <= 8
    case 7: return micro_avx512<7, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
    case 6: return micro_avx512<6, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
    case 5: return micro_avx512<5, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
    case 4: return micro_avx512<4, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
    case 3: return micro_avx512<3, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
    case 2: return micro_avx512<2, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
    default: return micro_avx512<1, NV>(K, nb, alpha, ai, a_rs, a_cs, b, ldb, beta, ci, ldc);
  }
}

#ifndef MHA_AVX512_MR
#define MHA_AVX512_MR 6
#define MHA_AVX512_NV 4
#endif
#ifndef MHA_AVX512_KC
#define MHA_AVX512_KC 128
#endif

__attribute__((target("avx512f,fma"))) void gemm_avx512(int64_t M, int64_t N, int64_t K,
                                                        float alpha, const float* a, int64_t a_rs,
                                                        int64_t a_cs, const float* b, int64_t ldb,
                                                        float beta, float* c, int64_t ldc) {
  constexpr int kMR = MHA_AVX512_MR, kNV = MHA_AVX512_NV, kNR = 16 * kNV;
  // K in blocks of kKC: the B panel a strip reads (kKC x kNR floats, 32 KiB)
  // stays in the 48 KiB L1 while every row group of A passes over it. 128
  // rather than 64 halves the C reloads of O += P V and dQ += dS K (K = 256);
  // in-process A/B, 1 thread, forward+backward: 12x1024x64 133.0 vs 137.4 ms,
  // 2x4x512x128 45.3 vs 47.8 ms.
  constexpr int64_t kKC = MHA_AVX512_KC;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = K - k0 < kKC ? K - k0 : kKC;
    const float* ak = a + k0 * a_cs;
    const float* bk = b + k0 * ldb;
    const float bt = k0 == 0 ? beta : 1.f;
    int64_t j = 0;
    for (; j + kNR <= N; j += kNR)
      rows_avx512<kNV, kMR>(M, kc, kNR, alpha, ak, a_rs, a_cs, bk + j, ldb, bt, c + j, ldc);
    for (; j < N; j += 32) {  // ragged right edge: strips of at most 32 columns
      const int64_t nb = N - j < 32 ? N - j : 32;
      rows_avx512<2, 8>(M, kc, nb, alpha, ak, a_rs, a_cs, bk + j, ldb, bt, c + j, ldc);
    }
  }
}

// ---- AVX2 + FMA: MR rows x 16 columns, 2 * MR ymm accumulators --------------
// 6 rows (12 accumulators, two B vectors and a broadcast: 15 of the 16 ymm
// registers); full strips of 16 columns load and store unmasked, the ragged
// right edge masked. On an AMD EPYC of family 23 (Zen 1; bench/gemm_tiles.cpp,
// one core) a 4-row kernel with masked loads everywhere ran the forward's
// tiles at 9-12 GFLOP/s, no faster than the portable loop; unmasked 28-35,
// with 6 rows 31-38.
#ifndef MHA_AVX2_MR
#define MHA_AVX2_MR 6
#endif
__attribute__((target("avx2,fma"))) inline __m256i tail_mask8(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

template <int MR, bool kEdge>
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
    const __m256 b0 = kEdge ? _mm256_maskload_ps(br, m0) : _mm256_loadu_ps(br);
    const __m256 b1 = kEdge ? _mm256_maskload_ps(br + 8, m1) : _mm256_loadu_ps(br + 8);
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
      o0 = _mm256_fmadd_ps(vb, kEdge ? _mm256_maskload_ps(cr, m0) : _mm256_loadu_ps(cr), o0);
      o1 = _mm256_fmadd_ps(vb, kEdge ? _mm256_maskload_ps(cr + 8, m1) : _mm256_loadu_ps(cr + 8), o1);
    }
    if (kEdge) {
      _mm256_maskstore_ps(cr, m0, o0);
      _mm256_maskstore_ps(cr + 8, m1, o1);
    } else {
      _mm256_storeu_ps(cr, o0);
      _mm256_storeu_ps(cr + 8, o1);
    }
  }
}

template <int MR>
__attribute__((target("avx2,fma"))) inline void strip_avx2(int64_t K, int64_t nb, float alpha, const float* a,
                                                           int64_t a_rs, int64_t a_cs, const float* b, int64_t ldb,
                                                           float beta, float* c, int64_t ldc) {
  if (nb == 16)
    micro_avx2<MR, false>(K, nb, alpha, a, a_rs, a_cs, b, ldb, beta, c, ldc);
  else
    micro_avx2<MR, true>(K, nb, alpha, a, a_rs, a_cs, b, ldb, beta, c, ldc);
}

__attribute__((target("avx2,fma"))) void gemm_avx2(int64_t M, int64_t N, int64_t K, float alpha,
                                                   const float* a, int64_t a_rs, int64_t a_cs,
                                                   const float* b, int64_t ldb, float beta,
                                                   float* c, int64_t ldc) {
  constexpr int64_t kMR = MHA_AVX2_MR, kNR = 16;
  for (int64_t j = 0; j < N; j += kNR) {
    const int64_t nb = N - j < kNR ? N - j : kNR;
    int64_t i = 0;
    for (; i + kMR <= M; i += kMR)
      strip_avx2<kMR>(K, nb, alpha, a + i * a_rs, a_rs, a_cs, b + j, ldb, beta, c + i * ldc + j, ldc);
    const float* ai = a + i * a_rs;
    float* ci = c + i * ldc + j;
    switch (M - i) {
      case 5: strip_avx2<5>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 4: strip_avx2<4>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 3: strip_avx2<3>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 2: strip_avx2<2>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      case 1: strip_avx2<1>(K, nb, alpha, ai, a_rs, a_cs, b + j, ldb, beta, ci, ldc); break;
      default: break;
    }
  }
}

// 16 x 16 blocks transposed in registers (unpack / shuffle network).
__attribute__((target("avx512f"))) void transpose_avx512(const float* src, int64_t ld,
                                                         int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  int64_t r0 = 0;
  for (; r0 + 16 <= rows; r0 += 16) {
    int64_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) {
      __m512 t[16], u[16];
      for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_ps(src + (r0 + i) * ld + c0);
      for (int i = 0; i < 16; i += 2) {
        u[i] = _mm512_unpacklo_ps(t[i], t[i + 1]);
        u[i + 1] = _mm512_unpackhi_ps(t[i], t[i + 1]);
      }
      for (int i = 0; i < 16; i += 4) {
        t[i] = _mm512_shuffle_ps(u[i], u[i + 2], 0x44);
        t[i + 1] = _mm512_shuffle_ps(u[i], u[i + 2], 0xEE);
        t[i + 2] = _mm512_shuffle_ps(u[i + 1], u[i + 3], 0x44);
        t[i + 3] = _mm512_shuffle_ps(u[i + 1], u[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        u[i] = _mm512_shuffle_f32x4(t[i], t[i + 4], 0x88);
        u[i + 4] = _mm512_shuffle_f32x4(t[i], t[i + 4], 0xDD);
        u[i + 8] = _mm512_shuffle_f32x4(t[i + 8], t[i + 12], 0x88);
        u[i + 12] = _mm512_shuffle_f32x4(t[i + 8], t[i + 12], 0xDD);
      }
      for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[i + 8], 0x88);
        t[i + 8] = _mm512_shuffle_f32x4(u[i], u[i + 8], 0xDD);
        t[i + 4] = _mm512_shuffle_f32x4(u[i + 4], u[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(u[i + 4], u[i + 12], 0xDD);
      }
      // t[k] now holds column c0 + k of the 16 rows
      for (int k = 0; k < 16; ++k) _mm512_storeu_ps(dst + (c0 + k) * ldd + r0, t[k]);
    }
    for (; c0 < cols; ++c0)
      for (int i = 0; i < 16; ++i) dst[c0 * ldd + r0 + i] = src[(r0 + i) * ld + c0];
  }
  for (; r0 < rows; ++r0)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r0] = src[r0 * ld + c];
}
#endif  // MHA_X86

#if MHA_X86
// row_dots on each path: one row a lane, each lane's sum as gemm_* sums one C
// element (the AVX-512 kernel: a fused multiply-add chain from zero in each
// block of MHA_AVX512_KC, the blocks added in order; AVX2: one chain).
__attribute__((target("avx512f,fma"))) void row_dots_avx512(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                            int64_t rows, int64_t n, float* out) {
  constexpr int64_t kKC = MHA_AVX512_KC;
  alignas(64) float ta[kKC * 16], tb[kKC * 16];  // (k, row): one row a lane
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    __m512 res = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < n; k0 += kKC) {
      const int64_t kc = std::min(kKC, n - k0);
      if (nr < 16) {
        std::fill(ta, ta + kc * 16, 0.f);
        std::fill(tb, tb + kc * 16, 0.f);
      }
      transpose_avx512(a + r0 * lda + k0, lda, nr, kc, ta, 16);
      transpose_avx512(b + r0 * ldb + k0, ldb, nr, kc, tb, 16);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < kc; ++k) acc = _mm512_fmadd_ps(_mm512_load_ps(ta + 16 * k), _mm512_load_ps(tb + 16 * k), acc);
      res = k0 == 0 ? acc : _mm512_fmadd_ps(_mm512_set1_ps(1.f), res, acc);
    }
    _mm512_mask_storeu_ps(out + r0, static_cast<__mmask16>((1u << nr) - 1), res);
  }
}

__attribute__((target("avx2,fma"))) void row_dots_avx2(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                       int64_t rows, int64_t n, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, rows - r0);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; ++k) {
      alignas(32) float va[8] = {}, vb[8] = {};
      for (int64_t r = 0; r < nr; ++r) {
        va[r] = a[(r0 + r) * lda + k];
        vb[r] = b[(r0 + r) * ldb + k];
      }
      acc = _mm256_fmadd_ps(_mm256_load_ps(va), _mm256_load_ps(vb), acc);
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, acc);
    std::copy(o, o + nr, out + r0);
  }
}
#endif  // MHA_X86

void row_dots_generic(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t n,
                      float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;  // (as gemm_generic: a product, then the sum)
    for (int64_t k = 0; k < n; ++k) acc += a[r * lda + k] * b[r * ldb + k];
    out[r] = acc;
  }
}

Isa detect_isa() {
  Isa best = Isa::kGeneric;
#if MHA_X86
  __builtin_cpu_init();
  // (F16C too: the AVX2 routines widen float16 rows and masks by vcvtph2ps)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    best = Isa::kAvx2;
  // the AVX-512 routines also use AVX512BW and BMI2 (Philox, masks)
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("bmi2"))
    best = Isa::kAvx512;
  if (best == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl"))
    best = Isa::kAvx512Bf16;
  if (best == Isa::kAvx512Bf16 && amx_bf16_usable()) best = Isa::kAmx;
#endif
  if (const char* env = std::getenv("MHA_EXT_CPU_ISA")) {
    Isa want = best;
    if (std::strcmp(env, "generic") == 0) want = Isa::kGeneric;
    if (std::strcmp(env, "avx2") == 0) want = Isa::kAvx2;
    if (std::strcmp(env, "avx512") == 0) want = Isa::kAvx512;
    if (std::strcmp(env, "avx512bf16") == 0) want = Isa::kAvx512Bf16;
    if (std::strcmp(env, "amx") == 0) want = Isa::kAmx;
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
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512bf16";
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
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
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

void row_dots(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t n, float* out) {
#if MHA_X86
  switch (active_isa()) {
    case Isa::kAmx:
    case Isa::kAvx512Bf16:
    case Isa::kAvx512: return row_dots_avx512(a, lda, b, ldb, rows, n, out);
    case Isa::kAvx2: return row_dots_avx2(a, lda, b, ldb, rows, n, out);
    default: break;
  }
#endif
  row_dots_generic(a, lda, b, ldb, rows, n, out);
}

void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) return transpose_avx512(src, ld, rows, cols, dst, ldd);
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * ld + c];
}

}  // namespace cpu
}  // namespace mha_ext
