// The warp-level building blocks of the CUDA attention kernels: tile shapes
// (TileConfig), tensor-core and CUDA-core products on mma C fragments
// (warp_mma, warp_mma16, the TF32 paths), shared-memory tile copies (plain and
// cp.async, tile_copies.h), row reductions over the 4 lanes of a fragment row,
// and the double-buffered tile stream every kernel runs. Written only against
// simt.h / mma.h, like the kernels (attention_kernels.h).
#pragma once

#include "../attention_params.h"
#include "mma.h"
#include "tile_copies.h"

namespace mha_ext::device {

using namespace mha_ext::simt;

// Tile shapes per element type and padded head dim. The shared-memory bytes
// of each are listed in launch.h next to the launch; registers, spills and
// warps per SM of every configuration are in docs/cuda.md, from
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
  // accumulators fit in registers (registers and spills: docs/cuda.md).
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
  // where two stages fit the same 99 KiB; the fixed tiles, P^T and dS^T (the
  // key-block kernel's two tiles: one barrier a tile between their stores
  // and their readers; the dQ kernel uses the first, for dS), and the stages
  // (bytes each; kAcc: the accumulation type's size)
  static constexpr int kAcc = kElem == 8 ? 8 : 4;
  static constexpr int kBwdLdP = kBwdBlock + kPad;
  static constexpr int kBwdStageBytes = 2 * kElem * kBwdBlock * kLd + 3 * kAcc * kBwdBlock;
  static constexpr int kBwdFixedBytes = 2 * kElem * kBwdBlock * kLd + 2 * kElem * kBwdBlock * kBwdLdP;
  static constexpr int kBwdStages = kBwdFixedBytes + 2 * kBwdStageBytes <= 99 * 1024 ? 2 : 1;
  static constexpr int kBwdSharedBytes = kBwdFixedBytes + kBwdStages * kBwdStageBytes;
  static constexpr int kBwdDqSharedBytes = kBwdSharedBytes - kElem * kBwdBlock * kBwdLdP;  // one P tile
};

// The plain-load operand path (AttentionFwdParams::scalar_operands, the
// kernels' way before ldmatrix) is built only where MHA_SCALAR_OPERANDS is
// defined: the emulation (which checks it gives ldmatrix's bits) and a build
// with MHA_EXT_SCALAR_OPERANDS=1. Built in, its predicated-off plain loads
// still issue in every k step of the default path (sm_90 SASS: 8 for 4 mma in
// the backward's S^T loop), so the default build leaves it out, since GPUs
// have run both paths to the same results (docs/cuda.md).
#if defined(MHA_SCALAR_OPERANDS)
constexpr bool kScalarOperandsBuilt = true;
#else
constexpr bool kScalarOperandsBuilt = false;
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
// x's TF32 part into big, and (3xTF32, kX3) the remainder into small (0
// where big is not finite). kX3 is a template parameter so that plain TF32
// products carry none of the remainder's instructions.
template <bool kX3>
MHA_DEVICE void tf32_split(float f, uint32_t& big, uint32_t& small) {
  big = to_tf32(f);
  if constexpr (kX3) {
    const float rest = f - tf32_value(big);
    small = rest - rest == 0.f ? to_tf32(rest) : 0u;
  } else {
    small = 0u;
  }
}
// acc += A B from the split operands: small * big + big * small (3xTF32) + big * big
template <bool kX3>
MHA_DEVICE void mma_tf32_terms(float (&acc)[4], const uint32_t (&a_big)[4], const uint32_t (&a_small)[4],
                               const uint32_t (&b_big)[2], const uint32_t (&b_small)[2]) {
  if constexpr (kX3) {
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
template <int NT, bool kX3>
MHA_DEVICE void warp_mma_tf32(float (&acc)[NT][4], Tile2<float> a, Tile2<float> b, int K, int lane, bool scalar) {
  // B by ldmatrix x4 covers two n-tiles; an odd NT (a single one) loads B by plain loads
  constexpr int kStep = NT % 2 == 0 ? 2 : 1;
  scalar = kScalarOperandsBuilt && scalar;
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
    for (int r = 0; r < 4; ++r) tf32_split<kX3>(tf32_value(ar[r]), a_big[r], a_small[r]);
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
        tf32_split<kX3>(tf32_value(br[2 * h]), b_big[0], b_small[0]);
        tf32_split<kX3>(tf32_value(br[2 * h + 1]), b_big[1], b_small[1]);
        mma_tf32_terms<kX3>(acc[nt + h], a_big, a_small, b_big, b_small);
      }
    }
  }
}

