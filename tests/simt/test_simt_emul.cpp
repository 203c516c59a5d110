// The CPU emulation of csrc/cuda/simt.h behaves like the hardware it stands
// for: barriers really order the threads of a block, warps shuffle and vote
// over 32 lanes, atomics add up, and a barrier not every thread reaches is
// reported instead of hanging; mma.sync and ldmatrix follow the PTX ISA's
// per-lane tables (written out here independently of mma.h), and cp.async
// data is there only after the wait of its group (and a barrier, for other
// threads). The warp-wide products of warp_tiles.h: warp_mma_pair gives the
// bits of two warp_mma calls.
#define MHA_SIMT_EMULATION 1
#include "simt_test_kernels.h"
#include "../../csrc/cuda/warp_tiles.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
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

// ---------------------------------------------------------------------------
// Per-lane layouts, written from the PTX ISA manual's tables (groupID =
// lane >> 2, threadID_in_group = lane % 4), not from the helpers in mma.h.

struct PtxMma {  // mma.m16n8k16 with .f16 / .bf16 A and B, .f32 C and D
  static int group(int lane) { return lane >> 2; }
  static int tig(int lane) { return lane % 4; }
  static int a_row(int lane, int i) { return (i < 2 || (i >= 4 && i < 6)) ? group(lane) : group(lane) + 8; }
  static int a_col(int lane, int i) { return tig(lane) * 2 + (i & 0x1) + (i >= 4 ? 8 : 0); }
  static int b_row(int lane, int i) { return tig(lane) * 2 + (i & 0x1) + (i >= 2 ? 8 : 0); }
  static int b_col(int lane, int) { return group(lane); }
  static int c_row(int lane, int i) { return i < 2 ? group(lane) : group(lane) + 8; }
  static int c_col(int lane, int i) { return tig(lane) * 2 + (i & 0x1); }
};

TEST(SimtEmulation, MmaLayoutIsThePtxTable) {
  using mha_ext::simt::MmaLayout;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(MmaLayout::a_row(lane, i), PtxMma::a_row(lane, i)) << lane << " a" << i;
      EXPECT_EQ(MmaLayout::a_col(lane, i), PtxMma::a_col(lane, i)) << lane << " a" << i;
    }
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(MmaLayout::b_row(lane, i), PtxMma::b_row(lane, i)) << lane << " b" << i;
      EXPECT_EQ(MmaLayout::b_col(lane, i), PtxMma::b_col(lane, i)) << lane << " b" << i;
      EXPECT_EQ(MmaLayout::c_row(lane, i), PtxMma::c_row(lane, i)) << lane << " c" << i;
      EXPECT_EQ(MmaLayout::c_col(lane, i), PtxMma::c_col(lane, i)) << lane << " c" << i;
    }
  }
}

// The emulated mma.sync with fragments placed by the PTX table (not by
// MmaLayout): D read back by the table equals the plain product.
TEST(SimtEmulation, MmaComputesThePtxTablesProduct) {
  using mha_ext::simt::f16;
  std::vector<f16> a(256), b(128);
  for (int i = 0; i < 256; ++i) a[i] = f16(static_cast<float>((i * 29) % 17 - 8) / 4.f);
  for (int i = 0; i < 128; ++i) b[i] = f16(static_cast<float>((i * 31) % 13 - 6) / 2.f);
  std::vector<float> d(128, 0.f);
  launch(dim3(1), dim3(32), 0, [&] {
    const int lane = static_cast<int>(mha_ext::simt::thread_idx().x);
    uint32_t af[4], bf[2];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < 4; ++r)
      af[r] = mha_ext::simt::pack2(a[PtxMma::a_row(lane, 2 * r) * 16 + PtxMma::a_col(lane, 2 * r)],
                                   a[PtxMma::a_row(lane, 2 * r + 1) * 16 + PtxMma::a_col(lane, 2 * r + 1)]);
    for (int r = 0; r < 2; ++r)
      bf[r] = mha_ext::simt::pack2(b[PtxMma::b_row(lane, 2 * r) * 8 + PtxMma::b_col(lane, 2 * r)],
                                   b[PtxMma::b_row(lane, 2 * r + 1) * 8 + PtxMma::b_col(lane, 2 * r + 1)]);
    mha_ext::simt::mma_m16n8k16<f16>(acc, af, bf);
    for (int e = 0; e < 4; ++e) d[PtxMma::c_row(lane, e) * 8 + PtxMma::c_col(lane, e)] = acc[e];
  });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k) want += double(float(a[m * 16 + k])) * double(float(b[k * 8 + n]));
      EXPECT_NEAR(d[m * 8 + n], want, 1e-4) << m << " " << n;
    }
}

