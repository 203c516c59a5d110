// Small kernels written only against csrc/cuda/simt.h. tests/simt/test_simt_emul.cpp
// runs them under the CPU emulation; tests/test_simt_nvcc.py compiles them
// with nvcc for sm_80 and sm_90, so the same source is proven to be CUDA.
#pragma once

#include "../../csrc/cuda/mma.h"
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

// Every thread adds its value into *total (float64, then float32).
MHA_KERNEL atomic_total_double(const double* in, double* total) {
  atomic_add_global(total, in[block_idx().x * block_dim().x + thread_idx().x]);
}

MHA_KERNEL atomic_total(const float* in, float* total) {
  atomic_add_global(total, in[block_idx().x * block_dim().x + thread_idx().x]);
}

// atomic_add_global on a shared-memory address (a fault on the hardware, where
// red.global takes a global address).
// into_shared false: into out[0] (the right use).
MHA_KERNEL atomic_into_shared(float* out, bool into_shared) {
  float* s = dynamic_shared<float>();
  s[0] = 0.f;
  atomic_add_global(into_shared ? s : out, 1.f);
  if (into_shared) out[0] = s[0];
}

// A barrier only half of the block reaches.
MHA_KERNEL divergent_barrier(float* out) {
  if (thread_idx().x < block_dim().x / 2) sync_threads();
  out[thread_idx().x] = 1.f;
}

// out[t] = the value lane t + 1 (mod 32) of the same warp put in shared
// memory; with with_sync = false it forgets the sync_warp() between.
MHA_KERNEL warp_rotate(const float* in, float* out, bool with_sync) {
  float* s = dynamic_shared<float>();
  const unsigned t = thread_idx().x;
  s[t] = in[t];
  if (with_sync) sync_warp();
  out[t] = s[(t / 32) * 32 + (t + 1) % 32];
}

// d = a b + c for one warp: a (16 x 16) and b (16 x 8, k by n) row-major in
// T16, c and d (16 x 8) float, through the fragments of mma.h.
template <typename T16>
MHA_KERNEL mma_tile(const T16* a, const T16* b, const float* c, float* d) {
  const int lane = static_cast<int>(thread_idx().x);
  uint32_t af[4], bf[2];
  float acc[4];
  for (int r = 0; r < 4; ++r)
    af[r] = pack2(a[MmaLayout::a_row(lane, 2 * r) * 16 + MmaLayout::a_col(lane, 2 * r)],
                  a[MmaLayout::a_row(lane, 2 * r + 1) * 16 + MmaLayout::a_col(lane, 2 * r + 1)]);
  for (int r = 0; r < 2; ++r)
    bf[r] = pack2(b[MmaLayout::b_row(lane, 2 * r) * 8 + MmaLayout::b_col(lane, 2 * r)],
                  b[MmaLayout::b_row(lane, 2 * r + 1) * 8 + MmaLayout::b_col(lane, 2 * r + 1)]);
  for (int e = 0; e < 4; ++e) acc[e] = c[MmaLayout::c_row(lane, e) * 8 + MmaLayout::c_col(lane, e)];
  mma_m16n8k16<T16>(acc, af, bf);
  for (int e = 0; e < 4; ++e) d[MmaLayout::c_row(lane, e) * 8 + MmaLayout::c_col(lane, e)] = acc[e];
}

// 16 bytes, the unit of a cp.async copy.
struct alignas(16) Row16 {
  uint32_t w[4];
};

// A tile of 16-byte rows (one per thread) copied global -> shared with
// cp.async, then each thread writes out the row of the next thread.
// mode 0: commit, wait, barrier (correct); 1: no wait; 2: wait but no barrier.
MHA_KERNEL async_copy_rows(const Row16* g, Row16* out, int mode) {
  Row16* s = dynamic_shared<Row16>();
  const unsigned t = thread_idx().x, n = block_dim().x;
  cp_async_16(s + t, g + t);
  cp_async_commit();
  if (mode != 1) cp_async_wait<0>();
  if (mode != 2) sync_threads();
  out[t] = s[(t + 1) % n];
}

// Two groups per thread, rows t and n + t, then wait_group 1: the first
// group has landed; the second may not have (the emulation holds it back).
MHA_KERNEL async_copy_two_groups(const Row16* g, Row16* out) {
  Row16* s = dynamic_shared<Row16>();
  const unsigned t = thread_idx().x, n = block_dim().x;
  cp_async_16(s + t, g + t);
  cp_async_commit();
  cp_async_16(s + n + t, g + n + t);
  cp_async_commit();
  cp_async_wait<1>();
  out[t] = s[t];
  out[n + t] = s[n + t];
}

// cp.async from an address 8 bytes off a 16-byte boundary: a fault on the hardware.
MHA_KERNEL async_copy_misaligned(const Row16* g) {
  Row16* s = dynamic_shared<Row16>();
  cp_async_16(s, reinterpret_cast<const unsigned char*>(g) + 8);
  cp_async_commit();
  cp_async_wait<0>();
}

