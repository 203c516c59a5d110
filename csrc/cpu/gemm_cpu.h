// The SIMD layer of the CPU kernels, with the instruction set chosen once at
// run time: a small deterministic GEMM for attention tiles, and the row
// primitives (max, exp, transpose, dropout Philox) declared below it.
//
//   C (M x N, ldc) = alpha * A B + beta * C          (beta == 0: C is not read)
//   A(i, k) = a[i * a_rs + k * a_cs]                 (any strides: A or A^T)
//   B (K x N) row-major with leading dim ldb, unit stride along N
//
// Every C element is one sum over k in increasing order, whatever the thread
// count, the alignment or the tile position: results are reproducible (BLAS
// libraries do not promise that across thread counts). The float paths are an
// AVX-512 micro-kernel (6 x 64 outputs in 24 zmm accumulators, K in blocks of
// 128 so the B panel stays in L1; on tile shapes 64x256x64 and 64x64x256 it ran
// at 96-104 GFLOP/s on one core here with K blocks of 64, MKL's sgemm at 69-93
// in the same run),
// an AVX2+FMA one (6 x 16 in 12 ymm, 31-38 GFLOP/s a core on a Zen 1 EPYC) and portable C++;
// double (the gradcheck path) uses the portable loop.
// AVX512-BF16 (with AVX-512): the bfloat16 forward and backward multiply
// bfloat16 pairs by vdpbf16ps instead of widening to float; with AMX they
// do so on the tile unit (gemm_bf16_pairs below; the float routines stay on
// AVX-512).
// MHA_EXT_CPU_ISA=generic|avx2|avx512|avx512bf16|amx forces a path, never one
// above what the CPU has (tests run each path that way); unset, the best it
// has is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace mha_ext {
namespace cpu {

// Per-thread buffers start on a cache line (64 bytes): std::vector's storage
// is only 16-byte aligned, and a misaligned start makes every zmm load of a
// packed tile span two lines.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* ptr, std::size_t) { ::operator delete(ptr, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, LineAllocator<T>>;

// Each path includes the ones below it: kAvx512Bf16 is AVX-512 with
// AVX512-BF16's vdpbf16ps (bfloat16 pair products, float sums), kAmx that and
// the AMX tile unit.
enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
inline bool operator>=(Isa a, Isa b) { return static_cast<int>(a) >= static_cast<int>(b); }

// The path in use (decided once per process).
Isa active_isa();
const char* isa_name(Isa isa);

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t a_rs,
          int64_t a_cs, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// out[r] = sum over k < n of a[r * lda + k] b[r * ldb + k] for r < rows, each
// summed as gemm above sums one C element (alpha 1, beta 0) on this path: the
// same products in the same order with the same roundings. Where b's row is
// bitwise a row of gemm's B^T the two are equal: the backward's D = rowsum(dO
// O) against dP = dO V^T, so that a row whose output is one value row (a
// one-hot P) gets dP - D = 0 exactly.
void row_dots(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t n, float* out);
void gemm(int64_t M, int64_t N, int64_t K, double alpha, const double* a, int64_t a_rs,
          int64_t a_cs, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

// Row primitives of the softmax, on the same run-time instruction-set choice.
// max over x[0..n) ignoring NaN (-inf for n == 0)
float row_max(const float* x, int64_t n);
// The mask of a score row in the kernel's units (transform_row): s[c] =
// keep[c] ? s[c] : -inf, or s[c] += mask_in_units(m[c], unit); false (nothing
// written) where the path in use has no such routine
bool mask_bool(float* s, const uint8_t* keep, int64_t n);
bool mask_add(float* s, const float* m, int64_t n, float unit);
// the same for a bfloat16 (bf16 true) or float16 mask, given as its bits
bool mask_add16(float* s, const uint16_t* m, bool bf16, int64_t n, float unit);
// The softcap of a score row (transform_row): s[c] = cap tanh(s[c] inv) with
// inv = 1 / cap, and its derivative on dS: ds[c] *= 1 - tanh(raw[c] inv)^2;
// false (nothing written) where the path in use has no such routine (tanh
// within 3.1 ulp: softmax_cpu.cpp)
bool softcap_row(float* s, int64_t n, float cap, float inv);
bool softcap_grad(const float* raw, int64_t n, float inv, float* ds);
// ALiBi on a score row (transform_row): s[c] -= slope |d0 - c|; false
// (nothing written) where the path in use has no such routine or |d0| or n
// reach 2^30
bool alibi_row(float* s, int64_t n, float slope, int64_t d0);
// Dropout keep bits of 64 * blocks consecutive columns starting at column
// 4 * group0 of attention row `row`: keep[t] = word (t % 4) of
// Philox4x32-10(seed, counter = (group0 + t / 4, row)) >= threshold
// (dropout.h's contract, 16 counters a block).
void philox_keep64(uint64_t seed, uint64_t row, uint64_t group0, uint32_t threshold, int64_t blocks, uint8_t* keep);

// AMX: whether the CPU has AMX-TILE and AMX-BF16 and the kernel lets this
// process use the tile registers (asked for once, as the Linux ABI requires).
bool amx_bf16_usable();
// bfloat16 pair products (Isa::kAvx512Bf16 and above): C (M x N float, ldc)
// = A B, or += A B with accumulate: A (M x K bfloat16 bits, row-major, lda),
// B in the pair-interleaved layout: row r holds B(2r, n), B(2r + 1, n) for
// n = 0 .. N - 1 (ldb bf16 per row). M and N multiples of 32, K of 32. On
// the tile unit (Isa::kAmx) or by vdpbf16ps; each C element sums its
// products in a fixed order on either (reproducible like gemm above; the two
// orders differ).
void gemm_bf16_pairs(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                   int64_t ldb, float* c, int64_t ldc, bool accumulate);
// out[r] = sum of a(r, c) b(r, c) over c < n (bfloat16 bits, rows r < rows,
// row strides lda / ldb, n even) in the arithmetic of gemm_bf16_pairs on this
// path, so that it is bit-equal to the product's element where b's row is a
// row of B^T and the product started from zero (the backward's D = rowsum(dO
// O) against dP = dO V^T: a row whose output is one value row then gets dP -
// D = 0 exactly, as the float paths do). False, nothing written, on the tile
// unit (Isa::kAmx), whose sums this routine does not reproduce, and below
// Isa::kAvx512Bf16.
bool row_dots_bf16_pairs(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t rows, int64_t n,
                         float* out);
// Operand packing for gemm_bf16_pairs (Isa::kAvx512Bf16 and above), zero-padded:
// dst (rows_pad x ld) = bfloat16 (round to nearest even) of src rows x cols
void pack_bf16_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, int64_t rows_pad, int64_t ld,
                         uint16_t* dst);
// P of the forward on pair products: dst[i] = bfloat16 of 2^(mul x[i] - sub) for i < n
// (a degree-4 polynomial, 3e-6 relative before rounding), 0 up to n_pad (a
// multiple of 16); returns the sum of the unrounded values. x is not written.
float exp2_sub_sum_bf16(const float* x, int64_t n, float mul, float sub, uint16_t* dst, int64_t n_pad);
// pair rows of a contiguous-row bfloat16 matrix (n x cols, row stride rs):
// dst row t (ld bf16) = src[2t][0], src[2t + 1][0], src[2t][1], ...; rows
// beyond n and columns beyond cols (up to cols_pad) are zero
void pack_row_pairs_bf16(const uint16_t* src, int64_t rs, int64_t n, int64_t cols, int64_t n_pad, int64_t cols_pad,
                        int64_t ld, uint16_t* dst);
// The decode kernel's products on the tile unit (Isa::kAmx; false, nothing
// written, on another path or where E or Ev is not a multiple of 32 up to
// 256, or R over 16). Query rows as Q^T pairs: dst (E / 2 rows of 32 bf16) row t =
// q[0][2t], q[0][2t + 1], q[1][2t], ... for R <= 16 rows of q (R x E), zero
// for rows R..15 (nothing written for R over 16).
void amx_pack_query_pairs(const uint16_t* q, int64_t R, int64_t E, uint16_t* dst);
// s[r * lds + c] = dot(q row r, key row c) for the R rows of q_pairs (with R
// over 4 all 16 are written: s has room for 16 rows) and n key rows
// (bfloat16, row stride ldk). fetch: fetch adjacent rows ahead (not in a paged pool)
bool amx_dot_rows_bf16(const uint16_t* q_pairs, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n,
                       float* s, int64_t lds, bool fetch);
// o[r * ldo + c'] += sum over j < n of bf16(p[r * ldp + j]) v[j * ldv + c] for
// R rows and Ev columns (P rounded to bfloat16, as the other bfloat16 paths),
// with O's columns in the split order c' of c: within each 32 columns the 16
// even ones, then the 16 odd ones. amx_unsplit_rows puts O's R rows back in
// column order (a zero O is the same in both).
bool amx_acc_rows_bf16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv,
                       int64_t Ev, float* o, int64_t ldo, bool fetch);