// ldmatrix .x4 (.trans), from the manual: lane 8 i + r addresses row r of
// matrix i; each lane receives one 32-bit register per matrix holding two
// adjacent elements, row lane / 4 and columns 2 (lane % 4), + 1; .trans
// delivers the matrix transposed: rows 2 (lane % 4), + 1 of column lane / 4.
// The tile's elements are their own indices, so each half names its source.
std::vector<uint32_t> run_ldmatrix(bool trans, int ld, int offset = 0) {
  std::vector<uint16_t> tile(256);
  std::iota(tile.begin(), tile.end(), 0);
  std::vector<uint32_t> regs(128, 0xdeadbeef);
  launch(dim3(1), dim3(32), 16 * ld * sizeof(uint16_t) + 64,
         [&] { simt_tests::ldmatrix_tile(tile.data(), regs.data(), trans, ld, offset); });
  return regs;
}

TEST(SimtEmulation, LdmatrixIsThePtxTable) {
  for (int ld : {16, 24}) {  // packed rows, and rows padded by 16 bytes (conflict-free strides)
    for (bool trans : {false, true}) {
      const auto regs = run_ldmatrix(trans, ld);
      for (int lane = 0; lane < 32; ++lane)
        for (int m = 0; m < 4; ++m) {
          // matrix m holds tile rows 8 (m % 2) .. and columns 8 (m / 2) .. (the addresses given)
          auto at = [&](int r, int c) { return uint32_t((8 * (m % 2) + r) * 16 + 8 * (m / 2) + c); };
          const int g = lane / 4, t = lane % 4;
          const uint32_t lo = trans ? at(2 * t, g) : at(g, 2 * t);
          const uint32_t hi = trans ? at(2 * t + 1, g) : at(g, 2 * t + 1);
          EXPECT_EQ(regs[4 * lane + m], lo | (hi << 16)) << "ld " << ld << " trans " << trans << " lane " << lane;
        }
    }
  }
}

TEST(SimtEmulation, LdmatrixOffAlignmentThrows) {
  EXPECT_THROW(run_ldmatrix(false, 16, 4), std::logic_error);  // 8 bytes off
}

// ldmatrix operands feed mma.sync: A and B (transposed) from row-major
// shared tiles give the plain product.
template <typename T16>
void check_mma_from_ldmatrix() {
  std::vector<T16> a(256), b(256);
  std::vector<float> c(256), d(256, 0.f);
  for (int i = 0; i < 256; ++i) a[i] = T16(static_cast<float>((i * 37) % 23 - 11) / 8.f);
  for (int i = 0; i < 256; ++i) b[i] = T16(static_cast<float>((i * 53) % 19 - 9) / 4.f);
  for (int i = 0; i < 256; ++i) c[i] = static_cast<float>(i % 5) - 2.f;
  launch(dim3(1), dim3(32), 512 * sizeof(T16),
         [&] { simt_tests::mma_from_ldmatrix<T16>(a.data(), b.data(), c.data(), d.data()); });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      double want = c[m * 16 + n];
      for (int k = 0; k < 16; ++k) want += double(float(a[m * 16 + k])) * double(float(b[k * 16 + n]));
      EXPECT_NEAR(d[m * 16 + n], want, 1e-4) << "m " << m << " n " << n;
    }
}

TEST(SimtEmulation, MmaFromLdmatrixHalf) { check_mma_from_ldmatrix<mha_ext::simt::f16>(); }
TEST(SimtEmulation, MmaFromLdmatrixBFloat16) { check_mma_from_ldmatrix<mha_ext::simt::bf16>(); }

// ---------------------------------------------------------------------------
// TF32: mma.m16n8k8 with .tf32 A and B, from the PTX ISA's table (A: row
// groupID for a0, a2 and groupID + 8 for a1, a3, column threadID_in_group
// for a0, a1 and + 4 for a2, a3; B: row threadID_in_group for b0 and + 4
// for b1, column groupID; C as for m16n8k16), and cvt.rna.tf32.f32.

