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

#include "host_device.h"

#include <cstdint>

namespace mha_ext {

struct Philox4 {
  uint32_t w[4];
};

constexpr uint32_t kPhiloxMulA = 0xD2511F53u, kPhiloxMulB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeylA = 0x9E3779B9u, kPhiloxWeylB = 0xBB67AE85u;

// One Philox4x32 round on counter (c0, c1, c2, c3) with key (k0, k1).
MHA_HOST_DEVICE void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3,
                                  uint32_t k0, uint32_t k1) {
  const uint64_t pa = static_cast<uint64_t>(kPhiloxMulA) * c0;
  const uint64_t pb = static_cast<uint64_t>(kPhiloxMulB) * c2;
  const uint32_t n0 = static_cast<uint32_t>(pb >> 32) ^ c1 ^ k0;
  const uint32_t n2 = static_cast<uint32_t>(pa >> 32) ^ c3 ^ k1;
  c1 = static_cast<uint32_t>(pb);
  c3 = static_cast<uint32_t>(pa);
  c0 = n0;
  c2 = n2;
}

MHA_HOST_DEVICE Philox4 philox4x32_10(uint64_t seed, uint64_t row, uint64_t col_group) {
  uint32_t c0 = static_cast<uint32_t>(col_group), c1 = static_cast<uint32_t>(col_group >> 32);
  uint32_t c2 = static_cast<uint32_t>(row), c3 = static_cast<uint32_t>(row >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    philox_round(c0, c1, c2, c3, k0, k1);
    k0 += kPhiloxWeylA;
    k1 += kPhiloxWeylB;
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