// 16-bit types on the tensor cores, one k step of 16 with A's fragments
// given: acc[rt] += A_rt B, A_rt's fragment af[rt] (rows 16 rt .. of the
// warp's row tiles), each B fragment loaded once for all of them. (Every row
// tile runs: a branch around some of the mma made nvcc put a WARPSYNC before
// each of them.)
template <typename T, int kRT, int NT>
MHA_DEVICE void mma16_b_step(float (&acc)[kRT][NT][4], const uint32_t (&af)[kRT][4], Tile2<T> b, int k0, int lane,
                             bool scalar) {
  static_assert(NT % 2 == 0, "B fragments come by ldmatrix x4, two n-tiles at a time");
  const int r8 = lane % 8, m_lo = (lane / 8) % 2, m_hi = lane / 16;
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
      mma_m16n8k16<T>(acc[rt][nt], af[rt], b0);
      mma_m16n8k16<T>(acc[rt][nt + 1], af[rt], b1);
    }
  }
}

// The same with A from shared memory (a), loaded by ldmatrix.
template <typename T, int kRT, int NT>
MHA_DEVICE void mma16_k_step(float (&acc)[kRT][NT][4], Tile2<T> a, Tile2<T> b, int k0, int lane, bool scalar) {
  const int r8 = lane % 8, m_lo = (lane / 8) % 2, m_hi = lane / 16;
  uint32_t af[kRT][4];  // matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
MHA_UNROLL
  for (int rt = 0; rt < kRT; ++rt) {
    const Tile2<T> at{a.p + 16 * rt * a.rs, a.rs, a.cs};
    if (scalar) {
      a_frag_scalar(af[rt], at, k0, lane);
    } else if (a.cs == 1) {
      ldmatrix_x4(af[rt], at.p + (r8 + 8 * m_lo) * a.rs + k0 + 8 * m_hi);
    } else {
      ldmatrix_x4_trans(af[rt], at.p + (k0 + 8 * m_hi + r8) * a.cs + 8 * m_lo);
    }
  }
  mma16_b_step<T, kRT, NT>(acc, af, b, k0, lane, scalar);
}

// The A fragment of k step kk (columns 16 kk .. 16 kk + 15) of a 16-row
// operand held in C fragments, c[2 kk] and c[2 kk + 1] (8 columns each),
// rounded to T: a lane's C elements (row g, columns 2 t, 2 t + 1; row g + 8,
// the same) are its A elements at those places (the m16n8k16 layouts), so
// packing them is the whole change of layout, and gives the bits that
// store_c_fragments then ldmatrix would.
template <typename T, typename A, int N>
MHA_DEVICE void a_frag_from_c(uint32_t (&af)[4], const A (&c)[N][4], int kk) {
MHA_UNROLL
  for (int h = 0; h < 2; ++h) {
    af[2 * h] = pack2(to_elem<T>(c[2 * kk + h][0]), to_elem<T>(c[2 * kk + h][1]));
    af[2 * h + 1] = pack2(to_elem<T>(c[2 * kk + h][2]), to_elem<T>(c[2 * kk + h][3]));
  }
}