struct PtxMmaTf32 {
  static int a_row(int lane, int i) { return (i == 0 || i == 2) ? (lane >> 2) : (lane >> 2) + 8; }
  static int a_col(int lane, int i) { return i < 2 ? lane % 4 : lane % 4 + 4; }
  static int b_row(int lane, int i) { return i == 0 ? lane % 4 : lane % 4 + 4; }
  static int b_col(int lane, int) { return lane >> 2; }
};

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// values with at most 10 mantissa bits: exact in TF32
float tf32_exact(int i, int mod, int off, float div) { return static_cast<float>((i * 37) % mod - off) / div; }

TEST(SimtEmulation, Tf32MmaComputesThePtxTablesProduct) {
  std::vector<float> a(128), b(64), d(128, 0.f);
  for (int i = 0; i < 128; ++i) a[i] = tf32_exact(i, 23, 11, 8.f);
  for (int i = 0; i < 64; ++i) b[i] = tf32_exact(i, 19, 9, 4.f);
  launch(dim3(1), dim3(32), 0, [&] {
    const int lane = static_cast<int>(mha_ext::simt::thread_idx().x);
    uint32_t af[4], bf[2];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < 4; ++i) af[i] = bits(a[PtxMmaTf32::a_row(lane, i) * 8 + PtxMmaTf32::a_col(lane, i)]);
    for (int i = 0; i < 2; ++i) bf[i] = bits(b[PtxMmaTf32::b_row(lane, i) * 8 + PtxMmaTf32::b_col(lane, i)]);
    mha_ext::simt::mma_m16n8k8_tf32(acc, af, bf);
    for (int e = 0; e < 4; ++e) d[PtxMma::c_row(lane, e) * 8 + PtxMma::c_col(lane, e)] = acc[e];
  });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int k = 0; k < 8; ++k) want += double(a[m * 8 + k]) * double(b[k * 8 + n]);
      EXPECT_NEAR(d[m * 8 + n], want, 1e-4) << m << " " << n;
    }
}

// The low 13 bits of a TF32 operand take no part: 1 + 2^-20 multiplies as 1.
TEST(SimtEmulation, Tf32MmaReadsNineteenBits) {
  float d0 = 0.f;
  launch(dim3(1), dim3(32), 0, [&] {
    const int lane = static_cast<int>(mha_ext::simt::thread_idx().x);
    const uint32_t one_plus = bits(1.f + std::ldexp(1.f, -20));
    // A = e_0 e_0^T-ish: only a0 of lane 0 (row 0, k 0) is nonzero; B: only b0 of lane 0 (k 0, n 0)
    uint32_t af[4] = {lane == 0 ? one_plus : 0u, 0u, 0u, 0u}, bf[2] = {lane == 0 ? one_plus : 0u, 0u};
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    mha_ext::simt::mma_m16n8k8_tf32(acc, af, bf);
    if (lane == 0) d0 = acc[0];
  });
  EXPECT_EQ(d0, 1.f);
}

TEST(SimtEmulation, Tf32RoundsToNearestTiesAwayFromZero) {
  const float u = std::ldexp(1.f, -10);  // TF32's ulp at 1
  const std::vector<float> in = {1.f + u / 2,                        // a tie: away from zero
                                 -(1.f + u / 2),
                                 1.f + 3 * u / 2,                    // a tie above an odd last bit
                                 1.f + u / 2 - std::ldexp(1.f, -23),  // below the tie
                                 1.f + u / 2 + std::ldexp(1.f, -23),  // above it
                                 std::numeric_limits<float>::max(),   // rounds up past the largest
                                 std::numeric_limits<float>::infinity(), 0.f};
  const std::vector<float> want = {1.f + u, -(1.f + u), 1.f + 2 * u, 1.f, 1.f + u,
                                   std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity(), 0.f};
  std::vector<uint32_t> out(in.size() + 1);
  std::vector<float> with_nan = in;
  with_nan.push_back(std::numeric_limits<float>::quiet_NaN());
  launch(dim3(1), dim3(32), 0,
         [&] { simt_tests::round_tf32(with_nan.data(), out.data(), static_cast<int>(with_nan.size())); });
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(out[i], bits(want[i])) << i;
  float nan_out;
  std::memcpy(&nan_out, &out.back(), 4);
  EXPECT_TRUE(std::isnan(nan_out));
}

