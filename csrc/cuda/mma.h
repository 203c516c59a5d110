// The tensor-core operation of the CUDA device code: the warp-wide
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
// D (16 x 8, f32) = A (16 x 16) * B (16 x 8) + C, with the per-lane register
// layout the PTX ISA documents for it (lane = 4 g + t, g = lane / 4, t = lane % 4):
//   A, 8 halves a0..a7 in 4 registers (a0 the low half of register 0):
//       row g for a0, a1, a4, a5 and g + 8 for a2, a3, a6, a7;
//       column 2t + (i & 1), plus 8 for a4..a7
//   B, 4 halves b0..b3 in 2 registers: row (k) 2t + (i & 1), plus 8 for b2, b3;
//       column (n) g
//   C, D, 4 floats c0..c3: row g for c0, c1 and g + 8 for c2, c3; column 2t + (i & 1)
// Under nvcc this is the instruction (inline PTX, sm_80 and newer). In the
// emulation every lane of the warp publishes its registers, and each lane
// computes its own four D elements from the gathered A and B, reading each
// element from the lane and register the layout says holds it, in float32 as
// the hardware accumulates.
//
// The operand loads from shared memory, ldmatrix_x4 / ldmatrix_x4_trans:
//   ldmatrix.sync.aligned.m8n8.x4{,.trans}.shared.b16
// four 8 x 8 matrices of 16-bit elements; lane 8 i + r gives the address of
// row r of matrix i (16 contiguous bytes, 16-byte aligned, in shared memory).
// Lane l receives in register i the elements (l / 4, 2 (l % 4)) and
// (l / 4, 2 (l % 4) + 1) of matrix i, the first in the low half; with .trans
// the elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4). So matrices
// (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of a row-major
// 16 x 16 tile load as the A fragment above, and of a row-major (k x n) tile
// with .trans as the B fragments of columns 0-7 (registers 0, 1) and 8-15
// (registers 2, 3). The emulation gathers the lanes' row addresses and reads
// each element from there; a misaligned or non-shared address throws.
//
// float32 on the tensor cores (TF32, 10 mantissa bits):
//   mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
// D (16 x 8, f32) = A (16 x 8) * B (8 x 8) + C, one tf32 per register:
//   A, a0..a3: row g for a0, a2 and g + 8 for a1, a3; column t for a0, a1
//       and t + 4 for a2, a3
//   B, b0, b1: row (k) t for b0 and t + 4 for b1; column (n) g
//   C, D as for m16n8k16.
// to_tf32 is cvt.rna.tf32.f32 (nearest, ties away from zero; the low 13 bits
// zero). An ldmatrix x4 of 32-bit elements moves each 8 x 4 block as an 8 x 8
// block of 16-bit halves, so lane 4 g + t receives element (g, t) of each:
// blocks (rows 0-7, k 0-3), (8-15, 0-3), (0-7, 4-7), (8-15, 4-7) of a
// row-major A are a0..a3, and blocks (n 0-7, k 0-3), (n 0-7, k 4-7) of a B
// stored by its columns are b0, b1. The emulation reads tf32 operands with
// their low 13 bits cleared and multiplies them exactly in float.
#pragma once

#include "numeric.h"

#include <type_traits>

namespace mha_ext::simt {

struct MmaLayout {
  // Position of element i of a lane's A fragment in the 16 x 16 tile.
  MHA_DEVICE static int a_row(int lane, int i) { return lane / 4 + ((i & 2) ? 8 : 0); }
  MHA_DEVICE static int a_col(int lane, int i) { return 2 * (lane % 4) + (i & 1) + ((i & 4) ? 8 : 0); }
  // Position of element i of a lane's B fragment in the 16 x 8 tile (k, n).
  MHA_DEVICE static int b_row(int lane, int i) { return 2 * (lane % 4) + (i & 1) + ((i & 2) ? 8 : 0); }
  MHA_DEVICE static int b_col(int lane, int /*i*/) { return lane / 4; }
  // Position of element i of a lane's C / D fragment in the 16 x 8 tile.
  MHA_DEVICE static int c_row(int lane, int i) { return lane / 4 + ((i & 2) ? 8 : 0); }
  MHA_DEVICE static int c_col(int lane, int i) { return 2 * (lane % 4) + (i & 1); }
};

// Two 16-bit elements in one register, `lo` in the low half.
template <typename T16>
MHA_DEVICE uint32_t pack2(T16 lo, T16 hi) {
  return static_cast<uint32_t>(bits_of(lo)) | (static_cast<uint32_t>(bits_of(hi)) << 16);
}

#if defined(__CUDACC__)

// d += a * b on the tensor cores; T16 is f16 or bf16.
template <typename T16>
MHA_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T16, f16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
#error "mha_ext's CUDA kernels need sm_80 or newer (mma.sync m16n8k16 with bfloat16): set TORCH_CUDA_ARCH_LIST to 8.0 or above"
#endif
}

// d += a * b on the tensor cores in TF32 (operands from to_tf32).
MHA_DEVICE void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

MHA_DEVICE uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
MHA_DEVICE float tf32_value(uint32_t bits) { return __uint_as_float(bits); }
MHA_DEVICE uint32_t float_bits(float x) { return __float_as_uint(x); }

MHA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

MHA_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

#else

