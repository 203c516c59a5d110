// The AVX2 + FMA paths of the row primitives, for CPUs without AVX-512 (AMD
// EPYC before Zen 4, Intel client parts): the softmax's max and exponential,
// the boolean and float masks (softmax_avx2.cpp), and the decode kernel's
// scores and P V (rows_avx2.cpp, rows_lanes_avx2.cpp). Each is the AVX-512 routine of softmax_cpu.cpp / rows_cpu.cpp
// with 8 lanes a register, called by their dispatchers on Isa::kAvx2; the
// contracts are gemm_cpu.h's. Also the 2^x polynomial both files use.
#pragma once
#include <cstdint>

namespace mha_ext {
namespace cpu {

// 2^x: n = round(x), r = x - n in [-1/2, 1/2], 2^r by a degree-6 polynomial
// (least-squares fit in relative error, 2e-9 in exact arithmetic, 8e-8 =
// 0.7 ulp evaluated in float), times 2^n. Below -125 the result is 0 (no
// denormals reach the products that follow), NaN stays NaN; large x gives inf
// (from 127.5 on in the portable version: the kernels' arguments are <= ~0).
// The kernels keep float scores in base 2 (times log2 e, folded into the
// product's alpha), which saves the multiply and the two-part ln 2 reduction
// of a natural exp.
constexpr float kExp2Lo = -125.0f, kExp2Hi = 128.0f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound - kRound rounds to nearest
constexpr float kP6 = 1.5353362e-4f, kP5 = 1.3398875e-3f, kP4 = 9.6184369e-3f, kP3 = 5.5503324e-2f,
                kP2 = 0.24022648f, kP1 = 0.69314718f;

// tanh (softmax_cpu.cpp's tanh_512, softmax_avx2.cpp's tanh_256): below
// kTanhSeriesEnd the odd Taylor series x + x^3 (kT3 + x^2 (kT5 + ...)), from
// it on (1 - e) / (1 + e) with e = 2^(kTanhExp2 |x|) = e^(-2 |x|).
constexpr float kTanhSeriesEnd = 0.5f, kTanhExp2 = -2.8853900817779268f;  // -2 log2 e
constexpr float kT3 = -1.0f / 3, kT5 = 2.0f / 15, kT7 = -17.0f / 315, kT9 = 62.0f / 2835, kT11 = -1382.0f / 155925,
                kT13 = 21844.0f / 6081075;

namespace avx2 {
void alibi_row(float* s, int64_t n, float slope, int64_t d0);  // |d0|, n < 2^30 (cpu::alibi_row checks): 32-bit lanes
void softcap_row(float* s, int64_t n, float cap, float inv);
void softcap_grad(const float* raw, int64_t n, float inv, float* ds);
float row_max(const float* x, int64_t n);
float exp2_sub_sum(float* x, int64_t n, float mul, float sub);
void mask_bool(float* s, const uint8_t* keep, int64_t n);
void mask_add(float* s, const float* m, int64_t n, float unit);
void mask_add16(float* s, const uint16_t* m, bool bf16, int64_t n, float unit);
// Key / value rows: 0 float32, 1 bfloat16 bits, 2 float16 bits (widened in
// registers; float16 by F16C, which every AVX2 CPU has).
enum class RowKind : int { kFloat = 0, kBf16 = 1, kHalf = 2 };
// s[r * lds + c] = dot(q row r, key row c): R query rows (R x E, dense), n key rows (row stride ldk)
void dot_rows(const float* q, int64_t R, int64_t E, const void* k, RowKind kind, int64_t ldk, int64_t n, float* s,
              int64_t lds, bool far_fetch);
// The same for the query rows in whole groups of 16, one a vector lane
// (rows_lanes_avx2.cpp): returns how many of the R rows it took (R / 16 * 16);
// dot_rows takes them first and the rest itself.
int64_t dot_rows_lanes(const float* q, int64_t R, int64_t E, const void* k, RowKind kind, int64_t ldk, int64_t n,
                       float* s, int64_t lds, bool far_fetch);
// o[r * ldo + c] += sum over j < n of p[r * ldp + j] v[j * ldv + c], R rows, Ev columns
// (rows_after: as gemm_cpu.h's acc_rows)
void acc_rows(const float* p, int64_t R, int64_t n, int64_t ldp, const void* v, RowKind kind, int64_t ldv, int64_t Ev,
              float* o, int64_t ldo, bool far_fetch, int64_t rows_after = 0);
}  // namespace avx2

}  // namespace cpu
}  // namespace mha_ext
