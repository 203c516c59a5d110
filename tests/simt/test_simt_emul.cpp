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

TEST(SimtEmulation, WarpBarrierOrdersLanes) {
  const unsigned threads = 64;
  auto in = ramp(threads);
  std::vector<float> out(threads, -1.f);
  launch(dim3(1), dim3(threads), threads * sizeof(float),
         [&] { simt_tests::warp_rotate(in.data(), out.data(), true); });
  for (unsigned t = 0; t < threads; ++t) EXPECT_EQ(out[t], in[(t / 32) * 32 + (t + 1) % 32]);
}

TEST(SimtEmulation, MissingWarpBarrierGivesAWrongAnswer) {
  const unsigned threads = 32;
  auto in = ramp(threads);
  std::vector<float> out(threads, -1.f);
  launch(dim3(1), dim3(threads), threads * sizeof(float),
         [&] { simt_tests::warp_rotate(in.data(), out.data(), false); });
  int wrong = 0;
  for (unsigned t = 0; t < threads; ++t) wrong += out[t] != in[(t + 1) % 32];
  EXPECT_GT(wrong, 0);
}

// D = A B + C through the emulated mma.sync m16n8k16 equals the plain product
// of the same 16-bit values (exact products, float sums).
template <typename T16>
void check_mma() {
  std::vector<T16> a(16 * 16), b(16 * 8);
  std::vector<float> c(16 * 8), d(16 * 8, 0.f);
  for (int i = 0; i < 256; ++i) a[i] = T16(static_cast<float>((i * 37) % 23 - 11) / 8.f);
  for (int i = 0; i < 128; ++i) b[i] = T16(static_cast<float>((i * 53) % 19 - 9) / 4.f);
  for (int i = 0; i < 128; ++i) c[i] = static_cast<float>(i % 7) - 3.f;
  launch(dim3(1), dim3(32), 0, [&] { simt_tests::mma_tile<T16>(a.data(), b.data(), c.data(), d.data()); });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double want = c[m * 8 + n];
      for (int k = 0; k < 16; ++k) want += double(float(a[m * 16 + k])) * double(float(b[k * 8 + n]));
      EXPECT_NEAR(d[m * 8 + n], want, 1e-4) << "m " << m << " n " << n;
    }
}

TEST(SimtEmulation, MmaHalfMatchesPlainProduct) { check_mma<mha_ext::simt::f16>(); }
TEST(SimtEmulation, MmaBFloat16MatchesPlainProduct) { check_mma<mha_ext::simt::bf16>(); }

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