// acc += A B over K (a multiple of 16, 16-bit types), A's 16 x K held in C
// fragments (c: 8 columns each, rounded to T by a_frag_from_c), B from
// shared memory; unrolled over k, since c is indexed by the step. The bits
// of store_c_fragments then warp_mma.
template <typename T, int NT, int N>
MHA_DEVICE void warp_mma_c(float (&acc)[NT][4], const float (&c)[N][4], Tile2<T> b, int K, int lane, bool scalar) {
  scalar = kScalarOperandsBuilt && scalar;
MHA_UNROLL
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[1][4];
    a_frag_from_c<T>(af[0], c, kk);
    mma16_b_step<T, 1, NT>(reinterpret_cast<float(&)[1][NT][4]>(acc), af, b, 16 * kk, lane, scalar);
  }
}

// acc += A B over K (a multiple of 16), k step by k step. kPairs (K a
// multiple of 32): two k steps a pass, the plain forward kernel's S = Q K^T,
// where it took the forward 0.95-1.01 of the time of one a pass at head dim
// 128 and 0.99-1.01 at 64 on an H200 (bench/cuda_ab.py, 2026-11-28).
template <typename T, int kRT, int NT, bool kPairs = false>
MHA_DEVICE void warp_mma16(float (&acc)[kRT][NT][4], Tile2<T> a, Tile2<T> b, int K, int lane, bool scalar) {
  scalar = kScalarOperandsBuilt && scalar;
  // not unrolled over k: unrolled, nvcc hoists the fragments of every k
  // step and the f16 backward at head dim 64 spilled (255 registers)
  if constexpr (kPairs) {
MHA_NO_UNROLL
    for (int k0 = 0; k0 < K; k0 += 32) {
      mma16_k_step<T, kRT, NT>(acc, a, b, k0, lane, scalar);
      mma16_k_step<T, kRT, NT>(acc, a, b, k0 + 16, lane, scalar);
    }
  } else {
MHA_NO_UNROLL
    for (int k0 = 0; k0 < K; k0 += 16) mma16_k_step<T, kRT, NT>(acc, a, b, k0, lane, scalar);
  }
}

