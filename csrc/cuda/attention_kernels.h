// CUDA device code of mha_ext::attention and attention_backward,
// FlashAttention-2 style, written only against simt.h / mma.h so the same
// source compiles with nvcc and runs under the CPU emulation in the tests.
//
// Layout of work. Every warp owns 16 rows of its block's tile; products are
// warp-wide 16 x 8 x 16 steps whose accumulators use the mma C-fragment
// layout (mma.h): lane 4 g + t holds rows g and g + 8, columns 2t and 2t + 1
// of each 8-column slice. Half and bfloat16 tiles multiply on the tensor
// cores (mma.sync, float accumulation); float and double use the same layout
// on the CUDA cores (warp_mma below), so one kernel serves every dtype.
//
//   forward      grid (query blocks, B * Hq over y and z). Q tile kept in shared memory,
//                K/V tiles streamed by cp.async into two stages (the next
//                tile loads while this one computes), online softmax in
//                registers, output and logsumexp written at the end; 16-bit
//                operands by ldmatrix and P kept in registers.
//   bwd_dot      D = rowsum(dO * O), one warp per row.
//   backward     grid (B * Hq, key blocks). K/V tile kept, query tiles (Q,
//                dO) streamed by cp.async, dK/dV accumulated in registers;
//                dQ added atomically into an accumulation-type buffer laid
//                out as grad_q, or left to
//   bwd_dq       grid (B * Hq, query blocks): dQ recomputed per query block
//                without atomics (deterministic mode), K/V tiles streamed.
//                Both take 16-bit operands by ldmatrix.
//
// Shared memory holds tiles in the element type, zero beyond the valid rows
// and the head dim, so padded products add zeros. Head dims are padded to a
// compile-time kHeadDim in {64, 128, 256} (launch.h's switch).
#pragma once

#include "../attention_params.h"
#include "../dropout.h"
#include "mma.h"

namespace mha_ext::device {

using namespace mha_ext::simt;

// Tile shapes per element type and padded head dim. The shared-memory bytes
// of each are listed in launch.h next to the launch; registers, spills and
// warps per SM of every configuration are in the README ("CUDA"), from
// scripts/kernel_report.py.
template <typename T, int kHeadDim>
struct TileConfig {
  static constexpr int kElem = static_cast<int>(sizeof(T));
  // forward: query rows per block in 16-row slices, and key rows per tile.
  // A warp takes 16 rows, or in the plain forward kernel (16-bit types up
  // to head dim 128) kFwdRowTiles x 16 = 32: two row tiles that share every
  // K and V fragment it loads, so each ldmatrix of K or V feeds twice the mma.
  static constexpr int kFwdRowTiles = kElem == 2 && kHeadDim <= 128 ? 2 : 1;
  static constexpr int kFwdWarps = kElem == 2 ? 4 : (kElem == 4 ? (kHeadDim <= 64 ? 4 : 2) : (kHeadDim <= 64 ? 2 : 1));
  static constexpr int kFwdBlockN =
      kElem == 2 ? (kHeadDim <= 128 ? 64 : 32) : (kElem == 4 ? (kHeadDim <= 128 ? 32 : 16) : 16);
  // backward: key rows per block = query rows per tile, 16 per row warp;
  // kBwdColSplit warps share each 16 rows, each holding dK / dV (and
  // computing dQ) for 1 / kBwdColSplit of the head dim, so that the
  // accumulators fit in registers (registers and spills: README, "CUDA").
  static constexpr int kBwdRowWarps = kElem == 2 ? (kHeadDim <= 128 ? 4 : 2) : (kElem == 4 ? (kHeadDim <= 128 ? 2 : 1) : 1);
  static constexpr int kBwdColSplit = kElem == 2 ? (kHeadDim <= 64 ? 1 : 2)
                                      : kElem == 4 ? (kHeadDim <= 64 ? 2 : 4)
                                                   : (kHeadDim <= 64 ? 2 : kHeadDim <= 128 ? 4 : 8);
  static constexpr int kBwdWarps = kBwdRowWarps * kBwdColSplit;
  static constexpr int kFwdBlockM = 16 * kFwdWarps;
  // forward tiles of 128 query rows (8 slices: 8 warps, or 4 of 32 rows) for
  // 16-bit types, where the launch picks them (launch.h): K/V tiles shared
  // by twice the rows
  static constexpr int kFwdWideWarps = kElem == 2 ? 8 : kFwdWarps;
  static constexpr int kBwdBlock = 16 * kBwdRowWarps;
  // row padding of the shared tiles: 16 bytes, so rows start in other banks
  // (and every row on a 16-byte boundary, as cp.async and ldmatrix need)
  static constexpr int kPad = 16 / kElem;
  static constexpr int kLd = kHeadDim + kPad;  // Q/K/V/dO tile row stride
  // forward: 16-bit types on the tensor cores keep P in registers (no P tile);
  // K/V tiles double-buffered (the next one loads while this one computes)
  // unless two stages outgrow the 99 KiB per block of sm_86 / sm_89 / sm_120
  // GPUs (float and double at head dim 256 keep one stage and run there)
  static constexpr bool kFwdPInRegisters = kElem == 2;
  static constexpr int kFwdPBytes = kFwdPInRegisters ? 0 : kElem * kFwdBlockM * (kFwdBlockN + kPad);
  static constexpr int kFwdKVStages = kElem * (kFwdBlockM + 4 * kFwdBlockN) * kLd + kFwdPBytes <= 99 * 1024 ? 2 : 1;
  // the forward's shared bytes for `slices` 16-row slices of query rows (Q,
  // the K/V stages, P)
  static constexpr int fwd_shared_bytes(int slices) {
    return kElem * (16 * slices + 2 * kFwdKVStages * kFwdBlockN) * kLd +
           (kFwdPInRegisters ? 0 : kElem * 16 * slices * (kFwdBlockN + kPad));
  }
  static constexpr int kFwdSharedBytes = fwd_shared_bytes(kFwdWarps);
  // backward: the streamed tiles (Q and dO with their rows' shift, log_norm
  // and D in the key-block kernel, K and V in the dQ kernel) double-buffered
  // where two stages fit the same 99 KiB; the fixed tiles, P^T / dS^T, and
  // the stages (bytes each; kAcc: the accumulation type's size)
  static constexpr int kAcc = kElem == 8 ? 8 : 4;
  static constexpr int kBwdLdP = kBwdBlock + kPad;
  static constexpr int kBwdStageBytes = 2 * kElem * kBwdBlock * kLd + 3 * kAcc * kBwdBlock;
  static constexpr int kBwdFixedBytes = 2 * kElem * kBwdBlock * kLd + kElem * kBwdBlock * kBwdLdP;
  static constexpr int kBwdStages = kBwdFixedBytes + 2 * kBwdStageBytes <= 99 * 1024 ? 2 : 1;
  static constexpr int kBwdSharedBytes = kBwdFixedBytes + kBwdStages * kBwdStageBytes;
};

// The plain-load operand path (AttentionFwdParams::scalar_operands) is built
// unless MHA_NO_SCALAR_OPERANDS is defined; tests/test_kernel_ptx.py builds
// without it to hold the default path to ldmatrix alone.
#if defined(MHA_NO_SCALAR_OPERANDS)
constexpr bool kScalarOperandsBuilt = false;
#else
constexpr bool kScalarOperandsBuilt = true;
#endif

// A strided view of a shared-memory tile: element (r, c) at p[r * rs + c * cs].
template <typename T>
struct Tile2 {
  const T* p;
  int rs, cs;
  MHA_DEVICE T at(int r, int c) const { return p[r * rs + c * cs]; }
};

// acc[nt] (16 x 8 each, C-fragment layout) += A (16 x K) * B (K x 8 NT),
// K a multiple of 16; A(r, k) = a.at(r, k), B(k, n) = b.at(k, n).
// 16-bit types: the operands come from shared memory by ldmatrix, matrix m of
// an x4 from the row addresses of lanes 8 m .. 8 m + 7. A is stored by rows
// (a.cs == 1: its four 8 x 8 matrices as they are) or by columns (a.rs == 1:
// transposed on the way, .trans); B by its columns (b.rs == 1: the rows of
// B^T are what mma's "col" operand takes) or by rows (b.cs == 1, .trans).
// Every tile passed here is one of these, with 16-byte aligned rows.
// scalar: the same fragments by plain loads, element by element
// (AttentionFwdParams::scalar_operands).
template <typename T>
MHA_DEVICE void a_frag_scalar(uint32_t (&af)[4], Tile2<T> a, int k0, int lane) {
MHA_UNROLL
  for (int r = 0; r < 4; ++r)
    af[r] = pack2(a.at(MmaLayout::a_row(lane, 2 * r), k0 + MmaLayout::a_col(lane, 2 * r)),
                  a.at(MmaLayout::a_row(lane, 2 * r + 1), k0 + MmaLayout::a_col(lane, 2 * r + 1)));
}
template <typename T>
MHA_DEVICE void b_frag_scalar(uint32_t (&bf)[2], Tile2<T> b, int k0, int nt, int lane) {
MHA_UNROLL
  for (int r = 0; r < 2; ++r)
    bf[r] = pack2(b.at(k0 + MmaLayout::b_row(lane, 2 * r), 8 * nt + MmaLayout::b_col(lane, 2 * r)),
                  b.at(k0 + MmaLayout::b_row(lane, 2 * r + 1), 8 * nt + MmaLayout::b_col(lane, 2 * r + 1)));
}
// x's TF32 part into big, and (3xTF32) the remainder into small (0 where
// big is not finite)
MHA_DEVICE void tf32_split(float f, bool x3, uint32_t& big, uint32_t& small) {
  big = to_tf32(f);
  const float rest = f - tf32_value(big);
  small = x3 && rest - rest == 0.f ? to_tf32(rest) : 0u;
}
// acc += A B from the split operands: small * big + big * small (3xTF32) + big * big
MHA_DEVICE void mma_tf32_terms(float (&acc)[4], const uint32_t (&a_big)[4], const uint32_t (&a_small)[4],
                               const uint32_t (&b_big)[2], const uint32_t (&b_small)[2], bool x3) {
  if (x3) {
    mma_m16n8k8_tf32(acc, a_small, b_big);
    mma_m16n8k8_tf32(acc, a_big, b_small);
  }
  mma_m16n8k8_tf32(acc, a_big, b_big);
}

// float on the tensor cores (fp32 = TF32 or 3xTF32, mma.h's m16n8k8): A by
// ldmatrix when stored by rows, B when stored by its columns, plain loads
// otherwise; 3xTF32 splits x into big = tf32(x) and small = tf32(x - big)
// and sums small * big + big * small + big * big (small * small, about
// 2^-22 of the product, is left out).
template <int NT>
MHA_DEVICE void warp_mma_tf32(float (&acc)[NT][4], Tile2<float> a, Tile2<float> b, int K, int lane, bool scalar,
                              Fp32Math fp32) {
  // B by ldmatrix x4 covers two n-tiles; an odd NT (a single one) loads B by plain loads
  constexpr int kStep = NT % 2 == 0 ? 2 : 1;
  scalar = kScalarOperandsBuilt && scalar;
  const bool x3 = fp32 == Fp32Math::kTf32x3;
  const int g = lane / 4, t = lane % 4, r8 = lane % 8, m_lo = (lane / 8) % 2, m_hi = lane / 16;
MHA_NO_UNROLL
  for (int k0 = 0; k0 < K; k0 += 8) {
    uint32_t ar[4], a_big[4], a_small[4];  // a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
    if (!scalar && a.cs == 1) {
      ldmatrix_x4(ar, a.p + (r8 + 8 * m_lo) * a.rs + k0 + 4 * m_hi);
    } else {
MHA_UNROLL
      for (int r = 0; r < 4; ++r) ar[r] = float_bits(a.at(g + 8 * (r & 1), k0 + t + 4 * (r >> 1)));
    }
MHA_UNROLL
    for (int r = 0; r < 4; ++r) tf32_split(tf32_value(ar[r]), x3, a_big[r], a_small[r]);
MHA_UNROLL
    for (int nt = 0; nt < NT; nt += kStep) {
      uint32_t br[4];  // b0, b1 of n-tile nt, then (kStep 2) of nt + 1
      if (kStep == 2 && !scalar && b.rs == 1) {
        ldmatrix_x4(br, b.p + (8 * nt + 8 * m_hi + r8) * b.cs + k0 + 4 * m_lo);
      } else {
MHA_UNROLL
        for (int r = 0; r < 2 * kStep; ++r) br[r] = float_bits(b.at(k0 + t + 4 * (r & 1), 8 * (nt + (r >> 1)) + g));
      }
MHA_UNROLL
      for (int h = 0; h < kStep; ++h) {
        uint32_t b_big[2], b_small[2];
        tf32_split(tf32_value(br[2 * h]), x3, b_big[0], b_small[0]);
        tf32_split(tf32_value(br[2 * h + 1]), x3, b_big[1], b_small[1]);
        mma_tf32_terms(acc[nt + h], a_big, a_small, b_big, b_small, x3);
      }
    }
  }
}

// 16-bit types on the tensor cores: acc[rt] += A_rt B for the row tiles rt
// with live[rt], A_rt the 16 rows of A from row 16 rt (the warp's row
// tiles), each B fragment loaded once for all of them.
template <typename T, int kRT, int NT>
MHA_DEVICE void warp_mma16(float (&acc)[kRT][NT][4], Tile2<T> a, Tile2<T> b, int K, int lane, bool scalar,
                           const bool (&live)[kRT]) {
  static_assert(NT % 2 == 0, "B fragments come by ldmatrix x4, two n-tiles at a time");
  scalar = kScalarOperandsBuilt && scalar;
  const int r8 = lane % 8, m_lo = (lane / 8) % 2, m_hi = lane / 16;
  // not unrolled over k: unrolled, nvcc hoists the fragments of every k
  // step and the f16 backward at head dim 64 spilled (255 registers)
MHA_NO_UNROLL
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t af[kRT][4];  // matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
MHA_UNROLL
    for (int rt = 0; rt < kRT; ++rt) {
      if (!live[rt]) continue;
      const Tile2<T> at{a.p + 16 * rt * a.rs, a.rs, a.cs};
      if (scalar) {
        a_frag_scalar(af[rt], at, k0, lane);
      } else if (a.cs == 1) {
        ldmatrix_x4(af[rt], at.p + (r8 + 8 * m_lo) * a.rs + k0 + 8 * m_hi);
      } else {
        ldmatrix_x4_trans(af[rt], at.p + (k0 + 8 * m_hi + r8) * a.cs + 8 * m_lo);
      }
    }
MHA_UNROLL
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];  // matrices: (n-tile nt, k 0-7), (nt, k 8-15), (nt + 1, k 0-7), (nt + 1, k 8-15)
      if (scalar) {
        uint32_t s0[2], s1[2];
        b_frag_scalar(s0, b, k0, nt, lane);
        b_frag_scalar(s1, b, k0, nt + 1, lane);
        bf[0] = s0[0], bf[1] = s0[1], bf[2] = s1[0], bf[3] = s1[1];
      } else if (b.rs == 1) {
        ldmatrix_x4(bf, b.p + (8 * nt + 8 * m_hi + r8) * b.cs + k0 + 8 * m_lo);
      } else {
        ldmatrix_x4_trans(bf, b.p + (k0 + 8 * m_lo + r8) * b.rs + 8 * (nt + m_hi));
      }
      const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
MHA_UNROLL
      for (int rt = 0; rt < kRT; ++rt) {
        if (!live[rt]) continue;
        mma_m16n8k16<T>(acc[rt][nt], af[rt], b0);
        mma_m16n8k16<T>(acc[rt][nt + 1], af[rt], b1);
      }
    }
  }
}