namespace emul {

inline float half_bits_to_float(uint16_t bits, f16*) {
  f16 h;
  h.x = bits;
  return static_cast<float>(h);
}
inline float half_bits_to_float(uint16_t bits, bf16*) {
  bf16 h;
  h.x = bits;
  return static_cast<float>(h);
}

// d += A (16 x K) B (K x 8) for the warp: every lane publishes its A and B
// registers (a, then b); once for the warp, A and B are read element by
// element as floats, a_at(word_of, row, k) and b_at(word_of, k, col) taking
// each from the lane and register its instruction's layout says holds it;
// then each lane computes its four D elements from them, the products
// summed over k in order, in float32 as the hardware accumulates. (Each lane
// reading its own operands by the layout did the same sums 32 times over the
// decoding: 2 x 16 x 4 reads a lane where the warp now makes 16 x K + K x 8.)
template <int K, typename AAt, typename BAt>
inline void warp_mma_by_layout(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], AAt&& a_at,
                               BAt&& b_at) {
  static_assert(16 * K + K * 8 <= kWarpScratch);
  const int lane = linear_tid() % kWarpSize;
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  float result[4];
  warp_exchange_words_once(
      mine, 6,
      [&](auto&& word_of, float* s) {  // s: A (16 x K), then B (K x 8), row-major
        for (int row = 0; row < 16; ++row)
          for (int k = 0; k < K; ++k) s[row * K + k] = a_at(word_of, row, k);
        for (int k = 0; k < K; ++k)
          for (int col = 0; col < 8; ++col) s[16 * K + k * 8 + col] = b_at(word_of, k, col);
      },
      [&](auto&&, const float* s) {
        for (int e = 0; e < 4; ++e) {
          const int row = MmaLayout::c_row(lane, e), col = MmaLayout::c_col(lane, e);
          float acc = d[e];
          for (int k = 0; k < K; ++k) acc += s[row * K + k] * s[16 * K + k * 8 + col];
          result[e] = acc;
        }
      });
  for (int e = 0; e < 4; ++e) d[e] = result[e];
}

}  // namespace emul

template <typename T16>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  auto half = [](uint32_t w, int i) {
    return emul::half_bits_to_float(static_cast<uint16_t>(i % 2 ? w >> 16 : w & 0xffff), (T16*)nullptr);
  };
  // Element (row, col) of A: lane 4 (row % 8) + (col % 8) / 2, element index
  // (col & 1) + 2 [row >= 8] + 4 [col >= 8], two per register.
  auto a_at = [&](auto&& word_of, int row, int col) {
    const int i = (col & 1) + (row >= 8 ? 2 : 0) + (col >= 8 ? 4 : 0);
    return half(word_of(4 * (row % 8) + (col % 8) / 2, i / 2), i);
  };
  // Element (k, n) of B: lane 4 n + (k % 8) / 2, element (k & 1) + 2 [k >= 8].
  auto b_at = [&](auto&& word_of, int k, int n) {
    const int i = (k & 1) + (k >= 8 ? 2 : 0);
    return half(word_of(4 * n + (k % 8) / 2, 4 + i / 2), i);
  };
  emul::warp_mma_by_layout<16>(d, a, b, a_at, b_at);
}

inline float tf32_value(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// cvt.rna.tf32.f32: half an ulp of tf32 added to the magnitude, then the low
// 13 bits cleared (ties away from zero; the largest floats round to
// infinity); infinities and NaN keep their class.
inline uint32_t to_tf32(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return (u & 0x1fffu) ? (u | 0x00400000u) & 0xffffe000u : u;
  return (u + 0x1000u) & 0xffffe000u;
}

inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  // the hardware reads 19 bits of each operand register
  auto value = [](uint32_t w) { return tf32_value(w & 0xffffe000u); };
  // A (row, col): lane 4 (row % 8) + col % 4, register [row >= 8] + 2 [col >= 4]
  auto a_at = [&](auto&& word_of, int row, int col) {
    return value(word_of(4 * (row % 8) + col % 4, (row >= 8) + 2 * (col >= 4)));
  };
  // B (k, n): lane 4 n + k % 4, register 4 + [k >= 4]
  auto b_at = [&](auto&& word_of, int k, int n) { return value(word_of(4 * n + k % 4, 4 + (k >= 4))); };
  emul::warp_mma_by_layout<8>(d, a, b, a_at, b_at);
}

namespace emul {

template <bool kTrans>
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  if (!aligned16(row) || !in_shared(row, 16))
    throw std::logic_error("ldmatrix: a row address must be 16-byte aligned and in shared memory");
  const int lane = linear_tid() % kWarpSize;
  const uint64_t a = reinterpret_cast<uintptr_t>(row);
  const uint32_t mine[2] = {static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32)};
  uint32_t out[4];
  warp_exchange_words(mine, 2, [&](auto&& word_of) {
    // element (rr, c) of matrix m: column c of the row whose address lane 8 m + rr gave
    auto element = [&](int m, int rr, int c) {
      const uint64_t p = word_of(8 * m + rr, 0) | (static_cast<uint64_t>(word_of(8 * m + rr, 1)) << 32);
      uint16_t v;
      std::memcpy(&v, reinterpret_cast<const unsigned char*>(static_cast<uintptr_t>(p)) + 2 * c, 2);
      return static_cast<uint32_t>(v);
    };
    const int g = lane / 4, t = lane % 4;
    for (int m = 0; m < 4; ++m)
      out[m] = kTrans ? element(m, 2 * t, g) | (element(m, 2 * t + 1, g) << 16)
                      : element(m, g, 2 * t) | (element(m, g, 2 * t + 1) << 16);
  });
  for (int m = 0; m < 4; ++m) r[m] = out[m];
}

}  // namespace emul

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emul::ldmatrix_x4<false>(r, row); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emul::ldmatrix_x4<true>(r, row); }

#endif

}  // namespace mha_ext::simt
