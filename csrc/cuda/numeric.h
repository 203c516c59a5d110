// Element types and scalar math of the CUDA device code, the same names in
// both builds: under nvcc __half / __nv_bfloat16 and the CUDA math library; in
// the emulation c10::Half / c10::BFloat16, whose conversions round to nearest
// even as the device's do, and <cmath>.
#pragma once

#include "simt.h"

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#endif

namespace mha_ext::simt {

#if defined(__CUDACC__)
using f16 = __half;
using bf16 = __nv_bfloat16;
MHA_DEVICE float to_float(f16 x) { return __half2float(x); }
MHA_DEVICE float to_float(bf16 x) { return __bfloat162float(x); }
MHA_DEVICE uint16_t bits_of(f16 x) { return __half_as_ushort(x); }
MHA_DEVICE uint16_t bits_of(bf16 x) { return __bfloat16_as_ushort(x); }
MHA_DEVICE float fexp(float x) { return expf(x); }
MHA_DEVICE double fexp(double x) { return exp(x); }
MHA_DEVICE float fexp2(float x) { return exp2f(x); }
MHA_DEVICE float flog2(float x) { return log2f(x); }
MHA_DEVICE float flog(float x) { return logf(x); }
MHA_DEVICE double flog(double x) { return log(x); }
MHA_DEVICE float ftanh(float x) { return tanhf(x); }
MHA_DEVICE double ftanh(double x) { return tanh(x); }
template <typename T>
MHA_DEVICE T from_float(float x);
template <>
MHA_DEVICE f16 from_float<f16>(float x) { return __float2half_rn(x); }
template <>
MHA_DEVICE bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
#else
using f16 = c10::Half;
using bf16 = c10::BFloat16;
inline float to_float(f16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) { return static_cast<float>(x); }
inline uint16_t bits_of(f16 x) { return x.x; }
inline uint16_t bits_of(bf16 x) { return x.x; }
inline float fexp(float x) { return std::exp(x); }
inline double fexp(double x) { return std::exp(x); }
inline float fexp2(float x) { return std::exp2(x); }
inline float flog2(float x) { return std::log2(x); }
inline float flog(float x) { return std::log(x); }
inline double flog(double x) { return std::log(x); }
inline float ftanh(float x) { return std::tanh(x); }
inline double ftanh(double x) { return std::tanh(x); }
template <typename T>
inline T from_float(float x) { return T(x); }
#endif

MHA_DEVICE float to_float(float x) { return x; }
MHA_DEVICE double to_float(double x) { return x; }

// Converts an accumulator value to element type T.
template <typename T, typename A>
MHA_DEVICE T to_elem(A x) {
  if constexpr (sizeof(T) == 2) {
    return from_float<T>(static_cast<float>(x));
  } else {
    return static_cast<T>(x);
  }
}

// The accumulation type of element type T: double for double, else float.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

// Max that propagates NaN from either side (fmaxf drops it; a NaN score must
// make its row NaN, as on the CPU). On sm_80 and later, float's is one
// instruction (max.NaN) instead of two tests and a branch.
template <typename A>
MHA_DEVICE A nan_max(A a, A b) {
  if (a != a) return a;
  if (b != b) return b;
  return b > a ? b : a;
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
MHA_DEVICE float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#endif

// a * b rounded, never fused with an addition into an FMA
#if defined(__CUDACC__)
MHA_DEVICE float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
#else
inline float fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
#endif

// a * b + c rounded once (an FMA, also in the emulation: std::fmaf)
MHA_DEVICE float ffma(float a, float b, float c) { return fmaf(a, b, c); }

// 2^x for a softmax probability of element type T. For float16 / bfloat16,
// whose P the tensor cores take rounded to 11 / 8 bits, the hardware's
// approximation (ex2.approx.ftz: about 2 ulp of float, results below 2^-126
// flushed to zero) instead of exp2f's range reduction; the emulation flushes
// alike. float and double keep the accurate function.
template <typename T>
MHA_DEVICE float softmax_exp2(float x) {
  if constexpr (sizeof(T) == 2) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#elif !defined(__CUDACC__)
    const float r = std::exp2(x);
    return r < 1.17549435e-38f ? 0.0f : r;
#endif
  }
  return fexp2(x);
}

}  // namespace mha_ext::simt