template <typename T, int NT, typename A>
MHA_DEVICE void warp_mma(A (&acc)[NT][4], Tile2<T> a, Tile2<T> b, int K, int lane, bool scalar, Fp32Math fp32) {
  if constexpr (std::is_same_v<T, float>) {
    if (fp32 != Fp32Math::kCudaCores) return warp_mma_tf32(acc, a, b, K, lane, scalar, fp32);
  }
  if constexpr (sizeof(T) == 2) {
    const bool live[1] = {true};
    warp_mma16<T, 1, NT>(reinterpret_cast<float(&)[1][NT][4]>(acc), a, b, K, lane, scalar, live);
  } else {
    // CUDA cores: rank-1 updates over k, the accumulators in the C layout
    // (each element still sums k = 0 .. K - 1 in order).
    const int r0 = MmaLayout::c_row(lane, 0), r1 = MmaLayout::c_row(lane, 2), c = MmaLayout::c_col(lane, 0);
    for (int k = 0; k < K; ++k) {
      const A a0 = static_cast<A>(a.at(r0, k)), a1 = static_cast<A>(a.at(r1, k));
MHA_UNROLL
      for (int nt = 0; nt < NT; ++nt) {
        const A b0 = static_cast<A>(b.at(k, 8 * nt + c)), b1 = static_cast<A>(b.at(k, 8 * nt + c + 1));
        acc[nt][0] += a0 * b0;
        acc[nt][1] += a0 * b1;
        acc[nt][2] += a1 * b0;
        acc[nt][3] += a1 * b1;
      }
    }
  }
}

// O (16 x 8 OT) += P V for float on the tensor cores, P (16 x 8 KT) in the C
// fragments of S = Q K^T and V (8 KT keys x 8 OT) by rows in shared memory.
// A lane holds P at keys 2t, 2t + 1 of each 8 (t = lane % 4) where TF32's A
// fragment wants k = t and t + 4; the sum over keys does not depend on their
// order, so k = t stands for key 2t and k = t + 4 for key 2t + 1, in P's
// fragment (c0 -> a0, c2 -> a1, c1 -> a2, c3 -> a3: no shuffles) and in V's
// rows alike (b0 from key 2t, b1 from key 2t + 1, by plain loads; with the
// 4-float row padding the 32 lanes hit 32 banks).
template <int KT, int OT>
MHA_DEVICE void pv_tf32(float (&o)[OT][4], const float (&pf)[KT][4], const float* v_s, int ld, int lane, bool x3) {
  const int g = lane / 4, t = lane % 4;
MHA_UNROLL
  for (int kt = 0; kt < KT; ++kt) {
    uint32_t a_big[4], a_small[4];
    const float a[4] = {pf[kt][0], pf[kt][2], pf[kt][1], pf[kt][3]};
MHA_UNROLL
    for (int r = 0; r < 4; ++r) tf32_split(a[r], x3, a_big[r], a_small[r]);
    const float* v0 = v_s + (8 * kt + 2 * t) * ld + g;
MHA_UNROLL
    for (int ot = 0; ot < OT; ++ot) {
      uint32_t b_big[2], b_small[2];
      tf32_split(v0[8 * ot], x3, b_big[0], b_small[0]);
      tf32_split(v0[ld + 8 * ot], x3, b_big[1], b_small[1]);
      mma_tf32_terms(o[ot], a_big, a_small, b_big, b_small, x3);
    }
  }
}

// Zeroes a set of accumulator fragments.
template <typename A, int N>
MHA_DEVICE void zero(A (&acc)[N][4]) {
MHA_UNROLL
  for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = A(0);
}

// Copies rows [r0, r0 + rows) x cols [0, cols) of a strided global matrix
// into a (kRows x kCols) shared tile with row stride ld, zero elsewhere.
template <typename T>
MHA_DEVICE void load_tile(T* dst, int ld, int k_rows, int k_cols, const T* src, int64_t rs, int64_t cs,
                          int64_t r0, int64_t rows, int64_t cols) {
  const int n = k_rows * k_cols, step = static_cast<int>(block_dim().x);
  for (int idx = static_cast<int>(thread_idx().x); idx < n; idx += step) {
    const int r = idx / k_cols, c = idx % k_cols;
    const bool valid = r0 + r < rows && c < cols;
    dst[r * ld + c] = valid ? src[(r0 + r) * rs + c * cs] : to_elem<T>(0.f);
  }
}

