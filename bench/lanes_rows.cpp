// The AVX-512 16-row decode routines (csrc/cpu/rows_lanes_cpu.cpp: one query
// row a vector lane; float32, and bfloat16 on AVX512-BF16) outside the op, in
// ns a key and GB/s, over tiles of 256 keys as the decode kernel calls them,
// each tile told of the rest (rows_after). T threads, each on its own K/V of
// S keys (a few hundred keys stay in L2, 8-32 MiB in L3, more come from
// memory). Medians of 21 runs. Needs a CPU with AVX-512 (and AVX512-BF16 for
// KIND 1).
//
//   g++ -std=c++17 -O3 -pthread -Icsrc/cpu bench/lanes_rows.cpp csrc/cpu/rows_lanes_cpu.cpp -o /tmp/lanes_rows
//   /tmp/lanes_rows KIND S [WHICH [T [PASSES]]]
//     KIND 0 float32, 1 bfloat16; 16 query rows of 128 columns (key and value); WHICH 1 the scores,
//     2 P V, 3 both (default); T threads (default 1); PASSES over the K/V a run (default: enough
//     for about 1M keys).
#include "rows_avx512.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {
constexpr int64_t kTile = 256, kRows = 16, kE = 128;

struct Work {
  std::vector<float> qf, kf, vf, s, o;
  std::vector<uint16_t> q, k, v;
};

uint16_t bf16_bits(float x) {  // (truncated)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);
}

void run_tiles(Work& w, int kind, int64_t S, int which, int64_t passes) {
  namespace rows = mha_ext::cpu::rows;
  for (int64_t pass = 0; pass < passes; ++pass)
    for (int64_t j0 = 0; j0 < S; j0 += kTile) {
      const int64_t after = S - j0 - kTile;  // the rest of the thread's keys, read next
      if (kind == 0) {
        if (which & 1)
          rows::dot_rows_lanes(w.qf.data(), kRows, kE, w.kf.data() + j0 * kE, kE, kTile, w.s.data(), kTile, after);
        if (which & 2)
          rows::acc_rows_lanes(w.s.data(), kRows, kTile, kTile, w.vf.data() + j0 * kE, kE, kE, w.o.data(), kE, after);
      } else {
        if (which & 1)
          rows::dot_rows_lanes_bf16(w.q.data(), kRows, kE, w.k.data() + j0 * kE, kE, kTile, w.s.data(), kTile, after);
        if (which & 2)
          rows::acc_rows_lanes_bf16(w.s.data(), kRows, kTile, kTile, w.v.data() + j0 * kE, kE, kE, w.o.data(), kE,
                                    after);
      }
    }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s KIND S [WHICH [T [PASSES]]]\n", argv[0]);
    return 2;
  }
  const int kind = std::atoi(argv[1]);
  const int64_t S = std::atol(argv[2]) / kTile * kTile;
  const int which = argc > 3 ? std::atoi(argv[3]) : 3, T = argc > 4 ? std::atoi(argv[4]) : 1;
  const int64_t passes = argc > 5 ? std::atol(argv[5]) : std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(S, 1));
  if (kind < 0 || kind > 1 || S < kTile || which < 1 || which > 3 || T < 1 || passes < 1) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || (kind == 1 && !__builtin_cpu_supports("avx512bf16"))) {
    std::fprintf(stderr, "this CPU lacks the routines' instruction set\n");
    return 2;
  }
  std::vector<Work> works(T);
  std::mt19937 g(0);
  std::normal_distribution<float> nd;
  for (Work& w : works) {
    w.qf.resize(kRows * kE), w.kf.resize(S * kE), w.vf.resize(S * kE);
    for (float& x : w.qf) x = nd(g) / 11.3f;
    for (float& x : w.kf) x = nd(g);
    for (float& x : w.vf) x = nd(g);
    for (const auto* f : {&w.qf, &w.kf, &w.vf}) {
      std::vector<uint16_t>& b = f == &w.qf ? w.q : f == &w.kf ? w.k : w.v;
      b.resize(f->size());
      std::transform(f->begin(), f->end(), b.begin(), bf16_bits);
    }
    if (kind == 1) std::vector<float>().swap(w.kf), std::vector<float>().swap(w.vf);
    w.s.resize(kRows * kTile), w.o.assign(kRows * kE, 0.0f);
    for (float& x : w.s) x = std::abs(nd(g)) / kTile;  // P V alone: weights of the size softmax gives
  }
  auto timed = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int t = 0; t < T; ++t) th.emplace_back([&, t] { run_tiles(works[t], kind, S, which, passes); });
    for (auto& x : th) x.join();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  timed();  // warm-up
  std::vector<double> ns;
  for (int i = 0; i < 21; ++i) ns.push_back(timed() / (passes * static_cast<double>(S)) * 1e9);
  std::sort(ns.begin(), ns.end());
  const double med = ns[ns.size() / 2];
  const int64_t elem = kind == 0 ? 4 : 2;
  const double bytes = (which & 1 ? kE * elem : 0) + (which & 2 ? kE * elem : 0);  // a key's K and / or V row
  std::printf("%s, %lld keys, %s, %d thread(s): %.1f ns a key a thread (%.1f-%.1f), %.1f GB/s in all\n",
              kind == 0 ? "float32" : "bfloat16", static_cast<long long>(S),
              which == 1 ? "scores" : which == 2 ? "P V" : "scores and P V", T, med, ns.front(), ns.back(),
              bytes * T / med);
  return 0;
}