void amx_unsplit_rows(float* o, int64_t R, int64_t Ev, int64_t ldo);
// The calling thread's tile registers back to their initial state
// (tilerelease) where this process uses AMX. Each parallel task of the
// kernels that used the tile unit ends with it (ReleaseTiles), as torch's own
// AMX kernels release theirs (cpublas::brgemm_release), so that no thread
// keeps tile state from one call to the next (Linux saves and restores that
// state, 8 KiB, at each of the thread's context switches while it is held).
void amx_release();
struct ReleaseTiles {  // amx_release() at the end of a scope that used the tile unit
  bool used;
  ~ReleaseTiles() {
    if (used) amx_release();
  }
};

// dst[c * ldd + r] = src[r * ld + c]: a (rows x cols) tile, transposed (ldd >= rows)
void transpose(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst, int64_t ldd);
// x[i] = 2^(fl(mul x[i]) - sub) (0 below -125, NaN stays NaN; the product
// rounded before the difference, so a row's max taken as fl(mul max) gives
// exactly 2^0); returns the sum
float exp2_sub_sum(float* x, int64_t n, float mul, float sub);

// rows_cpu.cpp (the scores) and rows_values_cpu.cpp (P V), for the decode
// kernel (far_fetch: the far fetch of rows_avx512.h, for calls whose K and V
// do not stay in the caches; rows_after: key or value rows after the n
// that the caller reads next (its next tile, adjacent), which the routines
// fetch a block or a chunk of ahead; 0 where there are none or they lie
// elsewhere, as a paged pool's next block):
// s[r * lds + c] = dot(q row r, key row c) for R query rows (R x E, row-major)
// and n key rows (row stride ldk)
void dot_rows(const float* q, int64_t R, int64_t E, const float* k, int64_t ldk, int64_t n, float* s, int64_t lds,
              bool far_fetch, int64_t rows_after = 0);