// The same copy issued asynchronously: 16-byte cp.async chunks where the
// source rows are contiguous and 16-byte aligned (the common case), plain
// stores for the rest (strided or misaligned inputs, the zero padding, a
// partial last chunk). The caller commits the group and waits for it before
// a barrier: cp.async data lands at the wait, the plain stores are visible
// after the barrier.
template <typename T>
MHA_DEVICE void load_tile_async(T* dst, int ld, int k_rows, int k_cols, const T* src, int64_t rs, int64_t cs,
                                int64_t rows, int64_t cols) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool vec = cs == 1 && (rs * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (!vec) return load_tile(dst, ld, k_rows, k_cols, src, rs, cs, 0, rows, cols);
  const int chunks = k_cols / kVec, n = k_rows * chunks, step = static_cast<int>(block_dim().x);
  // (float16 / bfloat16: in the float and double kernels the extra loop cost
  // registers, float's dQ 16 -> 8 warps per SM on sm_90, double new spills)
  if (sizeof(T) == 2 && rows >= k_rows && cols == k_cols && step % chunks == 0) {
    // a whole tile (every key tile but a sequence's last, at head dims 64 /
    // 128 / 256): no bounds tests, unsigned index arithmetic (19 SASS
    // instructions a chunk on sm_90, 3 of them the never-executed loads nvcc
    // puts before each cp.async; the general loop below takes 39)
    const unsigned uchunks = static_cast<unsigned>(chunks);
    for (unsigned idx = thread_idx().x; idx < static_cast<unsigned>(n); idx += static_cast<unsigned>(step)) {
      const unsigned r = idx / uchunks, c = (idx % uchunks) * kVec;
      cp_async_16(dst + r * static_cast<unsigned>(ld) + c, src + static_cast<int64_t>(r) * rs + c);
    }
    return;
  }
  for (int idx = static_cast<int>(thread_idx().x); idx < n; idx += step) {
    const int r = idx / chunks, c = (idx % chunks) * kVec;
    T* d = dst + r * ld + c;
    if (r < rows && c + kVec <= cols) {
      cp_async_16(d, src + r * rs + c);
    } else {
MHA_UNROLL
      for (int x = 0; x < kVec; ++x) d[x] = (r < rows && c + x < cols) ? src[r * rs + c + x] : to_elem<T>(0.f);
    }
  }
}

template <typename T>
MHA_DEVICE const T* as(const void* p) { return static_cast<const T*>(p); }

// Whether row i may see key j (causal alignment and window).
MHA_DEVICE bool in_band(const AttentionFwdParams& p, int64_t i, int64_t j) {
  return j >= p.variant.begin(i) && j < p.variant.end(i, p.len_kv);
}

// The one score transform of the CUDA kernels (AttentionVariant): the score
// of query row i and key column j of head (b, h) from the raw dot product s:
// scaled, softcapped, ALiBi, the mask, and -inf where the row may not see
// the key (causal alignment and window).
template <typename T, typename A>
MHA_DEVICE A masked_score(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j, A s) {
  const AttentionVariant& w = p.variant;
  A x = s * static_cast<A>(p.scale);
  if (w.softcap > 0.0) x = static_cast<A>(w.softcap) * ftanh(x / static_cast<A>(w.softcap));
  if (w.alibi != nullptr) {
    const int64_t d = i + w.diag_offset - j;
    x -= static_cast<const A*>(w.alibi)[b * w.alibi_stride_b + h * w.alibi_stride_h] * static_cast<A>(d < 0 ? -d : d);
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t off = b * p.mask_stride.b + h * p.mask_stride.h + i * p.mask_stride.row + j * p.mask_stride.col;
    if (p.mask_kind == MaskKind::kBool) {
      if (!as<bool>(p.mask)[off]) x = -INFINITY;
    } else {
      x += static_cast<A>(to_float(as<T>(p.mask)[off]));
    }
  }
  return in_band(p, i, j) ? x : A(-INFINITY);
}

// Whether every score of rows [i_lo, i_hi] and keys [j_lo, j_hi] is the
// scaled dot product alone: inside the lengths and the causal / window band,
// no mask, no softcap or ALiBi. Such tiles skip masked_score's per-element
// checks (edge and diagonal tiles take them).
MHA_DEVICE bool interior_tile(const AttentionFwdParams& p, int64_t i_lo, int64_t i_hi, int64_t j_lo, int64_t j_hi) {
  return p.mask_kind == MaskKind::kNone && !p.variant.changes_scores() && i_hi < p.len_q && j_hi < p.len_kv &&
         p.variant.begin(i_hi) <= j_lo && p.variant.end(i_lo, p.len_kv) > j_hi;
}

// The forward's softmax units: base 2 for float accumulation (exp2, the
// scale times log2(e) folded into the scores), base e for double.
// from_nats: a score in these units; a finite score that would overflow
// (finfo.min padding in a float mask) is clamped to the largest finite value,
// so a row padded everywhere stays uniform instead of "masked out" (as the
// CPU kernels' mask_in_units).
template <typename A>
struct SoftmaxUnits {
  static constexpr A kPerNat = A(1);
  MHA_DEVICE static A from_nats(A x) { return x; }
  MHA_DEVICE static A scaled(A x, A scale) { return x * scale; }
  MHA_DEVICE static A exp(A x) { return fexp(x); }
  MHA_DEVICE static A log(A x) { return flog(x); }
};
template <>
struct SoftmaxUnits<float> {
  static constexpr float kPerNat = 1.4426950408889634f;  // log2(e)
  static constexpr float kMax = 3.40282347e+38f;
  MHA_DEVICE static float from_nats(float x) {
    const float u = fmul_rn(x, kPerNat);  // never fused into a later subtraction: scaled's bits
    return (u < -kMax && x >= -kMax) ? -kMax : ((u > kMax && x <= kMax) ? kMax : u);
  }
  MHA_DEVICE static float exp(float x) { return fexp2(x); }
  MHA_DEVICE static float log(float x) { return flog2(x); }
  // from_nats(x * scale) where that product does not overflow: the same
  // bits (two roundings, neither multiply fused), without the clamp
  MHA_DEVICE static float scaled(float x, float scale) { return fmul_rn(fmul_rn(x, scale), kPerNat); }
};

// Whether a warp's tile of raw dot products s (the C fragments of S = Q K^T)
// may take the plain softmax: float16 / bfloat16, an interior tile (no mask,
// softcap, ALiBi or bounds inside it), scale > 0, and every s finite and
// finite once scaled (one NaN-propagating max of |s| a score and a vote).
// Then each score in the softmax's units is SoftmaxUnits::scaled(s, scale),
// the bits the exact path's from_nats(s * scale) gives, so a row's tiles and
// its backward agree whichever path each took; the forward's probabilities
// are exp2(u - m) and the backward's exp2(min(u - shift, 0) - log_norm),
// with no clamp, NaN test or branch per score. interior and scale are the
// same on every lane, so every lane votes. (float and double keep the exact
// path: the plain one cost them registers.)
template <typename T, int N, typename A>
MHA_DEVICE bool plain_scores(const A (&s)[N][4], bool interior, A scale) {
  if constexpr (sizeof(T) == 2) {
    if (!interior || !(scale > A(0))) return false;
    A amax = A(0);
MHA_UNROLL
    for (int t = 0; t < N; ++t)
MHA_UNROLL
      for (int e = 0; e < 4; ++e) amax = nan_max(amax, fabsf(s[t][e]));
    // both roundings are monotonic: no |s| of the tile scales past amax's
    return vote_all(SoftmaxUnits<A>::scaled(amax, scale) <= SoftmaxUnits<A>::kMax);  // false for NaN
  }
  return false;
}

// d(score) / d(scale * dot product): the softcap's 1 - tanh^2, else 1.
template <typename A>
MHA_DEVICE A score_slope(const AttentionFwdParams& p, A s) {
  if (!(p.variant.softcap > 0.0)) return A(1);
  const A t = ftanh(s * static_cast<A>(p.scale) / static_cast<A>(p.variant.softcap));
  return A(1) - t * t;
}

// dropout.h's stream: the (seed, offset) a kernel resolved at its start
// (from values or device memory, see DropoutParams), and whether element
// (b, h, i, j) is kept.
struct DropoutKey {
  uint64_t seed = 0, offset = 0;
  DropoutFrame frame;
};
MHA_DEVICE DropoutKey dropout_key(const DropoutParams& d) {
  return d.enabled() ? DropoutKey{d.seed_value(), d.offset_value(), dropout_frame(d)} : DropoutKey{};
}
// the row's draws are those of its lse entry's index (or of its row in the
// frame), as on the CPU
MHA_DEVICE uint64_t dropout_row(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h, int64_t i) {
  return p.dropout_row(key.frame, b, h, i);
}
// the draws of the call's column j: those of column j + col0 of the frame
MHA_DEVICE Philox4 dropout_draws(const DropoutKey& key, uint64_t row, int64_t j) {
  return philox4x32_10(key.seed, row, key.offset + static_cast<uint64_t>((j + key.frame.col0) >> 2));
}
// word w & 3 of a draw, by selects: indexing the array with a run-time value
// would put the four words on the stack
MHA_DEVICE uint32_t philox_word(const Philox4& r, int64_t w) {
  const int64_t i = w & 3;
  return i == 0 ? r.w[0] : i == 1 ? r.w[1] : i == 2 ? r.w[2] : r.w[3];
}
MHA_DEVICE bool dropout_keep(const DropoutParams& d, const DropoutKey& key, uint64_t row, int64_t j) {
  return philox_word(dropout_draws(key, row, j), j + key.frame.col0) >= d.drop_threshold;
}

// The keep bits of one 16 x 8 C fragment, bit e for element e (rows g, g,
// g + 8, g + 8; columns 2c, 2c + 1, 2c, 2c + 1; lane 4g + c), drawn by the
// lanes together: where the frame keeps Philox blocks on 4-column boundaries
// of the fragment, each lane draws one block and passes words to the lanes
// that need them, one Philox call per 4 elements (otherwise each element's
// own block, as on the CPU). Every lane of the warp must call it.
//
// Fragment rows are query rows i_lo = base + g (and + 8), columns keys j8 ..
// j8 + 7 (forward, dQ kernel): lanes c and c ^ 1 cover 4 keys, one block per
// row; lane c even draws row g's, odd row g + 8's, and each passes the
// other the two words it needs.
MHA_DEVICE unsigned dropout_bits_query_rows(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h,
                                            int64_t i_lo, int64_t j8, int lane) {
  const uint32_t thr = p.dropout.drop_threshold;
  const int c = lane % 4;
  unsigned bits = 0;
  if ((key.frame.col0 & 3) == 0 && (j8 & 3) == 0) {
    const bool odd = c & 1;
    const Philox4 w = dropout_draws(key, dropout_row(p, key, b, h, odd ? i_lo + 8 : i_lo), j8 + 4 * (c / 2));
    const uint32_t got0 = shfl_xor(odd ? w.w[0] : w.w[2], 1), got1 = shfl_xor(odd ? w.w[1] : w.w[3], 1);
    const uint32_t k0 = odd ? got0 : w.w[0], k1 = odd ? got1 : w.w[1];  // row g, columns 2c, 2c + 1
    const uint32_t k2 = odd ? w.w[2] : got0, k3 = odd ? w.w[3] : got1;  // row g + 8
    bits = unsigned(k0 >= thr) | unsigned(k1 >= thr) << 1 | unsigned(k2 >= thr) << 2 | unsigned(k3 >= thr) << 3;
  } else {
    for (int e = 0; e < 4; ++e)
      bits |= unsigned(dropout_keep(p.dropout, key, dropout_row(p, key, b, h, i_lo + 8 * (e / 2)), j8 + 2 * c + e % 2))
              << e;
  }
  return bits;
}