// ldmatrix of 32-bit elements feeds the TF32 mma: A by rows and B by its
// columns give the plain product.
TEST(SimtEmulation, Tf32MmaFromLdmatrix) {
  std::vector<float> a(128), b_t(128), c(256), d(256, 0.f);
  for (int i = 0; i < 128; ++i) a[i] = tf32_exact(i, 23, 11, 8.f);
  for (int i = 0; i < 128; ++i) b_t[i] = tf32_exact(i + 5, 19, 9, 4.f);
  for (int i = 0; i < 256; ++i) c[i] = static_cast<float>(i % 5) - 2.f;
  launch(dim3(1), dim3(32), 32 * 12 * sizeof(float),
         [&] { simt_tests::mma_tf32_from_ldmatrix(a.data(), b_t.data(), c.data(), d.data()); });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      double want = c[m * 16 + n];
      for (int k = 0; k < 8; ++k) want += double(a[m * 8 + k]) * double(b_t[n * 8 + k]);
      EXPECT_NEAR(d[m * 16 + n], want, 1e-4) << "m " << m << " n " << n;
    }
}

// ---------------------------------------------------------------------------
// cp.async: data lands at the wait of its group, for other threads after a barrier.

std::vector<simt_tests::Row16> rows16(size_t n) {
  std::vector<simt_tests::Row16> v(n);
  for (size_t i = 0; i < n; ++i)
    for (int w = 0; w < 4; ++w) v[i].w[w] = static_cast<uint32_t>(1000 * i + w);
  return v;
}

bool same(const simt_tests::Row16& a, const simt_tests::Row16& b) { return std::memcmp(&a, &b, 16) == 0; }

int wrong_rows_after_async_copy(int mode) {
  const unsigned n = 64;
  auto in = rows16(n);
  std::vector<simt_tests::Row16> out(n);
  launch(dim3(1), dim3(n), n * 16, [&] { simt_tests::async_copy_rows(in.data(), out.data(), mode); });
  int wrong = 0;
  for (unsigned t = 0; t < n; ++t) wrong += !same(out[t], in[(t + 1) % n]);
  return wrong;
}

TEST(SimtEmulation, AsyncCopyWithWaitAndBarrierLands) { EXPECT_EQ(wrong_rows_after_async_copy(0), 0); }
TEST(SimtEmulation, AsyncCopyWithoutWaitGivesAWrongAnswer) { EXPECT_EQ(wrong_rows_after_async_copy(1), 64); }
TEST(SimtEmulation, AsyncCopyWithoutBarrierGivesAWrongAnswer) { EXPECT_GT(wrong_rows_after_async_copy(2), 0); }

TEST(SimtEmulation, AsyncCopyWaitGroupRetiresAllButTheNewest) {
  const unsigned n = 32;
  auto in = rows16(2 * n);
  std::vector<simt_tests::Row16> out(2 * n);
  launch(dim3(1), dim3(n), 2 * n * 16, [&] { simt_tests::async_copy_two_groups(in.data(), out.data()); });
  for (unsigned t = 0; t < n; ++t) {
    EXPECT_TRUE(same(out[t], in[t])) << t;           // the older group has landed
    EXPECT_FALSE(same(out[n + t], in[n + t])) << t;  // the newest may not have: held back here
  }
}

TEST(SimtEmulation, AsyncCopyOffAlignmentThrows) {
  auto in = rows16(2);
  EXPECT_THROW(launch(dim3(1), dim3(1), 16, [&] { simt_tests::async_copy_misaligned(in.data()); }), std::logic_error);
}

TEST(SimtEmulation, AtomicsAddEveryContribution) {
  const unsigned blocks = 4, threads = 96;
  std::vector<float> in(blocks * threads, 0.5f);
  float total = 0.f;
  launch(dim3(blocks), dim3(threads), 0, [&] { simt_tests::atomic_total(in.data(), &total); });
  EXPECT_EQ(total, 0.5f * blocks * threads);
  std::vector<double> in64(blocks * threads, 0.25);
  double total64 = 1.0;
  launch(dim3(blocks), dim3(threads), 0, [&] { simt_tests::atomic_total_double(in64.data(), &total64); });
  EXPECT_EQ(total64, 1.0 + 0.25 * blocks * threads);
}

