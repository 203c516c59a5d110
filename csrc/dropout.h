// Counter-based dropout shared by every backend.
//
// Philox4x32-10 (Salmon et al., SC'11), the generator ATen's philox_engine
// implements. The draw for attention element (b, h, i, j) of a tensor with
// Hq heads and L query rows is word (j % 4) of
//   philox(key = seed, counter = {offset + j / 4 (64 bit), row (64 bit)}),
//   row = (b * Hq + h) * L + i,
// which equals ATen's philox_engine(seed, row, offset + j / 4). The element is
// dropped iff that 32-bit word < DropoutParams::drop_threshold. The backward
// regenerates the forward's mask from (seed, offset) without storing it, and a
// CUDA kernel computing the same words drops the same elements.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MHA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MHA_HOST_DEVICE inline
#endif

namespace mha_ext {

struct Philox4 {
  uint32_t w[4];
};

MHA_HOST_DEVICE Philox4 philox4x32_10(uint64_t seed, uint64_t row, uint64_t col_group) {
  uint32_t c0 = static_cast<uint32_t>(col_group), c1 = static_cast<uint32_t>(col_group >> 32);
  uint32_t c2 = static_cast<uint32_t>(row), c3 = static_cast<uint32_t>(row >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  constexpr uint32_t kMulA = 0xD2511F53u, kMulB = 0xCD9E8D57u;
  constexpr uint32_t kWeylA = 0x9E3779B9u, kWeylB = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint64_t pa = static_cast<uint64_t>(kMulA) * c0;
    const uint64_t pb = static_cast<uint64_t>(kMulB) * c2;
    const uint32_t hi_a = static_cast<uint32_t>(pa >> 32), lo_a = static_cast<uint32_t>(pa);
    const uint32_t hi_b = static_cast<uint32_t>(pb >> 32), lo_b = static_cast<uint32_t>(pb);
    c0 = hi_b ^ c1 ^ k0;
    c1 = lo_b;
    c2 = hi_a ^ c3 ^ k1;
    c3 = lo_a;
    k0 += kWeylA;
    k1 += kWeylB;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Writes keep[t] = 1 / 0 for columns j0 .. j0 + n - 1 of one attention row.
MHA_HOST_DEVICE void dropout_keep_row(uint64_t seed, uint64_t offset, uint64_t row,
                                      int64_t j0, int64_t n, uint32_t drop_threshold,
                                      uint8_t* keep) {
  int64_t t = 0;
  while (t < n) {
    const int64_t j = j0 + t;
    const Philox4 r = philox4x32_10(seed, row, offset + static_cast<uint64_t>(j >> 2));
    for (int64_t w = j & 3; w < 4 && t < n; ++w, ++t) {
      keep[t] = r.w[w] >= drop_threshold ? 1 : 0;
    }
  }
}

}  // namespace mha_ext
