// The CPU tile GEMM (csrc/cpu/gemm_cpu.cpp) on one core, in GFLOP/s, on the
// forward's two tile shapes (S = Q K^T: 64 x 256 x 64; O += P V: 64 x 64 x
// 256) and a square one, on the instruction-set path this CPU picks
// (MHA_EXT_CPU_ISA forces a lower one). Best of 7 runs of 200 calls. Where
// the path multiplies bfloat16 in pairs (avx512bf16, amx), the same shapes
// by gemm_bf16_pairs follow (operands padded to 32 as the kernels pad them).
// MHA_AVX2_MR sets the AVX2 micro-kernel's rows (default 6).
//
//   g++ -std=c++17 -O3 bench/gemm_tiles.cpp csrc/cpu/gemm_cpu.cpp csrc/cpu/amx_cpu.cpp
//       csrc/cpu/softmax_cpu.cpp csrc/cpu/softmax_avx2.cpp -o /tmp/gemm_tiles && taskset -c 0 /tmp/gemm_tiles
#include "../csrc/cpu/gemm_cpu.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

using mha_ext::cpu::active_isa;
using mha_ext::cpu::gemm;
using mha_ext::cpu::gemm_bf16_pairs;
using mha_ext::cpu::Isa;
using mha_ext::cpu::isa_name;

int main() {
  std::mt19937 g(0);
  std::uniform_real_distribution<float> u(-1, 1);
  auto run = [&](const char* name, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, float beta) {
    std::vector<float> a(M * lda), b(K * ldb), c(M * N);
    for (auto& x : a) x = u(g);
    for (auto& x : b) x = u(g);
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 200; ++it) gemm(M, N, K, 1.f, a.data(), lda, 1, b.data(), ldb, beta, c.data(), N);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 200);
    }
    std::printf("%-7s %-6s %4ld x %4ld x %4ld: %6.1f GFLOP/s\n", isa_name(active_isa()), name, long(M), long(N), long(K),
                2.0 * M * N * K / best / 1e9);
  };
  run("QK^T", 64, 256, 64, 64, 1040, 0.f);  // (K^T's row stride as the forward pads it)
  run("PV", 64, 64, 256, 256, 64, 1.f);
  run("square", 256, 256, 256, 256, 256, 0.f);
  if (!(active_isa() >= Isa::kAvx512Bf16)) return 0;
  // A (M x K) rows of lda bf16, B as K / 2 pair rows of ldb bf16
  auto pairs = [&](const char* name, int64_t M, int64_t N, int64_t K, int64_t ldb, bool accumulate) {
    std::vector<uint16_t> a(M * K), b(K / 2 * ldb);
    std::vector<float> c(M * N);
    for (auto& x : a) x = static_cast<uint16_t>(0x3f00 + (g() & 0xff));
    for (auto& x : b) x = static_cast<uint16_t>(0x3f00 + (g() & 0xff));
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 200; ++it) gemm_bf16_pairs(M, N, K, a.data(), K, b.data(), ldb, c.data(), N, accumulate);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 200);
    }
    std::printf("%-7s %-6s %4ld x %4ld x %4ld: %6.1f GFLOP/s (bfloat16 pairs)\n", isa_name(active_isa()), name,
                long(M), long(N), long(K), 2.0 * M * N * K / best / 1e9);
  };
  pairs("QK^T", 64, 256, 64, 2 * 1024 + 32, false);  // (K's pair rows as the forward pads them)
  pairs("PV", 64, 64, 256, 2 * 64, true);
  pairs("square", 256, 256, 256, 2 * 256, false);
}