TEST(SimtEmulation, GlobalAtomicOnSharedMemoryThrows) {
  float out = 0.f;
  launch(dim3(1), dim3(1), 16, [&] { simt_tests::atomic_into_shared(&out, false); });
  EXPECT_EQ(out, 1.f);
  EXPECT_THROW(launch(dim3(1), dim3(1), 16, [&] { simt_tests::atomic_into_shared(&out, true); }), std::logic_error);
}

TEST(SimtEmulation, DivergentBarrierIsReportedNotHung) {
  std::vector<float> out(64);
  EXPECT_THROW(launch(dim3(1), dim3(64), 0, [&] { simt_tests::divergent_barrier(out.data()); }),
               std::runtime_error);
}

// warp_mma_pair (the backward's S^T with dP^T, dV with dK) runs two products
// in one k loop: each accumulator must get the bits two warp_mma calls give
// (same k order), and both must be the plain product. Inputs of mixed
// magnitudes, so that another summation order would change low bits.
template <typename T16>
MHA_KERNEL mma_pair_and_single(const T16* in, float* out) {
  using namespace mha_ext::device;
  constexpr int kK = 64, kLd = kK + 8, kTile = 32 * kLd;  // A: 16 x K by rows; B: 32 columns x K
  T16* s = dynamic_shared<T16>();
  const int lane = static_cast<int>(thread_idx().x);
  for (int t = 0; t < 4; ++t)
    for (int e = lane; e < 32 * kK; e += kWarpSize) s[t * kTile + (e / kK) * kLd + e % kK] = in[t * 32 * kK + e];
  sync_threads();
  auto a = [&](int t) { return Tile2<T16>{s + t * kTile, kLd, 1}; };
  auto b = [&](int t) { return Tile2<T16>{s + t * kTile, 1, kLd}; };
  float p1[4][4] = {}, p2[4][4] = {}, s1[4][4] = {}, s2[4][4] = {};
  warp_mma_pair<T16>(p1, a(0), b(1), p2, a(2), b(3), kK, lane, false, mha_ext::Fp32Math::kCudaCores);
  warp_mma<T16>(s1, a(0), b(1), kK, lane, false, mha_ext::Fp32Math::kCudaCores);
  warp_mma<T16>(s2, a(2), b(3), kK, lane, false, mha_ext::Fp32Math::kCudaCores);
  float* acc[4] = {&p1[0][0], &p2[0][0], &s1[0][0], &s2[0][0]};
  for (int x = 0; x < 4; ++x)
    for (int nt = 0; nt < 4; ++nt)
      for (int e = 0; e < 4; ++e)
        out[x * 512 + MmaLayout::c_row(lane, e) * 32 + 8 * nt + MmaLayout::c_col(lane, e)] = acc[x][nt * 4 + e];
}

template <typename T16>
void check_mma_pair() {
  constexpr int kK = 64;
  std::vector<T16> in(4 * 32 * kK);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = T16(static_cast<float>(static_cast<int>((i * 37) % 29) - 14) * (i % 7 == 0 ? 64.f : i % 3 == 0 ? 1.f / 64 : 1.f) / 8.f);
  std::vector<float> out(4 * 512, -1.f);
  launch(dim3(1), dim3(32), 4 * 32 * (kK + 8) * sizeof(T16),
         [&] { mma_pair_and_single<T16>(in.data(), out.data()); });
  for (int x = 0; x < 2; ++x)
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 32; ++n) {
        const float pair = out[x * 512 + m * 32 + n], single = out[(x + 2) * 512 + m * 32 + n];
        EXPECT_EQ(bits(pair), bits(single)) << "product " << x << " m " << m << " n " << n;
        double want = 0.0;  // A rows of tile 2x, B columns of tile 2x + 1
        for (int k = 0; k < kK; ++k)
          want += double(float(in[(2 * x) * 32 * kK + m * kK + k])) * double(float(in[(2 * x + 1) * 32 * kK + n * kK + k]));
        EXPECT_NEAR(pair, want, 1e-3 * (1.0 + std::abs(want))) << "product " << x << " m " << m << " n " << n;
      }
}