// Fragment rows are keys j_lo = base + g (and + 8), columns query rows i8 ..
// i8 + 7 (the key-block kernel's S^T): lanes g = 4q + r, r = 0 .. 3, of a
// column pair need the same four blocks (queries 2c + (r & 1), keys of g +
// 8 (r >> 1)), word r of each; lane r draws block r and a 4 x 4 transpose
// across the four lanes (lane ^ 8, then lane ^ 4) hands each its words.
MHA_DEVICE unsigned dropout_bits_key_rows(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h,
                                          int64_t j_lo, int64_t i8, int lane) {
  const uint32_t thr = p.dropout.drop_threshold;
  const int c = lane % 4, r = (lane / 4) % 4, hi = r >> 1, lo = r & 1;
  unsigned bits = 0;
  if ((key.frame.col0 & 3) == 0 && ((j_lo - r) & 3) == 0) {
    const Philox4 w = dropout_draws(key, dropout_row(p, key, b, h, i8 + 2 * c + lo), j_lo - r + 8 * hi);
    // to lane r ^ 2 the words it keeps (2 hi', 2 hi' + 1); from it, block r ^ 2's words 2 hi, 2 hi + 1
    const uint32_t a0 = hi ? w.w[2] : w.w[0], a1 = hi ? w.w[3] : w.w[1];
    const uint32_t x0 = shfl_xor(hi ? w.w[0] : w.w[2], 8), x1 = shfl_xor(hi ? w.w[1] : w.w[3], 8);
    // to lane r ^ 1 the words it needs (index 1 - lo of the pairs); word r of blocks r .. r ^ 3
    const uint32_t own_a = lo ? a1 : a0, own_b = lo ? x1 : x0;
    const uint32_t got_a = shfl_xor(lo ? a0 : a1, 4), got_b = shfl_xor(lo ? x0 : x1, 4);
    for (int e = 0; e < 4; ++e) {
      const int d = e ^ r;  // block e is block r ^ d
      const uint32_t word = d == 0 ? own_a : d == 1 ? got_a : d == 2 ? own_b : got_b;
      bits |= unsigned(word >= thr) << e;
    }
  } else {
    for (int e = 0; e < 4; ++e)
      bits |= unsigned(dropout_keep(p.dropout, key, dropout_row(p, key, b, h, i8 + 2 * c + e % 2), j_lo + 8 * (e / 2)))
              << e;
  }
  return bits;
}

// The keep bits of kTiles fragments side by side, 8 columns apart from
// column col0 (row_lo: the fragment row of lane's g), 4 each as above, drawn
// in a loop that is not unrolled (the draws one after another, not all live
// at once); 0 without dropout. kKeyRows: the fragments' rows are keys.
template <int kTiles, bool kKeyRows>
MHA_DEVICE uint32_t dropout_tile_bits(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h,
                                      int64_t row_lo, int64_t col0, int lane) {
  static_assert(4 * kTiles <= 32);
  if (!p.dropout.enabled()) return 0;
  uint32_t keep = 0;
MHA_NO_UNROLL
  for (int t = 0; t < kTiles; ++t)
    keep |= (kKeyRows ? dropout_bits_key_rows(p, key, b, h, row_lo, col0 + 8 * t, lane)
                      : dropout_bits_query_rows(p, key, b, h, row_lo, col0 + 8 * t, lane))
            << (4 * t);
  return keep;
}

// Sum / max over the 4 lanes that share a row (lanes 4g .. 4g + 3).
template <typename A>
MHA_DEVICE A row_sum4(A x) {
  x += shfl_xor(x, 1);
  return x + shfl_xor(x, 2);
}
template <typename A>
MHA_DEVICE A row_max4(A x) {
  x = nan_max(x, shfl_xor(x, 1));
  return nan_max(x, shfl_xor(x, 2));
}

// f(i, c, x) for each element of a warp's output C fragments o (its rows
// from row0) that is a real output (i < L, c < Ev), x = o / the row's sum
// (inv: the two rows' reciprocals).
template <int kOT, typename A, typename F>
MHA_DEVICE void for_each_output(const A (&o)[kOT][4], const A (&inv)[2], int64_t row0, int64_t L, int64_t Ev,
                                int lane, F&& f) {
MHA_UNROLL
  for (int t = 0; t < kOT; ++t)
MHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int64_t i = row0 + MmaLayout::c_row(lane, e);
      const int c = 8 * t + MmaLayout::c_col(lane, e);
      if (i < L && c < Ev) f(i, c, o[t][e] * inv[e / 2]);
    }
}

// The tile stream of every kernel: body(t, stage) for the tiles at
// t = first, first + step, .. < end, each once its loads (issue(t, stage):
// cp.async copies and one commit, plus plain stores) are in for every
// thread. Two stages: the next tile's loads are issued before this tile's
// body runs; one stage: after every thread is done with the last tile.
template <int kStages, typename Issue, typename Body>
MHA_DEVICE void stream_tiles(int64_t first, int64_t end, int64_t step, Issue&& issue, Body&& body) {
  if (kStages == 2 && first < end) issue(first, 0);
  int stage = 0;
  for (int64_t t = first; t < end; t += step, stage = (stage + 1) % kStages) {
    if (kStages == 1) {
      sync_threads();  // the previous tile's readers are done
      issue(t, 0);
    }
    cp_async_wait<0>();
    sync_threads();  // this tile is in for every thread; the other stage's readers are done
    if (kStages == 2 && t + step < end) issue(t + step, 1 - stage);  // the next tile loads meanwhile
    body(t, stage);
  }
}

