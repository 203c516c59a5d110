// This CPU's rate, on one core, of the 512-bit instructions the AVX-512
// decode routines are made of: vfmadd231ps (float32 rows), vdpbf16ps
// (bfloat16 rows on AVX512-BF16), vshuff32x4 (sum16's tree) and vpunpcklwd
// (the pairing of bfloat16 value rows), each as 16 independent chains in
// registers, so that the rate is the instruction's throughput, not its
// latency. The compute bound of a decode case follows: e.g. 4 bfloat16 query
// rows a key/value head of 128 columns take 2 x 4 x 128 / 32 = 32 vdpbf16ps a
// key. On a CPU without AVX-512, the 256-bit vfmadd231ps and vbroadcastss
// (from L1) of the AVX2 routines, as 12 chains (AVX2 has 16 vector
// registers): 16 float32 query rows of 128 columns take 2 x 16 x 128 / 8 =
// 512 multiply-adds a key. Not part of the build:
//
//     g++ -O2 -o /tmp/vector_rates bench/vector_rates.cpp && /tmp/vector_rates
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int kChains = 16, kChains256 = 12;

#define MHA_CHAINS_OF(chains, insn, type, init, operand)                                    \
  type a[chains];                                                                           \
  _Pragma("GCC unroll 16") for (int i = 0; i < chains; ++i) a[i] = init(i);                 \
  for (long j = 0; j < n; ++j) {                                                            \
    _Pragma("GCC unroll 16") for (int i = 0; i < chains; ++i) asm volatile(insn : "+v"(a[i]) : operand); \
  }                                                                                         \
  type s = a[0];                                                                            \
  _Pragma("GCC unroll 16") for (int i = 1; i < chains; ++i) asm("" : "+v"(s) : "v"(a[i]));  \
  return s[0];
#define MHA_CHAINS(insn, type, init, operand) MHA_CHAINS_OF(kChains, insn, type, init, operand)

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
__attribute__((target("avx2,fma"), noinline)) float fma256(long n) {
  const __m256 x = _mm256_set1_ps(1.0001f);
  MHA_CHAINS_OF(kChains256, "vfmadd231ps %1, %1, %0", __m256, _mm256_set1_ps, "v"(x))
}
__attribute__((target("avx2"), noinline)) float broadcast256(long n) {
  static const float one = 1.0f;
  MHA_CHAINS_OF(kChains256, "vbroadcastss %1, %0", __m256, _mm256_set1_ps, "m"(one))
}
#undef MHA_CHAINS
#undef MHA_CHAINS_OF

void rate(const char* name, float (*f)(long), int chains = kChains) {
  const long n = 20000000;
  f(1000);
  const auto t0 = std::chrono::steady_clock::now();
  volatile float r = f(n);
  const auto t1 = std::chrono::steady_clock::now();
  (void)r;
  const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / (double(n) * chains);
  std::printf("%-32s %.3f ns an instruction, %.2f G/s a core\n", name, ns, 1 / ns);
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("this CPU has no AVX-512: its 256-bit rates\n");
    for (int round = 0; round < 2; ++round) {
      rate("vfmadd231ps (256-bit)", fma256, kChains256);
      rate("vbroadcastss (256-bit, from L1)", broadcast256, kChains256);
    }
    return 0;
  }
  for (int round = 0; round < 2; ++round) {  // twice: this VM's speed moves from second to second
    rate("vfmadd231ps", fma);
    if (__builtin_cpu_supports("avx512bf16")) rate("vdpbf16ps", dpbf16);
    rate("vshuff32x4", shuffle);
    rate("vpunpcklwd", unpack);
  }
}