TEST(SimtEmulation, MmaPairIsTwoProductsBitForBitHalf) { check_mma_pair<mha_ext::simt::f16>(); }
TEST(SimtEmulation, MmaPairIsTwoProductsBitForBitBFloat16) { check_mma_pair<mha_ext::simt::bf16>(); }

// An A operand held in C fragments (the backward's P^T and dS^T, 16 x 64):
// warp_mma_c (a_frag_from_c's fragments) must multiply as the same tile stored to shared
// memory (store_c_fragments) and loaded by ldmatrix (warp_mma) does, bit for
// bit, and as the plain product of C's elements rounded to T16. C = A0 B0 (an
// mma product, so every lane's fragment holds other values); B2 (64 x 16) is
// stored by rows, the .trans operand of dV += P^T dO.
template <typename T16>
MHA_KERNEL c_operand_and_shared(const T16* in, float* out) {
  using namespace mha_ext::device;
  constexpr int kK = 64, kLd = kK + 8, kTile = 64 * kLd;
  T16* s = dynamic_shared<T16>();  // A0 (16 x 64), B0^T (64 x 64), B2 (64 x 16 by rows, row stride kLd), C
  const int lane = static_cast<int>(thread_idx().x);
  for (int t = 0; t < 3; ++t)
    for (int e = lane; e < 64 * kK; e += kWarpSize) s[t * kTile + (e / kK) * kLd + e % kK] = in[t * 64 * kK + e];
  sync_threads();
  float c[8][4] = {}, via_shared[2][4] = {}, via_regs[2][4] = {};
  warp_mma<T16>(c, Tile2<T16>{s, kLd, 1}, Tile2<T16>{s + kTile, 1, kLd}, kK, lane, false,
                mha_ext::Fp32Math::kCudaCores);
  T16* c_s = s + 3 * kTile;
  store_c_fragments<T16>(c, c_s, kLd, lane);
  sync_warp();
  const Tile2<T16> b2{s + 2 * kTile, kLd, 1};
  warp_mma<T16>(via_shared, Tile2<T16>{c_s, kLd, 1}, b2, kK, lane, false, mha_ext::Fp32Math::kCudaCores);
  warp_mma_c<T16>(via_regs, c, b2, kK, lane, false);
  for (int nt = 0; nt < 8; ++nt)
    for (int e = 0; e < 4; ++e) out[MmaLayout::c_row(lane, e) * 64 + 8 * nt + MmaLayout::c_col(lane, e)] = c[nt][e];
  for (int nt = 0; nt < 2; ++nt)
    for (int e = 0; e < 4; ++e) {
      const int at = MmaLayout::c_row(lane, e) * 16 + 8 * nt + MmaLayout::c_col(lane, e);
      out[1024 + at] = via_shared[nt][e];
      out[1024 + 256 + at] = via_regs[nt][e];
    }
}

template <typename T16>
void check_c_operand() {
  constexpr int kK = 64;
  std::vector<T16> in(3 * 64 * kK);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = T16(static_cast<float>(static_cast<int>((i * 53) % 31) - 15) * (i % 5 == 0 ? 8.f : 1.f) / 16.f);
  std::vector<float> out(1024 + 512, -1.f);
  launch(dim3(1), dim3(32), 4 * 64 * (kK + 8) * sizeof(T16), [&] { c_operand_and_shared<T16>(in.data(), out.data()); });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      const float shared = out[1024 + m * 16 + n], regs = out[1024 + 256 + m * 16 + n];
      EXPECT_EQ(bits(regs), bits(shared)) << "m " << m << " n " << n;
      double want = 0.0;  // C rounded to T16, times B2's column n (B2 row k at in[2 * 64 kK + k kK + n])
      for (int k = 0; k < kK; ++k)
        want += double(float(T16(out[m * 64 + k]))) * double(float(in[2 * 64 * kK + k * kK + n]));
      EXPECT_NEAR(regs, want, 1e-3 * (1.0 + std::abs(want))) << "m " << m << " n " << n;
    }
}

TEST(SimtEmulation, COperandIsTheSharedTileBitForBitHalf) { check_c_operand<mha_ext::simt::f16>(); }
TEST(SimtEmulation, COperandIsTheSharedTileBitForBitBFloat16) { check_c_operand<mha_ext::simt::bf16>(); }

}  // namespace