template <typename T, int NT, typename A>
MHA_DEVICE void warp_mma(A (&acc)[NT][4], Tile2<T> a, Tile2<T> b, int K, int lane, bool scalar, Fp32Math fp32) {
  if constexpr (std::is_same_v<T, float>) {
    if (fp32 == Fp32Math::kTf32) return warp_mma_tf32<NT, false>(acc, a, b, K, lane, scalar);
    if (fp32 == Fp32Math::kTf32x3) return warp_mma_tf32<NT, true>(acc, a, b, K, lane, scalar);
  }
  if constexpr (sizeof(T) == 2) {
    warp_mma16<T, 1, NT>(reinterpret_cast<float(&)[1][NT][4]>(acc), a, b, K, lane, scalar);
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

// acc1 += A1 B1 and acc2 += A2 B2 over the same K: for 16-bit types in one
// k loop, so that each step has both products' mma to issue (the backward's
// S^T and dP^T, dV and dK: twice the independent mma between the loop's
// branch and the next step's operand loads); each accumulator sums k in
// the order warp_mma does, so the results are the same bits as two calls.
// Other types: two warp_mma calls.
template <typename T, int NT, typename A>
MHA_DEVICE void warp_mma_pair(A (&acc1)[NT][4], Tile2<T> a1, Tile2<T> b1, A (&acc2)[NT][4], Tile2<T> a2,
                              Tile2<T> b2, int K, int lane, bool scalar, Fp32Math fp32) {
  if constexpr (sizeof(T) == 2) {
    scalar = kScalarOperandsBuilt && scalar;
MHA_NO_UNROLL
    for (int k0 = 0; k0 < K; k0 += 16) {
      mma16_k_step<T, 1, NT>(reinterpret_cast<float(&)[1][NT][4]>(acc1), a1, b1, k0, lane, scalar);
      mma16_k_step<T, 1, NT>(reinterpret_cast<float(&)[1][NT][4]>(acc2), a2, b2, k0, lane, scalar);
    }
  } else {
    warp_mma<T>(acc1, a1, b1, K, lane, scalar, fp32);
    warp_mma<T>(acc2, a2, b2, K, lane, scalar, fp32);
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
template <bool kX3, int KT, int OT>
MHA_DEVICE void pv_tf32(float (&o)[OT][4], const float (&pf)[KT][4], const float* v_s, int ld, int lane) {
  const int g = lane / 4, t = lane % 4;
MHA_UNROLL
  for (int kt = 0; kt < KT; ++kt) {
    uint32_t a_big[4], a_small[4];
    const float a[4] = {pf[kt][0], pf[kt][2], pf[kt][1], pf[kt][3]};
MHA_UNROLL
    for (int r = 0; r < 4; ++r) tf32_split<kX3>(a[r], a_big[r], a_small[r]);
    const float* v0 = v_s + (8 * kt + 2 * t) * ld + g;
MHA_UNROLL
    for (int ot = 0; ot < OT; ++ot) {
      uint32_t b_big[2], b_small[2];
      tf32_split<kX3>(v0[8 * ot], b_big[0], b_small[0]);
      tf32_split<kX3>(v0[ld + 8 * ot], b_big[1], b_small[1]);
      mma_tf32_terms<kX3>(o[ot], a_big, a_small, b_big, b_small);
    }
  }
}

// Zeroes a set of accumulator fragments.
template <typename A, int N>
MHA_DEVICE void zero(A (&acc)[N][4]) {
MHA_UNROLL
  for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = A(0);
}

// Stores N accumulator fragments (a 16 x 8N tile, C layout) as elements of T
// into shared memory at dst (row stride ld, even): a lane's two adjacent
// columns of a row go together, one 32-bit store for 16-bit types.
template <typename T, typename A, int N>
MHA_DEVICE void store_c_fragments(const A (&c)[N][4], T* dst, int ld, int lane) {
MHA_UNROLL
  for (int t = 0; t < N; ++t)
MHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      T* d = dst + MmaLayout::c_row(lane, 2 * h) * ld + 8 * t + MmaLayout::c_col(lane, 0);
      if constexpr (sizeof(T) == 2) {
        *reinterpret_cast<uint32_t*>(d) = pack2(to_elem<T>(c[t][2 * h]), to_elem<T>(c[t][2 * h + 1]));
      } else {
        d[0] = to_elem<T>(c[t][2 * h]);
        d[1] = to_elem<T>(c[t][2 * h + 1]);
      }
    }
}

template <typename T>
MHA_DEVICE const T* as(const void* p) { return static_cast<const T*>(p); }

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

// Stores a warp's output C fragments o (its rows from row0; x = o / the
// row's sum, inv: the two rows' reciprocals) as elements of T into out (row
// stride `row_stride`, unit column stride), rows i < L and columns c < Ev: a
// lane's two adjacent columns of a row by one 32-bit store for 16-bit types
// (the caller checks that out and row_stride keep them 4-byte aligned), each
// row's address once.
template <typename T, int kOT, typename A>
MHA_DEVICE void store_output_pairs(const A (&o)[kOT][4], const A (&inv)[2], int64_t row0, int64_t L, int Ev,
                                   int lane, T* out, int64_t row_stride) {
  static_assert(sizeof(T) == 2, "store_output_pairs: 16-bit element types");
  const int col = MmaLayout::c_col(lane, 0);
  auto rows = [&](bool check_cols) {
MHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int64_t i = row0 + MmaLayout::c_row(lane, 2 * h);
      if (i >= L) continue;
      T* row = out + i * row_stride + col;
MHA_UNROLL
      for (int t = 0; t < kOT; ++t) {
        const T lo = to_elem<T>(o[t][2 * h] * inv[h]), hi = to_elem<T>(o[t][2 * h + 1] * inv[h]);
        if (!check_cols || col + 8 * t + 1 < Ev) {
          *reinterpret_cast<uint32_t*>(row + 8 * t) = pack2(lo, hi);
        } else if (col + 8 * t < Ev) {
          row[8 * t] = lo;
        }
      }
    }
  };
  if (8 * kOT <= Ev) {
    rows(false);
  } else {
    rows(true);
  }
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

}  // namespace mha_ext::device