// ---------------------------------------------------------------------------
// Forward. Shared: Q (kM x kLd), kFwdKVStages x (K and V (kBlockN x kLd)),
// and for float / double P (kM x kLdP). 16-bit types: the Q, K and V
// operands come from shared memory by ldmatrix (V transposed), P stays in
// registers (the C fragments of S = Q K^T, exponentiated, are the A
// fragments of O += P V), and a warp may take two row tiles of 16 rows
// (kPlain below), which share each K and V fragment it loads. float on the
// tensor cores (TF32 / 3xTF32): Q and K by ldmatrix, at head dim 64 P in
// registers as well (pv_tf32), V by plain loads.
//
// kPlain: the kernel of calls without a mask tensor, dropout, softcap or
// ALiBi (plain_call below; causal alignment, windows, key splits, varlen and
// KV caches stay), 16-bit types up to head dim 128, where the launch picks
// it. Its warps take 32 rows (TileConfig::kFwdRowTiles): the registers the
// general kernel spends on the mask, the score variants and the dropout
// draws (ptxas: about 186 to run the general one at head dim 128 without
// spills, 143 without those) hold the second row tile's O and S instead.
template <typename T, int kHeadDim, bool kPlain>
MHA_KERNEL attention_fwd_kernel(const AttentionFwdParams params) {
  using A = typename AccOf<T>::type;
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kN = Cfg::kFwdBlockN, kLd = Cfg::kLd, kLdP = kN + Cfg::kPad;
  // a warp's row tiles of 16 rows
  constexpr int kRT = kPlain ? Cfg::kFwdRowTiles : 1;
  static_assert(!kPlain || kRT == 2, "the plain kernel is built where warps take 32 rows");
  constexpr int kNT = kN / 8, kOT = kHeadDim / 8, kStages = Cfg::kFwdKVStages;
  constexpr bool kPInRegisters = Cfg::kFwdPInRegisters;
  using Units = SoftmaxUnits<A>;
  // the block's query rows
  const int kM = 16 * kRT * static_cast<int>(block_dim().x / kWarpSize);
  T* q_s = dynamic_shared<T>();
  T* kv_s = q_s + kM * kLd;  // stage st: K at kv_s + 2 st kN kLd, V after it
  T* p_s = kv_s + 2 * kStages * kN * kLd;

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  // grid: query blocks on x, so the blocks of one head run side by side and
  // share its K/V tiles in L2; (batch, head) on y and z (launch.h)
  const int64_t bh = static_cast<int64_t>(block_idx().z) * grid_dim().y + block_idx().y;
  if (bh >= params.batch * params.heads_q) return;  // the last z slice's spare blocks
  const int64_t b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionFwdParams p = sequence_params<T, A>(params, b);  // params itself unless varlen
  // x: the query block, then the key split (kv_splits runs of the grid's query blocks)
  const unsigned q_blocks = static_cast<unsigned>((params.len_q + kM - 1) / kM);
  const unsigned split = block_idx().x / q_blocks;
  const int64_t i0 = static_cast<int64_t>(block_idx().x % q_blocks) * kM;
  const int64_t L = p.len_q, S = p.len_kv;
  if (i0 >= L) return;  // a block past a shorter sequence's rows (varlen)
  const A rescale = static_cast<A>(p.dropout.rescale);
  const A scale = static_cast<A>(p.scale);
  const DropoutKey key = dropout_key(p.dropout);
  // float on the tensor cores keeps P in registers too (pv_tf32) at head dim
  // 64 (at 128 and 256 the unrolled P V spilled: 16 and 52 bytes on sm_80);
  // otherwise, and on the CUDA cores (and double), P goes through p_s
  const bool p_in_registers = std::is_same_v<T, float> && kHeadDim <= 64 && p.fp32_math != Fp32Math::kCudaCores;
  // the warp's first query row (row tile rt: 16 rows from iw_base + 16 rt)
  // and its Q rows in shared memory
  const int64_t iw_base = i0 + static_cast<int64_t>(warp) * 16 * kRT;
  const T* q_w = q_s + warp * 16 * kRT * kLd;

  load_tile(q_s, kLd, kM, kHeadDim, as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h, p.q_stride.row,
            p.q_stride.col, i0, L, p.head_dim);

  A o[kRT][kOT][4], m_run[kRT][2], l_run[kRT][2];
MHA_UNROLL
  for (int rt = 0; rt < kRT; ++rt) {
    zero(o[rt]);
    m_run[rt][0] = m_run[rt][1] = A(-INFINITY);
    l_run[rt][0] = l_run[rt][1] = A(0);
  }
  // the key tiles some row of the block may see (causal alignment, window)
  const int64_t vis_end = p.variant.end((i0 + kM < L ? i0 + kM : L) - 1, S);
  const int64_t vis_first = p.variant.begin(i0) / kN * kN;
  // with key splits, this split's run of those tiles (empty past the last)
  const int64_t run = p.kv_splits > 1 && vis_end > vis_first
                          ? ((vis_end - vis_first + kN - 1) / kN + p.kv_splits - 1) / p.kv_splits * kN : 0;
  const int64_t j_first = vis_first + split * run;
  const int64_t kv_end = p.kv_splits > 1 ? (j_first + run < vis_end ? j_first + run : vis_end) : vis_end;
  // Issues the loads of the tile at key j into stage st, as one cp.async
  // group; its rows from kv_offset of its first (a tile of a paged KV cache
  // lies in one block; the plain kernel takes no paged caches: their block
  // lookups cost it registers it has not got).
  const T* k_head = as<T>(p.k) + (kPlain ? b * p.k_stride.b + hk * p.k_stride.h : 0);
  const T* v_head = as<T>(p.v) + (kPlain ? b * p.v_stride.b + hk * p.v_stride.h : 0);
  auto issue = [&](int64_t j, int st) {
    T* k_dst = kv_s + 2 * st * kN * kLd;
    const int64_t k_off = kPlain ? j * p.k_stride.row : p.kv_offset(p.k_stride, b, hk, j);
    const int64_t v_off = kPlain ? j * p.v_stride.row : p.kv_offset(p.v_stride, b, hk, j);
    load_tile_async(k_dst, kLd, kN, kHeadDim, k_head + k_off, p.k_stride.row, p.k_stride.col, S - j, p.head_dim);
    load_tile_async(k_dst + kN * kLd, kLd, kN, kHeadDim, v_head + v_off, p.v_stride.row, p.v_stride.col, S - j,
                    p.head_dim_v);
    cp_async_commit();
  };
  stream_tiles<kStages>(j_first, kv_end, kN, issue, [&](int64_t j0, int stage) {
    const T* k_s = kv_s + 2 * stage * kN * kLd;
    const T* v_s = k_s + kN * kLd;

    // The plain kernel's row tiles that hold rows below L and see some key
    // of this tile (the causal / window band: begin and end grow with the
    // row); the others skip it, as a tile of -inf scores would leave them.
    // (The general kernel's one row tile takes every tile: skipping cost it
    // registers.)
    bool live[kRT];
    if constexpr (kPlain) {
      bool any = false;
MHA_UNROLL
      for (int rt = 0; rt < kRT; ++rt) {
        const int64_t r0 = iw_base + 16 * rt, r1 = r0 + 15 < L ? r0 + 15 : L - 1;
        live[rt] = r0 < L && j0 < p.variant.end(r1, S) && j0 + kN > p.variant.begin(r0);
        any = any || live[rt];
      }
      if (!any) return;
    } else {
      live[0] = true;
    }

    A s[kRT][kNT][4];
MHA_UNROLL
    for (int rt = 0; rt < kRT; ++rt) zero(s[rt]);
    // S = Q K^T (16-bit operands by ldmatrix: Q rows as A, K rows as B)
    if constexpr (sizeof(T) == 2) {
      warp_mma16<T, kRT, kNT>(s, Tile2<T>{q_w, kLd, 1}, Tile2<T>{k_s, 1, kLd}, kHeadDim, lane, p.scalar_operands,
                              live);
    } else {
      warp_mma<T>(s[0], Tile2<T>{q_w, kLd, 1}, Tile2<T>{k_s, 1, kLd}, kHeadDim, lane, p.scalar_operands,
                  p.fp32_math);
    }

MHA_UNROLL
    for (int rt = 0; rt < kRT; ++rt) {
      if (!live[rt]) continue;
      A(&sr)[kNT][4] = s[rt];
      A(&m_r)[2] = m_run[rt];
      const int64_t iw0 = iw_base + 16 * rt;
      // Scores in the softmax's units. Edge and diagonal tiles go through
      // masked_score per element; an interior tile (interior_tile: every row
      // of the row tile sees it whole) is only scaled, or where plain_scores
      // allows, not even that: the row max is taken on the dot products.
      A tile_max[2] = {-INFINITY, -INFINITY};
      // (rows past L count as inside: their Q rows are zero and their output
      // is never written, so a decode step's one row, or a GQA group packed
      // into fewer than 16 rows, still takes the interior path)
      const bool interior = interior_tile(p, iw0, iw0 + 15 < L ? iw0 + 15 : L - 1, j0, j0 + kN - 1);
      const bool fast = plain_scores<T>(sr, interior, scale);
      if constexpr (std::is_same_v<A, float>) {
        if (fast) {
MHA_UNROLL
          for (int t = 0; t < kNT; ++t)
MHA_UNROLL
            for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], sr[t][e]);
          // scale > 0 and rounding is monotonic: the scaled max is the max scaled
          tile_max[0] = Units::scaled(tile_max[0], scale);
          tile_max[1] = Units::scaled(tile_max[1], scale);
        }
      }
      if (!fast && interior && !kPlain) {
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            sr[t][e] = Units::from_nats(sr[t][e] * scale);
            tile_max[e / 2] = nan_max(tile_max[e / 2], sr[t][e]);
          }
      } else if (!fast && kPlain) {
        // the plain kernel's calls have no score transform but the band: the
        // columns [lo, hi) of this tile that each of the lane's two rows sees
        // (none past L; the band ends at S), compared in 32 bits (interior
        // tiles too: all of it)
        int lo[2], hi[2];
MHA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int64_t i = iw0 + MmaLayout::c_row(lane, 2 * r);
          const int64_t jb = p.variant.begin(i) - j0, je = p.variant.end(i, S) - j0;
          lo[r] = i < L ? static_cast<int>(jb < 0 ? 0 : jb > kN ? kN : jb) : kN;
          hi[r] = i < L ? static_cast<int>(je < 0 ? 0 : je > kN ? kN : je) : 0;
        }
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int c = 8 * t + MmaLayout::c_col(lane, e);
            sr[t][e] = c >= lo[e / 2] && c < hi[e / 2] ? Units::from_nats(sr[t][e] * scale) : A(-INFINITY);
            tile_max[e / 2] = nan_max(tile_max[e / 2], sr[t][e]);
          }
      } else if (!fast) {
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int64_t i = iw0 + MmaLayout::c_row(lane, e);
            const int64_t j = j0 + 8 * t + MmaLayout::c_col(lane, e);
            sr[t][e] = (i < L && j < S) ? Units::from_nats(masked_score<T>(p, b, h, i, j, sr[t][e])) : A(-INFINITY);
            tile_max[e / 2] = nan_max(tile_max[e / 2], sr[t][e]);
          }
      }
      A alpha[2];
MHA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const A new_max = nan_max(m_r[r], row_max4(tile_max[r]));
        // alpha rescales what was accumulated under the old max (nothing yet if it was -inf)
        alpha[r] = m_r[r] == A(-INFINITY) ? A(0) : Units::exp(m_r[r] - new_max);
        m_r[r] = new_max;
      }
      A part[2] = {A(0), A(0)};
      const uint32_t keep = kPlain ? 0u : dropout_tile_bits<kNT, false>(p, key, b, h, iw0 + MmaLayout::c_row(lane, 0), j0, lane);
      // the probabilities of keys 8 t + c_col(lane, e) and the next, rows r = e / 2
      auto take = [&](int t, int e, A p0, A p1) {
        const int r = e / 2;
        part[r] += p0 + p1;
        if (!kPlain && p.dropout.enabled()) {
          p0 = (keep >> (4 * t + e)) & 1u ? p0 * rescale : A(0);
          p1 = (keep >> (4 * t + e + 1)) & 1u ? p1 * rescale : A(0);
        }
        if (kPInRegisters || p_in_registers) {
          sr[t][e] = p0;
          sr[t][e + 1] = p1;
        } else {
          T* dst = p_s + (iw0 - i0 + MmaLayout::c_row(lane, e)) * kLdP + 8 * t + MmaLayout::c_col(lane, e);
          dst[0] = to_elem<T>(p0);
          dst[1] = to_elem<T>(p1);
        }
      };
      if (fast) {  // m_r is finite here (or NaN from an earlier tile, which the row keeps)
        if constexpr (sizeof(T) == 2) {
          // the scaled score rounded before the subtraction (no FMA): the row's
          // max key then gets exactly 2^0, whatever the magnitude of its score
MHA_UNROLL
          for (int t = 0; t < kNT; ++t)
MHA_UNROLL
            for (int e = 0; e < 4; e += 2) {
              const A m = m_r[e / 2];
              take(t, e, softmax_exp2<T>(Units::scaled(sr[t][e], scale) - m),
                   softmax_exp2<T>(Units::scaled(sr[t][e + 1], scale) - m));
            }
        }
      } else {
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; e += 2) {
            const int r = e / 2;
            take(t, e, m_r[r] == A(-INFINITY) ? A(0) : Units::exp(sr[t][e] - m_r[r]),
                 m_r[r] == A(-INFINITY) ? A(0) : Units::exp(sr[t][e + 1] - m_r[r]));
          }
      }
MHA_UNROLL
      for (int r = 0; r < 2; ++r) l_run[rt][r] = l_run[rt][r] * alpha[r] + part[r];
