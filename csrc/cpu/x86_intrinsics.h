// The x86 intrinsics of the SIMD translation units (gemm_cpu.cpp,
// softmax_cpu.cpp, rows_cpu.cpp, rows_avx2.cpp, ...): MHA_X86 says whether they are there
// (x86-64 with GCC or Clang); elsewhere only the portable paths are built.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define MHA_X86 1
// GCC 12's intrinsic headers build _mm*_undefined_* values by self-assignment,
// which -Wall reports as uninitialised wherever they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
// the target of the AVX2 + FMA routines (softmax_avx2.cpp, rows_avx2.cpp, rows_lanes_avx2.cpp)
#define MHA_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MHA_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline
#define MHA_AVX2_LAMBDA __attribute__((target("avx2,fma,f16c"), always_inline))

#include <algorithm>
#include <cstdint>

namespace mha_ext {
namespace cpu {
namespace avx2 {
// lanes [0, left) of 8 set: the mask of AVX2's masked loads and stores
MHA_AVX2_INLINE __m256i lanes(int64_t left) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(left, 0, 8))), iota);
}
}  // namespace avx2
}  // namespace cpu
}  // namespace mha_ext
#else
#define MHA_X86 0
#endif
