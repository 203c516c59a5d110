// The CPU emulation of csrc/cuda/simt.h behaves like the hardware it stands
// for: barriers really order the threads of a block, warps shuffle and vote
// over 32 lanes, atomics add up, and a barrier not every thread reaches is
// reported instead of hanging.
#define MHA_SIMT_EMULATION 1
#include "simt_test_kernels.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

using mha_ext::simt::dim3;
using mha_ext::simt::emul::launch;

namespace {

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 37) % 101) - 50.f;
  return v;
}

TEST(SimtEmulation, BlockReductionWithBarriersIsExact) {
  const unsigned blocks = 3, threads = 128;
  auto in = ramp(blocks * threads);
  std::vector<float> out(blocks, -1.f);
  launch(dim3(blocks), dim3(threads), threads * sizeof(float),
         [&] { simt_tests::block_sum(in.data(), out.data(), true); });
  for (unsigned b = 0; b < blocks; ++b)
    EXPECT_EQ(out[b], std::accumulate(in.begin() + b * threads, in.begin() + (b + 1) * threads, 0.f));
}

TEST(SimtEmulation, MissingBarrierGivesAWrongAnswer) {
  const unsigned threads = 128;
  auto in = ramp(threads);
  std::vector<float> out(1, -1.f);
  launch(dim3(1), dim3(threads), threads * sizeof(float),
         [&] { simt_tests::block_sum(in.data(), out.data(), false); });
  EXPECT_NE(out[0], std::accumulate(in.begin(), in.end(), 0.f));
}

TEST(SimtEmulation, WarpShufflesAndVotes) {
  const unsigned threads = 64;
  auto in = ramp(threads);
  std::vector<float> xs(threads), ds(threads);
  std::vector<unsigned> ballots(2);
  std::vector<int> alls(2);
  launch(dim3(1), dim3(threads), 0,
         [&] { simt_tests::warp_ops(in.data(), xs.data(), ds.data(), ballots.data(), alls.data()); });
  for (unsigned w = 0; w < 2; ++w) {
    float sum = 0.f;
    unsigned bits = 0;
    for (unsigned l = 0; l < 32; ++l) {
      sum += in[w * 32 + l];
      if (in[w * 32 + l] > 0.f) bits |= 1u << l;
    }
    for (unsigned l = 0; l < 32; ++l) EXPECT_FLOAT_EQ(xs[w * 32 + l], sum);
    EXPECT_FLOAT_EQ(ds[w * 32], sum);
    EXPECT_EQ(ballots[w], bits);
    EXPECT_EQ(alls[w], 1);
  }
}

TEST(SimtEmulation, AtomicsAddEveryContribution) {
  const unsigned blocks = 4, threads = 96;
  std::vector<float> in(blocks * threads, 0.5f);
  float total = 0.f;
  launch(dim3(blocks), dim3(threads), 0, [&] { simt_tests::atomic_total(in.data(), &total); });
  EXPECT_EQ(total, 0.5f * blocks * threads);
}

TEST(SimtEmulation, DivergentBarrierIsReportedNotHung) {
  std::vector<float> out(64);
  EXPECT_THROW(launch(dim3(1), dim3(64), 0, [&] { simt_tests::divergent_barrier(out.data()); }),
               std::runtime_error);
}

}  // namespace