MHA_UNROLL
      for (int t = 0; t < kOT; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) o[rt][t][e] *= alpha[e / 2];
    }

    if constexpr (kPInRegisters) {  // O += P V: P's A fragments from the C fragments of 16 keys, V by ldmatrix.trans
MHA_UNROLL
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t pa[kRT][4];
MHA_UNROLL
        for (int rt = 0; rt < kRT; ++rt) {
          const A(&c0)[4] = s[rt][2 * kk];
          const A(&c1)[4] = s[rt][2 * kk + 1];
          pa[rt][0] = pack2(to_elem<T>(c0[0]), to_elem<T>(c0[1]));
          pa[rt][1] = pack2(to_elem<T>(c0[2]), to_elem<T>(c0[3]));
          pa[rt][2] = pack2(to_elem<T>(c1[0]), to_elem<T>(c1[1]));
          pa[rt][3] = pack2(to_elem<T>(c1[2]), to_elem<T>(c1[3]));
        }
MHA_UNROLL
        for (int ot = 0; ot < kOT; ot += 2) {
          uint32_t vf[4];
          if (kScalarOperandsBuilt && p.scalar_operands) {
            uint32_t s0[2], s1[2];
            b_frag_scalar(s0, Tile2<T>{v_s, kLd, 1}, 16 * kk, ot, lane);
            b_frag_scalar(s1, Tile2<T>{v_s, kLd, 1}, 16 * kk, ot + 1, lane);
            vf[0] = s0[0], vf[1] = s0[1], vf[2] = s1[0], vf[3] = s1[1];
          } else {
            ldmatrix_x4_trans(vf, v_s + (16 * kk + 8 * ((lane / 8) % 2) + lane % 8) * kLd + 8 * (ot + lane / 16));
          }
          const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
MHA_UNROLL
          for (int rt = 0; rt < kRT; ++rt) {
            if (!live[rt]) continue;
            mma_m16n8k16<T>(o[rt][ot], pa[rt], b0);
            mma_m16n8k16<T>(o[rt][ot + 1], pa[rt], b1);
          }
        }
      }
    } else if (p_in_registers) {  // (one row tile from here on)
      if constexpr (std::is_same_v<T, float>) pv_tf32(o[0], s[0], v_s, kLd, lane, p.fp32_math == Fp32Math::kTf32x3);
    } else {
      sync_warp();  // the warp's P rows are written
      warp_mma<T>(o[0], Tile2<T>{p_s + (iw_base - i0) * kLdP, kLdP, 1}, Tile2<T>{v_s, kLd, 1}, kN, lane,
                  p.scalar_operands, p.fp32_math);
    }
  });

MHA_UNROLL
  for (int rt = 0; rt < kRT; ++rt) {
    const int64_t row0 = iw_base + 16 * rt;
    A l[2], inv[2];
MHA_UNROLL
    for (int r = 0; r < 2; ++r) {
      l[r] = row_sum4(l_run[rt][r]);
      inv[r] = l[r] > A(0) ? A(1) / l[r] : A(0);  // 0 for a fully masked row (l = 0)
    }
    if (p.kv_splits > 1) {  // this split's rows for the combine kernel (dense rows: i indexes L)
      const int64_t rows = p.kv_splits * p.batch * p.heads_q * L, srow0 = (split * p.batch * p.heads_q + bh) * L;
      A* po = static_cast<A*>(p.part_out) + srow0 * p.head_dim_v;
      A* pm = static_cast<A*>(p.part_ml) + srow0;
      for_each_output(o[rt], inv, row0, L, p.head_dim_v, lane,
                      [&](int64_t i, int c, A x) { po[i * p.head_dim_v + c] = x; });
      if (lane % 4 == 0)
MHA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int64_t i = row0 + MmaLayout::c_row(lane, 2 * r);
          if (i < L) {
            pm[i] = m_run[rt][r];
            pm[rows + i] = l[r];
          }
        }
      if (rt + 1 == kRT) return;  // (an early return: the general kernel's registers were lower with it)
      continue;
    }
    T* out = static_cast<T*>(p.out) + b * p.out_stride.b + h * p.out_stride.h;
    for_each_output(o[rt], inv, row0, L, p.head_dim_v, lane, [&](int64_t i, int c, A x) {
      out[i * p.out_stride.row + c * p.out_stride.col] = to_elem<T>(x);
    });
    if (lane % 4 == 0) {
      A* lse = static_cast<A*>(p.lse) + p.lse_index(b, h, 0);
MHA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t i = row0 + MmaLayout::c_row(lane, 2 * r);
        // natural log; -inf for a fully masked row; NaN stays NaN
        if (i < L)
          lse[i] = l[r] > A(0) ? (m_run[rt][r] + Units::log(l[r])) / Units::kPerNat
                               : (l[r] == l[r] ? A(-INFINITY) : l[r]);
      }
    }
  }
}

// The forward's key splits merged (AttentionFwdParams::kv_splits > 1), one
// warp a row (b, h, i), in split order: with M the largest of the splits'
// maxima m_s and w_s = l_s exp(m_s - M), O = sum_s w_s O_s / sum_s w_s and
// lse = M + log(sum_s w_s), as the unsplit kernel would have them (its
// fully masked and NaN rows included: a split that saw no key has m_s =
// -inf and weight 0; a NaN score anywhere in the row makes M NaN).
template <typename T>
MHA_KERNEL attention_combine_kernel(const AttentionFwdParams p) {
  using A = typename AccOf<T>::type;
  using Units = SoftmaxUnits<A>;
  const int lane = static_cast<int>(thread_idx().x) % kWarpSize;
  const int64_t L = p.len_q, rows = p.batch * p.heads_q * L, all = p.kv_splits * rows;
  const int64_t row = static_cast<int64_t>(block_idx().x) * (block_dim().x / kWarpSize) + thread_idx().x / kWarpSize;
  if (row >= rows) return;
  const int64_t bh = row / L, i = row % L, b = bh / p.heads_q, h = bh % p.heads_q;
  const A* pm = static_cast<const A*>(p.part_ml) + row;
  const A* po = static_cast<const A*>(p.part_out) + row * p.head_dim_v;
  A mx = -INFINITY;
  for (int64_t s = 0; s < p.kv_splits; ++s) mx = nan_max(mx, pm[s * rows]);
  // split s's weight; 0 for a split that saw no key, whose O (0, or NaN from
  // a NaN value row behind masked scores) still counts as the unsplit sum would
  auto weight = [&](int64_t s) {
    const A m = pm[s * rows];
    return m == A(-INFINITY) ? A(0) : pm[all + s * rows] * Units::exp(m - mx);
  };
  // Each weight computed once, by lane s % 32, and passed round by shuffles;
  // a lane holds its columns' sums (head dims up to 256, launch.h: 8 a lane),
  // each summed in split order as before.
  constexpr int kLaneCols = 256 / kWarpSize;
  A acc[kLaneCols];
MHA_UNROLL
  for (int k = 0; k < kLaneCols; ++k) acc[k] = A(0);
  A total = A(0);
  for (int64_t s0 = 0; s0 < p.kv_splits; s0 += kWarpSize) {
    const A mine = s0 + lane < p.kv_splits ? weight(s0 + lane) : A(0);
    const int n = static_cast<int>(p.kv_splits - s0 < kWarpSize ? p.kv_splits - s0 : kWarpSize);
    for (int t = 0; t < n; ++t) {  // the same n for the whole warp
      const A w = shfl(mine, t);
      total += w;
      const A* os = po + (s0 + t) * rows * p.head_dim_v;
MHA_UNROLL
      for (int k = 0; k < kLaneCols; ++k) {
        const int64_t c = lane + k * kWarpSize;
        if (c < p.head_dim_v) acc[k] += w * os[c];
      }
    }
  }
  const A inv = total > A(0) ? A(1) / total : A(0);
  T* out = static_cast<T*>(p.out) + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
MHA_UNROLL
  for (int k = 0; k < kLaneCols; ++k) {
    const int64_t c = lane + k * kWarpSize;
    if (c < p.head_dim_v) out[c * p.out_stride.col] = to_elem<T>(acc[k] * inv);
  }
  if (lane == 0)
    static_cast<A*>(p.lse)[p.lse_index(b, h, i)] =
        total > A(0) ? (mx + Units::log(total)) / Units::kPerNat : (total == total ? A(-INFINITY) : total);
}

// ---------------------------------------------------------------------------
// Backward, shared by the key-block kernel and the dQ kernel: the probability
// (after dropout) and dS of element (i, j) from its raw score s and dP, with
// the row's shift and log_norm (AttentionBwdParams::row_shift: lse and 0, or
// the row's exact max and log(sum), in the forward's softmax units: base 2 in
// float, as the forward's exponentials); the min keeps P <= 1 where the row
// statistics and this score were summed in different orders.
// The mask gradient (dS itself) goes to grad_mask when that is not null.
// In an interior tile (interior_tile) the score is only scaled. keep: the
// element's dropout bit (read when dropout is on).
template <typename T, typename A>
MHA_DEVICE void prob_and_grad(const AttentionBwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j, A s, A dp,
                              A shift, A log_norm, A d, bool interior, bool keep, A* grad_mask, A& prob, A& ds) {
  prob = A(0);
  ds = A(0);
  using Units = SoftmaxUnits<A>;  // the forward's units (exp2 in float), shift and log_norm in them too
  if (shift == A(-INFINITY) || (!interior && (i >= p.len_q || j >= p.len_kv))) return;  // fully masked row: no gradient
  const A x = Units::from_nats(interior ? s * static_cast<A>(p.scale) : masked_score<T>(p, b, h, i, j, s)) - shift;
  A pr = Units::exp((x < A(0) ? x : A(0)) - log_norm);
  if (p.dropout.enabled()) {
    // O = sum_j P_j z_j V_j / (1 - p): dP_j picks up z_j / (1 - p), and dV takes the dropped P.
    const A rescale = static_cast<A>(p.dropout.rescale);
    dp = keep ? dp * rescale : A(0);
    ds = pr * (dp - d);
    pr = keep ? pr * rescale : A(0);
  } else {
    ds = pr * (dp - d);
  }
  prob = pr;
  if (grad_mask != nullptr) grad_mask[((b * p.heads_q + h) * p.len_q + i) * p.len_kv + j] = ds;
  ds *= score_slope(p, s);  // what dQ and dK take
}

// Score of query row i against key j of head (b, h), a dot product on the
// CUDA cores (the exact row statistics below).
// prob_and_grad on a tile plain_scores allowed, with no dropout and no mask
// gradient to write: the probability exp2(min(scaled(s) - shift, 0) -
// log_norm) and dS = P (dP - D); nothing for a fully masked row.
template <typename T, typename A>
MHA_DEVICE void plain_prob_and_grad(A s, A dp, A shift, A log_norm, A d, A scale, A& prob, A& ds) {
  const A x = SoftmaxUnits<A>::scaled(s, scale) - shift;
  const bool row = shift != A(-INFINITY);
  prob = row ? softmax_exp2<T>((x < A(0) ? x : A(0)) - log_norm) : A(0);
  ds = row ? prob * (dp - d) : A(0);
}