// the same with bfloat16 (bf16) or float16 key rows, widened in registers
void dot_rows_16(const float* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                 int64_t lds, bool bf16, bool far_fetch);
// s[r * lds + c] = dot(q row r, key row c) with bfloat16 q rows (R x E) and
// key rows on AVX512-BF16 (vdpbf16ps); false (nothing written) where the
// path in use lacks it
bool dot_rows_bf16(const uint16_t* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                   int64_t lds, bool far_fetch, int64_t rows_after = 0);
// o[r * ldo + c] += sum over j < n of p[r * ldp + j] v[j * ldv + c] for R rows
// and Ev columns, each value row read whole in address order; false (nothing
// written) where the path in use has no such routine. acc_rows_16: bfloat16
// (bf16) or float16 rows of v widened in registers. (rows_after: above)
bool acc_rows(const float* p, int64_t R, int64_t n, int64_t ldp, const float* v, int64_t ldv, int64_t Ev, float* o,
              int64_t ldo, bool far_fetch, int64_t rows_after = 0);
bool acc_rows_16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv, int64_t Ev,
                 float* o, int64_t ldo, bool bf16, bool far_fetch, int64_t rows_after = 0);
// dst[i] = float of the bfloat16 / float16 bits src[i] (exact)
void widen_bf16(const uint16_t* src, int64_t n, float* dst);
void widen_half(const uint16_t* src, int64_t n, float* dst);

}  // namespace cpu
}  // namespace mha_ext
