// Small deterministic GEMM for attention tiles, in registers, with the
// instruction set chosen at run time.
//
//   C (M x N, ldc) = alpha * A B + beta * C          (beta == 0: C is not read)
//   A(i, k) = a[i * a_rs + k * a_cs]                 (any strides: A or A^T)
//   B (K x N) row-major with leading dim ldb, unit stride along N
//
// Every C element is one sum over k in increasing order, whatever the thread
// count, the alignment or the tile position: results are reproducible (BLAS
// libraries do not promise that across thread counts). The float paths are an
// AVX-512 micro-kernel (6 x 32 outputs in 12 zmm accumulators), an AVX2+FMA
// one (4 x 16 in 8 ymm) and portable C++; double (the gradcheck path) uses the
// portable loop. MHA_EXT_CPU_ISA=generic|avx2|avx512 forces a path (tests run
// the generic one that way); unset, the best the CPU supports is used.
#pragma once

#include <cstdint>

namespace mha_ext {
namespace cpu {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// The path in use (decided once per process).
Isa active_isa();
const char* isa_name(Isa isa);

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t a_rs,
          int64_t a_cs, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(int64_t M, int64_t N, int64_t K, double alpha, const double* a, int64_t a_rs,
          int64_t a_cs, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

}  // namespace cpu
}  // namespace mha_ext