// One warp: a 16 x 16 row-major tile of 16-bit elements staged in shared
// memory (row stride `ld` elements, a multiple of 8), then ldmatrix x4 (or
// .trans) with lane l giving row (l % 8) + 8 ((l / 8) % 2) at column 8 (l / 16);
// regs[4 l + i] = register i of lane l. offset shifts the addresses by that many elements.
MHA_KERNEL ldmatrix_tile(const uint16_t* tile, uint32_t* regs, bool trans, int ld, int offset) {
  uint16_t* s = dynamic_shared<uint16_t>();
  const int lane = static_cast<int>(thread_idx().x);
  for (int e = lane; e < 256; e += kWarpSize) s[(e / 16) * ld + e % 16] = tile[e];
  sync_threads();
  const uint16_t* row = s + ((lane % 8) + 8 * ((lane / 8) % 2)) * ld + 8 * (lane / 16) + offset;
  uint32_t r[4];
  if (trans)
    ldmatrix_x4_trans(r, row);
  else
    ldmatrix_x4(r, row);
  for (int i = 0; i < 4; ++i) regs[4 * lane + i] = r[i];
}

// D (16 x 16) = A (16 x 16) B (16 x 16, k by n) + C with the operands loaded by
// ldmatrix (A) and ldmatrix.trans (B) from row-major tiles in shared memory:
// two mma.sync of 16 x 8.
template <typename T16>
MHA_KERNEL mma_from_ldmatrix(const T16* a, const T16* b, const float* c, float* d) {
  T16* s = dynamic_shared<T16>();
  const int lane = static_cast<int>(thread_idx().x);
  for (int e = lane; e < 256; e += kWarpSize) {
    s[e] = a[e];
    s[256 + e] = b[e];
  }
  sync_threads();
  const int r = (lane % 8) + 8 * ((lane / 8) % 2), c0 = 8 * (lane / 16);
  uint32_t af[4], bt[4];
  ldmatrix_x4(af, s + r * 16 + c0);
  ldmatrix_x4_trans(bt, s + 256 + r * 16 + c0);
  for (int half = 0; half < 2; ++half) {
    const uint32_t bf[2] = {bt[2 * half], bt[2 * half + 1]};
    float acc[4];
    for (int e = 0; e < 4; ++e) acc[e] = c[MmaLayout::c_row(lane, e) * 16 + 8 * half + MmaLayout::c_col(lane, e)];
    mma_m16n8k16<T16>(acc, af, bf);
    for (int e = 0; e < 4; ++e) d[MmaLayout::c_row(lane, e) * 16 + 8 * half + MmaLayout::c_col(lane, e)] = acc[e];
  }
}

// D (16 x 16) = A (16 x 8) B (8 x 16, k by n) + C in TF32, the operands by
// ldmatrix x4 of 32-bit elements from shared tiles with 16-byte rows padded
// to 12 floats: A by rows (lane l gives row (l % 8) + 8 ((l / 8) % 2) at
// column 4 (l / 16): registers a0..a3), B stored by its columns (b_t, n by k;
// lane l gives column n = (l % 8) + 8 (l / 16) at k = 4 ((l / 8) % 2):
// registers b0, b1 of columns 0-7, then of 8-15). Values through to_tf32.
MHA_KERNEL mma_tf32_from_ldmatrix(const float* a, const float* b_t, const float* c, float* d) {
  constexpr int kLd = 12;
  float* s = dynamic_shared<float>();
  const int lane = static_cast<int>(thread_idx().x);
  for (int e = lane; e < 128; e += kWarpSize) {
    s[(e / 8) * kLd + e % 8] = a[e];
    s[16 * kLd + (e / 8) * kLd + e % 8] = b_t[e];
  }
  sync_threads();
  uint32_t af[4], bt[4];
  ldmatrix_x4(af, s + ((lane % 8) + 8 * ((lane / 8) % 2)) * kLd + 4 * (lane / 16));
  ldmatrix_x4(bt, s + 16 * kLd + ((lane % 8) + 8 * (lane / 16)) * kLd + 4 * ((lane / 8) % 2));
  for (int r = 0; r < 4; ++r) {
    af[r] = to_tf32(tf32_value(af[r]));
    bt[r] = to_tf32(tf32_value(bt[r]));
  }
  for (int half = 0; half < 2; ++half) {
    const uint32_t bf[2] = {bt[2 * half], bt[2 * half + 1]};
    float acc[4];
    for (int e = 0; e < 4; ++e) acc[e] = c[MmaLayout::c_row(lane, e) * 16 + 8 * half + MmaLayout::c_col(lane, e)];
    mma_m16n8k8_tf32(acc, af, bf);
    for (int e = 0; e < 4; ++e) d[MmaLayout::c_row(lane, e) * 16 + 8 * half + MmaLayout::c_col(lane, e)] = acc[e];
  }
}

// out[i] = the bits of to_tf32(in[i]), one element per thread.
MHA_KERNEL round_tf32(const float* in, uint32_t* out, int n) {
  const int i = static_cast<int>(thread_idx().x);
  if (i < n) out[i] = to_tf32(in[i]);
}

// Instantiated here so that nvcc compiles both (tests/test_simt_nvcc.py).
template MHA_KERNEL mma_tile<f16>(const f16*, const f16*, const float*, float*);
template MHA_KERNEL mma_tile<bf16>(const bf16*, const bf16*, const float*, float*);
template MHA_KERNEL mma_from_ldmatrix<f16>(const f16*, const f16*, const float*, float*);
template MHA_KERNEL mma_from_ldmatrix<bf16>(const bf16*, const bf16*, const float*, float*);

}  // namespace simt_tests
