// This CPU's rate, on one core, of the 512-bit instructions the AVX-512
// decode routines are made of: vfmadd231ps (float32 rows), vdpbf16ps
// (bfloat16 rows on AVX512-BF16), vshuff32x4 (sum16's tree) and vpunpcklwd
// (the pairing of bfloat16 value rows), each as 16 independent chains in
// registers, so that the rate is the instruction's throughput, not its
// latency. The compute bound of a decode case follows: e.g. 4 bfloat16 query
// rows a key/value head of 128 columns take 2 x 4 x 128 / 32 = 32 vdpbf16ps a
// key. Not part of the build:
//
//     g++ -O2 -o /tmp/vector_rates bench/vector_rates.cpp && /tmp/vector_rates
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int kChains = 16;

#define MHA_CHAINS(insn, type, init, operand)                                               \
  type a[kChains];                                                                          \
  for (int i = 0; i < kChains; ++i) a[i] = init(i);                                         \
  for (long j = 0; j < n; ++j) {                                                            \
    _Pragma("GCC unroll 16") for (int i = 0; i < kChains; ++i) asm volatile(insn : "+v"(a[i]) : operand); \
  }                                                                                         \
  type s = a[0];                                                                            \
  for (int i = 1; i < kChains; ++i) asm("" : "+v"(s) : "v"(a[i]));                          \
  return s[0];

__attribute__((target("avx512f,avx512bf16"), noinline)) float dpbf16(long n) {
  const __m512 x = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80));
  MHA_CHAINS("vdpbf16ps %1, %1, %0", __m512, _mm512_set1_ps, "v"(x))
}
__attribute__((target("avx512f"), noinline)) float fma(long n) {
  const __m512 x = _mm512_set1_ps(1.0001f);
  MHA_CHAINS("vfmadd231ps %1, %1, %0", __m512, _mm512_set1_ps, "v"(x))
}
__attribute__((target("avx512f"), noinline)) float shuffle(long n) {
  const __m512 x = _mm512_set1_ps(1.0f);
  MHA_CHAINS("vshuff32x4 $0x44, %1, %0, %0", __m512, _mm512_set1_ps, "v"(x))
}
__attribute__((target("avx512f,avx512bw"), noinline)) float unpack(long n) {
  const __m512 x = _mm512_set1_ps(1.0f);
  MHA_CHAINS("vpunpcklwd %1, %0, %0", __m512, _mm512_set1_ps, "v"(x))
}
#undef MHA_CHAINS

void rate(const char* name, float (*f)(long)) {
  const long n = 20000000;
  f(1000);
  const auto t0 = std::chrono::steady_clock::now();
  volatile float r = f(n);
  const auto t1 = std::chrono::steady_clock::now();
  (void)r;
  const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / (double(n) * kChains);
  std::printf("%-12s %.3f ns an instruction, %.2f G/s a core\n", name, ns, 1 / ns);
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("this CPU has no AVX-512\n");
    return 0;
  }
  for (int round = 0; round < 2; ++round) {  // twice: this VM's speed moves from second to second
    rate("vfmadd231ps", fma);
    if (__builtin_cpu_supports("avx512bf16")) rate("vdpbf16ps", dpbf16);
    rate("vshuff32x4", shuffle);
    rate("vpunpcklwd", unpack);
  }
}