template <typename T, typename A>
MHA_DEVICE A row_score(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  const T* q = as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h + i * p.q_stride.row;
  const T* k = as<T>(p.k) + b * p.k_stride.b + (h / p.group_size()) * p.k_stride.h + j * p.k_stride.row;
  A s = A(0);
  for (int64_t e = 0; e < p.head_dim; ++e)
    s += static_cast<A>(to_float(q[e * p.q_stride.col])) * static_cast<A>(to_float(k[e * p.k_stride.col]));
  return masked_score<T>(p, b, h, i, j, s);
}

// row_dot[(b, h, i)] = sum_e dO[i, e] * O[i, e], and the row's row_shift /
// row_log_norm: lse and 0, or where lse_needs_exact_stats the row's max and
// log(sum) from a pass over its keys, a key per lane (padding rows and huge
// logits only). Grid (B * Hq, ceil(L / kDotRows)), each warp kDotRows / warps
// rows, one at a time.
constexpr int kDotRows = 16;
template <typename T>
MHA_KERNEL attention_bwd_dot_kernel(const AttentionBwdParams params) {
  using A = typename AccOf<T>::type;
  using Units = SoftmaxUnits<A>;
  const int lane = static_cast<int>(thread_idx().x) % kWarpSize, warp = static_cast<int>(thread_idx().x) / kWarpSize;
  const int warps = static_cast<int>(block_dim().x) / kWarpSize;
  const int64_t bh = block_idx().x, b = bh / params.heads_q, h = bh % params.heads_q;
  const AttentionBwdParams p = sequence_params<T, A>(params, b);
  for (int r = warp; r < kDotRows; r += warps) {
    const int64_t i = static_cast<int64_t>(block_idx().y) * kDotRows + r;
    const T* go = as<T>(p.grad_out) + b * p.grad_out_stride.b + h * p.grad_out_stride.h + i * p.grad_out_stride.row;
    const T* o = as<T>(p.out) + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
    A sum = A(0);
    if (i < p.len_q)
      for (int64_t e = lane; e < p.head_dim_v; e += kWarpSize)
        sum += static_cast<A>(to_float(go[e * p.grad_out_stride.col])) * static_cast<A>(to_float(o[e * p.out_stride.col]));
    for (int m = 16; m > 0; m /= 2) sum += shfl_xor(sum, m);
    if (i >= p.len_q) continue;  // the same for the whole warp
    const A lse = static_cast<const A*>(p.lse)[p.lse_index(b, h, i)];
    A shift = lse * Units::kPerNat, log_norm = A(0);  // |lse| < 256 here unless exact: no overflow
    if (lse_needs_exact_stats(lse)) {
      A mx = A(-INFINITY), l = A(0);
      for (int64_t j = lane; j < p.len_kv; j += kWarpSize)
        mx = nan_max(mx, Units::from_nats(row_score<T, A>(p, b, h, i, j)));
      for (int m = 16; m > 0; m /= 2) mx = nan_max(mx, shfl_xor(mx, m));
      if (mx != A(-INFINITY))
        for (int64_t j = lane; j < p.len_kv; j += kWarpSize)
          l += Units::exp(Units::from_nats(row_score<T, A>(p, b, h, i, j)) - mx);
      for (int m = 16; m > 0; m /= 2) l += shfl_xor(l, m);
      shift = mx;
      log_norm = l > A(0) ? Units::log(l) : A(0);
    }
    if (lane == 0) {
      static_cast<A*>(p.row_dot)[p.lse_index(b, h, i)] = sum;
      static_cast<A*>(p.row_shift)[p.lse_index(b, h, i)] = shift;
      static_cast<A*>(p.row_log_norm)[p.lse_index(b, h, i)] = log_norm;
    }
  }
}

// Key-block kernel. Shared: K, V (kB x kLd), P^T / dS^T (kB x kLdP), then
// kStages stages of a query tile: Q, dO (kB x kLd) and its rows' shift,
// log_norm and D (kB each, accumulation type), the next tile's loads (16-byte
// cp.async where rows allow) in flight while this one computes. Warp w owns
// key rows 16 (w % kRowWarps) .. of the block; the kSplit warps sharing them
// each compute S^T and dP^T for their share of the tile's query columns and
// hold dK, dV and compute dQ for the head-dim columns [c_base, c_base + kCols).
template <typename T, int kHeadDim>
MHA_KERNEL attention_bwd_kernel(const AttentionBwdParams params) {
  using A = typename AccOf<T>::type;
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kB = Cfg::kBwdBlock, kLd = Cfg::kLd, kLdP = Cfg::kBwdLdP, kStages = Cfg::kBwdStages;
  constexpr int kRowWarps = Cfg::kBwdRowWarps, kSplit = Cfg::kBwdColSplit, kCols = kHeadDim / kSplit;
  constexpr int kCT = kCols / 8, kChunk = 4;  // dQ in 32-column chunks
  // query columns of S^T / dP^T per warp: kNTw n-tiles (some warps have none when kSplit > kB / 8)
  constexpr int kNTw = kB / 8 / kSplit > 0 ? kB / 8 / kSplit : 1;
  static_assert(sizeof(A) == Cfg::kAcc);
  T* k_s = dynamic_shared<T>();
  T* v_s = k_s + kB * kLd;
  T* t_s = v_s + kB * kLd;
  unsigned char* stages = reinterpret_cast<unsigned char*>(t_s + kB * kLdP);
  auto q_tile = [&](int st) { return reinterpret_cast<T*>(stages + st * Cfg::kBwdStageBytes); };
  auto row_stats = [&](int st) { return reinterpret_cast<A*>(q_tile(st) + 2 * kB * kLd); };  // shift, log_norm, D

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int row0 = (warp % kRowWarps) * 16, split = warp / kRowWarps, c_base = split * kCols, n0 = 8 * kNTw * split;
  const int64_t bh = block_idx().x, b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionBwdParams p = sequence_params<T, A>(params, b);  // params itself unless varlen
  const A scale = static_cast<A>(p.scale);
  const bool scalar = p.scalar_operands;  // operands by plain loads (launch.h)
  const DropoutKey key = dropout_key(p.dropout);
  const int64_t j0 = static_cast<int64_t>(block_idx().y) * kB;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = p.head_dim_v;
  if (j0 >= S) return;  // a block past a shorter sequence's keys (varlen)

  // K and V join the first query tile's cp.async group
  load_tile_async(k_s, kLd, kB, kHeadDim, as<T>(p.k) + b * p.k_stride.b + hk * p.k_stride.h + j0 * p.k_stride.row,
                  p.k_stride.row, p.k_stride.col, S - j0, E);
  load_tile_async(v_s, kLd, kB, kHeadDim, as<T>(p.v) + b * p.v_stride.b + hk * p.v_stride.h + j0 * p.v_stride.row,
                  p.v_stride.row, p.v_stride.col, S - j0, Ev);
  const T* q_g = as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h;
  const T* do_g = as<T>(p.grad_out) + b * p.grad_out_stride.b + h * p.grad_out_stride.h;
  const A* shift_g = static_cast<const A*>(p.row_shift) + p.lse_index(b, h, 0);
  const A* norm_g = static_cast<const A*>(p.row_log_norm) + p.lse_index(b, h, 0);
  const A* d_g = static_cast<const A*>(p.row_dot) + p.lse_index(b, h, 0);
  // dQ accumulator of the head (grad_q's strides), or null
  A* dq_g = p.grad_q_accum == nullptr
                ? nullptr
                : static_cast<A*>(p.grad_q_accum) + b * p.grad_q_stride.b + h * p.grad_q_stride.h;
  // Issues the loads of the query tile at row i0 into stage st, as one
  // cp.async group (its row statistics by plain stores).
  auto issue = [&](int64_t i0, int st) {
    T* q_s = q_tile(st);
    load_tile_async(q_s, kLd, kB, kHeadDim, q_g + i0 * p.q_stride.row, p.q_stride.row, p.q_stride.col, L - i0, E);
    load_tile_async(q_s + kB * kLd, kLd, kB, kHeadDim, do_g + i0 * p.grad_out_stride.row, p.grad_out_stride.row,
                    p.grad_out_stride.col, L - i0, Ev);
    A* rows = row_stats(st);
    for (int r = tid; r < kB; r += static_cast<int>(block_dim().x)) {
      const bool in = i0 + r < L;
      rows[r] = in ? shift_g[i0 + r] : A(-INFINITY);
      rows[kB + r] = in ? norm_g[i0 + r] : A(0);
      rows[2 * kB + r] = in ? d_g[i0 + r] : A(0);
    }
    cp_async_commit();
  };
  // The warps sharing rows exchange P^T / dS^T through t_s: a block barrier
  // when there are several, a warp barrier otherwise.
  auto sync_tile = [] {
    if constexpr (kSplit > 1) {
      sync_threads();
    } else {
      sync_warp();
    }
  };

  A dk[kCT][4], dv[kCT][4];
  zero(dk);
  zero(dv);

  // the query tiles with a row that may see one of this block's keys
  const int64_t i_first = p.variant.rows_begin(j0);
  const int64_t rows_end = p.variant.rows_end((j0 + kB < S ? j0 + kB : S) - 1, L);
  stream_tiles<kStages>(i_first, rows_end, kB, issue, [&](int64_t i0, int stage) {
    const T* q_s = q_tile(stage);
    const T* do_s = q_s + kB * kLd;
    const A* shift_s = row_stats(stage);
    const A* norm_s = shift_s + kB;
    const A* d_s = shift_s + 2 * kB;

    // S^T and dP^T of the warp's 16 keys against its query columns n0 ..;
    // P^T goes to t_s, dS^T stays in registers until dV has read P^T
    A dst[kNTw][4];
    const bool has_cols = n0 < kB;
    if (has_cols) {
      A st[kNTw][4];
      zero(st);
      zero(dst);
      warp_mma<T>(st, Tile2<T>{k_s + row0 * kLd, kLd, 1}, Tile2<T>{q_s + n0 * kLd, 1, kLd}, kHeadDim, lane, scalar, p.fp32_math);
      warp_mma<T>(dst, Tile2<T>{v_s + row0 * kLd, kLd, 1}, Tile2<T>{do_s + n0 * kLd, 1, kLd}, kHeadDim, lane, scalar, p.fp32_math);
      const bool interior = interior_tile(p, i0 + n0, i0 + n0 + 8 * kNTw - 1, j0 + row0, j0 + row0 + 15);
      const bool plain =
          plain_scores<T>(st, interior && p.grad_mask == nullptr && !p.dropout.enabled(), scale);
      const uint32_t keep =
          dropout_tile_bits<kNTw, true>(p, key, b, h, j0 + row0 + MmaLayout::c_row(lane, 0), i0 + n0, lane);
MHA_UNROLL
      for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int rj = row0 + MmaLayout::c_row(lane, e), ci = n0 + 8 * t + MmaLayout::c_col(lane, e);
          A prob;
          if (plain) {
            plain_prob_and_grad<T>(st[t][e], dst[t][e], shift_s[ci], norm_s[ci], d_s[ci], scale, prob, dst[t][e]);
          } else {
            prob_and_grad<T>(p, b, h, i0 + ci, j0 + rj, st[t][e], dst[t][e], shift_s[ci], norm_s[ci], d_s[ci],
                             interior, (keep >> (4 * t + e)) & 1u, static_cast<A*>(p.grad_mask), prob, dst[t][e]);
          }
          t_s[rj * kLdP + ci] = to_elem<T>(prob);
        }
    }
    sync_tile();
    // dV += P^T dO
    warp_mma<T>(dv, Tile2<T>{t_s + row0 * kLdP, kLdP, 1}, Tile2<T>{do_s + c_base, kLd, 1}, kB, lane, scalar, p.fp32_math);
    sync_tile();  // P^T read before dS^T overwrites it
    if (has_cols) {
MHA_UNROLL
      for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e)
          t_s[(row0 + MmaLayout::c_row(lane, e)) * kLdP + n0 + 8 * t + MmaLayout::c_col(lane, e)] = to_elem<T>(dst[t][e]);
    }
    sync_tile();
    // dK += dS^T Q
    warp_mma<T>(dk, Tile2<T>{t_s + row0 * kLdP, kLdP, 1}, Tile2<T>{q_s + c_base, kLd, 1}, kB, lane, scalar, p.fp32_math);

    if (dq_g != nullptr) {
      sync_threads();  // every warp's dS^T rows are written
      // dQ rows row0 .. of the tile, columns c_base .., += dS K in 32-column chunks
      for (int c0 = c_base; c0 < c_base + kCols; c0 += 8 * kChunk) {
        A dqa[kChunk][4];
        zero(dqa);
        warp_mma<T>(dqa, Tile2<T>{t_s + row0, 1, kLdP}, Tile2<T>{k_s + c0, kLd, 1}, kB, lane, scalar, p.fp32_math);
MHA_UNROLL
        for (int t = 0; t < kChunk; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int64_t i = i0 + row0 + MmaLayout::c_row(lane, e);
            const int c = c0 + 8 * t + MmaLayout::c_col(lane, e);
            if (i < L && c < E)
              atomic_add(dq_g + i * p.grad_q_stride.row + c, dqa[t][e] * scale);
          }
      }
    }
  });

  // per query head; the host sums GQA groups
  A* dk_g = static_cast<A*>(p.grad_k) + b * p.grad_k_stride.b + h * p.grad_k_stride.h;
  A* dv_g = static_cast<A*>(p.grad_v) + b * p.grad_v_stride.b + h * p.grad_v_stride.h;
