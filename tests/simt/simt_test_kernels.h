// Small kernels written only against csrc/cuda/simt.h. tests/simt/test_simt_emul.cpp
// runs them under the CPU emulation; tests/test_simt_nvcc.py compiles them
// with nvcc for sm_80 and sm_90, so the same source is proven to be CUDA.
#pragma once

#include "../../csrc/cuda/simt.h"

namespace simt_tests {
using namespace mha_ext::simt;

// out[block] = sum of in[block * blockDim.x + t], by a shared-memory tree.
// With with_barriers = false it forgets the barriers a real GPU needs.
MHA_KERNEL block_sum(const float* in, float* out, bool with_barriers) {
  float* s = dynamic_shared<float>();
  const unsigned t = thread_idx().x, n = block_dim().x;
  s[t] = in[block_idx().x * n + t];
  if (with_barriers) sync_threads();
  for (unsigned stride = n / 2; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    if (with_barriers) sync_threads();
  }
  if (t == 0) out[block_idx().x] = s[0];
}

// Every lane gets the sum over its warp (butterfly), and lane 0 also the
// shfl_down reduction; vote results per warp.
MHA_KERNEL warp_ops(const float* in, float* xor_sum, float* down_sum, unsigned* ballots, int* alls) {
  const unsigned g = block_idx().x * block_dim().x + thread_idx().x;
  float v = in[g];
  for (int m = 16; m > 0; m /= 2) v += shfl_xor(v, m);
  xor_sum[g] = v;
  float d = in[g];
  for (unsigned off = 16; off > 0; off /= 2) d += shfl_down(d, off);
  down_sum[g] = d;
  const unsigned b = vote_ballot(in[g] > 0.f);
  const bool a = vote_all(in[g] > -1e30f);
  if (thread_idx().x % 32 == 0) {
    ballots[g / 32] = b;
    alls[g / 32] = a ? 1 : 0;
  }
}

// Every thread adds its value into *total.
MHA_KERNEL atomic_total(const float* in, float* total) {
  atomic_add(total, in[block_idx().x * block_dim().x + thread_idx().x]);
}

// A barrier only half of the block reaches.
MHA_KERNEL divergent_barrier(float* out) {
  if (thread_idx().x < block_dim().x / 2) sync_threads();
  out[thread_idx().x] = 1.f;
}

}  // namespace simt_tests