MHA_UNROLL
  for (int t = 0; t < kCT; ++t)
MHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int64_t j = j0 + row0 + MmaLayout::c_row(lane, e);
      const int c = c_base + 8 * t + MmaLayout::c_col(lane, e);
      if (j < S && c < E) dk_g[j * p.grad_k_stride.row + c] = dk[t][e] * scale;
      if (j < S && c < Ev) dv_g[j * p.grad_v_stride.row + c] = dv[t][e];
    }
}

// Deterministic dQ: grid (B * Hq, query blocks of kB rows), key tiles
// streamed in kStages stages as the key-block kernel streams query tiles;
// warps split rows, key columns of S / dP, and head-dim columns of dQ as
// there. Shared: Q, dO (kB x kLd), dS (kB x kLdP), then per stage K, V.
template <typename T, int kHeadDim>
MHA_KERNEL attention_bwd_dq_kernel(const AttentionBwdParams params) {
  using A = typename AccOf<T>::type;
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kB = Cfg::kBwdBlock, kLd = Cfg::kLd, kLdP = Cfg::kBwdLdP, kStages = Cfg::kBwdStages;
  constexpr int kRowWarps = Cfg::kBwdRowWarps, kSplit = Cfg::kBwdColSplit, kCols = kHeadDim / kSplit;
  constexpr int kCT = kCols / 8, kNTw = kB / 8 / kSplit > 0 ? kB / 8 / kSplit : 1;
  T* q_s = dynamic_shared<T>();
  T* do_s = q_s + kB * kLd;
  T* t_s = do_s + kB * kLd;
  unsigned char* stages = reinterpret_cast<unsigned char*>(t_s + kB * kLdP);
  auto k_tile = [&](int st) { return reinterpret_cast<T*>(stages + st * Cfg::kBwdStageBytes); };

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int row0 = (warp % kRowWarps) * 16, split = warp / kRowWarps, c_base = split * kCols, n0 = 8 * kNTw * split;
  const int64_t bh = block_idx().x, b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionBwdParams p = sequence_params<T, A>(params, b);  // params itself unless varlen
  const A scale = static_cast<A>(p.scale);
  const bool scalar = p.scalar_operands;  // operands by plain loads (launch.h)
  const int64_t i0 = static_cast<int64_t>(block_idx().y) * kB;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = p.head_dim_v;
  if (i0 >= L) return;  // a block past a shorter sequence's rows (varlen)

  // Q and dO join the first key tile's cp.async group
  load_tile_async(q_s, kLd, kB, kHeadDim, as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h + i0 * p.q_stride.row,
                  p.q_stride.row, p.q_stride.col, L - i0, E);
  load_tile_async(do_s, kLd, kB, kHeadDim,
                  as<T>(p.grad_out) + b * p.grad_out_stride.b + h * p.grad_out_stride.h + i0 * p.grad_out_stride.row,
                  p.grad_out_stride.row, p.grad_out_stride.col, L - i0, Ev);
  const T* k_g = as<T>(p.k) + b * p.k_stride.b + hk * p.k_stride.h;
  const T* v_g = as<T>(p.v) + b * p.v_stride.b + hk * p.v_stride.h;
  auto issue = [&](int64_t j, int st) {
    T* k_s = k_tile(st);
    load_tile_async(k_s, kLd, kB, kHeadDim, k_g + j * p.k_stride.row, p.k_stride.row, p.k_stride.col, S - j, E);
    load_tile_async(k_s + kB * kLd, kLd, kB, kHeadDim, v_g + j * p.v_stride.row, p.v_stride.row, p.v_stride.col,
                    S - j, Ev);
    cp_async_commit();
  };
  A shift[2], norm[2], dd[2];
MHA_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int64_t i = i0 + row0 + MmaLayout::c_row(lane, 2 * r);
    shift[r] = i < L ? static_cast<const A*>(p.row_shift)[p.lse_index(b, h, i)] : A(-INFINITY);
    norm[r] = i < L ? static_cast<const A*>(p.row_log_norm)[p.lse_index(b, h, i)] : A(0);
    dd[r] = i < L ? static_cast<const A*>(p.row_dot)[p.lse_index(b, h, i)] : A(0);
  }
  const DropoutKey key = dropout_key(p.dropout);

  A dq[kCT][4];
  zero(dq);
  const int64_t j_first = p.variant.begin(i0) / kB * kB;
  const int64_t kv_end = p.variant.end((i0 + kB < L ? i0 + kB : L) - 1, S);
  stream_tiles<kStages>(j_first, kv_end, kB, issue, [&](int64_t j0, int stage) {
    const T* k_s = k_tile(stage);
    const T* v_s = k_s + kB * kLd;
    if (n0 < kB) {  // dS of the warp's rows and key columns n0 .., for every warp sharing the rows
      A s[kNTw][4], dp[kNTw][4];
      zero(s);
      zero(dp);
      warp_mma<T>(s, Tile2<T>{q_s + row0 * kLd, kLd, 1}, Tile2<T>{k_s + n0 * kLd, 1, kLd}, kHeadDim, lane, scalar, p.fp32_math);
      warp_mma<T>(dp, Tile2<T>{do_s + row0 * kLd, kLd, 1}, Tile2<T>{v_s + n0 * kLd, 1, kLd}, kHeadDim, lane, scalar, p.fp32_math);
      const bool interior = interior_tile(p, i0 + row0, i0 + row0 + 15, j0 + n0, j0 + n0 + 8 * kNTw - 1);
      const bool plain = plain_scores<T>(s, interior && !p.dropout.enabled(), scale);
      const uint32_t keep =
          dropout_tile_bits<kNTw, false>(p, key, b, h, i0 + row0 + MmaLayout::c_row(lane, 0), j0 + n0, lane);
MHA_UNROLL
      for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int ri = row0 + MmaLayout::c_row(lane, e), cj = n0 + 8 * t + MmaLayout::c_col(lane, e);
          A prob, ds;
          if (plain) {
            plain_prob_and_grad<T>(s[t][e], dp[t][e], shift[e / 2], norm[e / 2], dd[e / 2], scale, prob, ds);
          } else {
            // the key-block kernel writes the mask gradient
            prob_and_grad<T>(p, b, h, i0 + ri, j0 + cj, s[t][e], dp[t][e], shift[e / 2], norm[e / 2], dd[e / 2],
                             interior, (keep >> (4 * t + e)) & 1u, static_cast<A*>(nullptr), prob, ds);
          }
          t_s[ri * kLdP + cj] = to_elem<T>(ds);
        }
    }
    if constexpr (kSplit > 1) {
      sync_threads();
    } else {
      sync_warp();
    }
    // dQ += dS K
    warp_mma<T>(dq, Tile2<T>{t_s + row0 * kLdP, kLdP, 1}, Tile2<T>{k_s + c_base, kLd, 1}, kB, lane, scalar, p.fp32_math);
  });

  T* dq_g = static_cast<T*>(p.grad_q) + b * p.grad_q_stride.b + h * p.grad_q_stride.h;
MHA_UNROLL
  for (int t = 0; t < kCT; ++t)
MHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int64_t i = i0 + row0 + MmaLayout::c_row(lane, e);
      const int c = c_base + 8 * t + MmaLayout::c_col(lane, e);
      if (i < L && c < E) dq_g[i * p.grad_q_stride.row + c] = to_elem<T>(dq[t][e] * scale);
    }
}

}  // namespace mha_ext::device
