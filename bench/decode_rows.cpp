// The AVX2 decode routines (csrc/cpu/rows_avx2.cpp: dot_rows, acc_rows; rows_lanes_avx2.cpp)
// outside the op, in ns a key and GB/s, over tiles of 256 keys as the decode
// kernel calls them; T threads, each on its own K/V of S keys (64 MiB and
// more come from memory, a few hundred KiB stay in L2). Medians of 21 runs.
//
//   g++ -std=c++17 -O3 -pthread bench/decode_rows.cpp csrc/cpu/rows_avx2.cpp csrc/cpu/rows_lanes_avx2.cpp \
//       -o /tmp/decode_rows
//   /tmp/decode_rows KIND R E S [WHICH [T [FAR [PASSES]]]]
//     KIND 0 float32, 1 bfloat16, 2 float16 rows; R query rows, E columns (key and value);
//     WHICH 1 the scores, 2 P V, 3 both (default); T threads (default 2); FAR the far fetch (default 1);
//     PASSES over the K/V a run (default 1): with S = 256 and a few thousand, K/V stay in L1 / L2 and
//     the figures are the routines' own time a key (times the clock: their cycles a key).
//
// Two versions interleaved in one process: build another version of
// rows_avx2.cpp and rows_lanes_avx2.cpp into the namespace mha_old and name
// its header (the namespace renamed) in MHA_ROWS_OLD; the program then times
// both, run for run, and prints the largest difference of their scores and
// of their outputs, each over the largest magnitude.
//
//   (a version from before rows_lanes_avx2.cpp: rows_avx2.cpp alone)
//   mkdir -p /tmp/old && for f in rows_avx2.cpp rows_lanes_avx2.cpp; do
//     git show HEAD~1:csrc/cpu/$f > /tmp/old/$f
//     g++ -std=c++17 -O3 -c -Dmha_ext=mha_old -Icsrc/cpu /tmp/old/$f -o /tmp/old/$f.o; done
//   git show HEAD~1:csrc/cpu/rows_avx2.h | sed 's/namespace mha_ext/namespace mha_old/' > /tmp/old/rows_avx2.h
//   g++ -std=c++17 -O3 -pthread -DMHA_ROWS_OLD='"/tmp/old/rows_avx2.h"' bench/decode_rows.cpp
//       csrc/cpu/rows_avx2.cpp csrc/cpu/rows_lanes_avx2.cpp /tmp/old/*.o -o /tmp/decode_rows_ab
#include "../csrc/cpu/rows_avx2.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef MHA_ROWS_OLD
#include MHA_ROWS_OLD  // the other version's rows_avx2.h, its namespace renamed mha_old (above)
#endif

namespace {
constexpr int64_t kTile = 256;

uint16_t half_bits(float x, int kind) {  // bfloat16 (truncated) or float16 (normal range only) bits of x
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (kind == 1) return static_cast<uint16_t>(u >> 16);
  const uint32_t sign = (u >> 16) & 0x8000, exp = (u >> 23) & 0xff, man = (u >> 13) & 0x3ff;
  return static_cast<uint16_t>(sign | ((exp - 112) << 10) | man);
}

struct Work {
  std::vector<char> k, v;
  std::vector<float> q, s, o;
};

template <typename Kind, typename Dot, typename Acc>
void run_tiles(Work& w, int kind, int64_t R, int64_t E, int64_t S, int which, bool far, int64_t passes, Dot dot,
               Acc acc) {
  const int64_t elem = kind == 0 ? 4 : 2;
  for (int64_t pass = 0; pass < passes; ++pass) {
    for (int64_t j0 = 0; j0 < S; j0 += kTile) {
      if (which & 1)
        dot(w.q.data(), R, E, w.k.data() + j0 * E * elem, static_cast<Kind>(kind), E, kTile, w.s.data(), kTile, far);
      if constexpr (std::is_invocable_v<Acc, const float*, int64_t, int64_t, int64_t, const char*, Kind, int64_t,
                                        int64_t, float*, int64_t, bool, int64_t>) {
        if (which & 2)  // (rows_after: the rest of the thread's keys, read next)
          acc(w.s.data(), R, kTile, kTile, w.v.data() + j0 * E * elem, static_cast<Kind>(kind), E, E, w.o.data(), E,
              far, S - j0 - kTile);
      } else if (which & 2) {  // (a version from before rows_after)
        acc(w.s.data(), R, kTile, kTile, w.v.data() + j0 * E * elem, static_cast<Kind>(kind), E, E, w.o.data(), E,
            far);
      }
    }
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s KIND R E S [WHICH [T [FAR]]]\n", argv[0]);
    return 2;
  }
  const int kind = std::atoi(argv[1]);
  const int64_t R = std::atol(argv[2]), E = std::atol(argv[3]), S = std::atol(argv[4]) / kTile * kTile;
  const int which = argc > 5 ? std::atoi(argv[5]) : 3, T = argc > 6 ? std::atoi(argv[6]) : 2;
  const bool far = argc > 7 ? std::atoi(argv[7]) != 0 : true;
  const int64_t passes = argc > 8 ? std::atol(argv[8]) : 1;
  if (kind < 0 || kind > 2 || R < 1 || E < 1 || S < kTile || which < 1 || which > 3 || T < 1 || passes < 1) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const int64_t elem = kind == 0 ? 4 : 2;
  std::vector<Work> works(T);
  std::mt19937 g(0);
  std::normal_distribution<float> nd;
  for (Work& w : works) {
    w.k.resize(S * E * elem), w.v.resize(S * E * elem);
    for (int64_t i = 0; i < S * E; ++i) {
      const float a = nd(g), b = nd(g);
      if (kind == 0) {
        std::memcpy(&w.k[i * 4], &a, 4), std::memcpy(&w.v[i * 4], &b, 4);
      } else {
        const uint16_t ha = half_bits(a, kind), hb = half_bits(b, kind);
        std::memcpy(&w.k[i * 2], &ha, 2), std::memcpy(&w.v[i * 2], &hb, 2);
      }
    }
    w.q.resize(R * E), w.s.resize(R * kTile), w.o.assign(R * E, 0.0f);
    for (float& x : w.q) x = nd(g) / std::sqrt(static_cast<float>(E));
    for (float& x : w.s) x = std::fabs(nd(g)) / kTile;  // P V alone: weights of the size softmax gives
  }
  namespace now = mha_ext::cpu::avx2;
  auto run = [&](bool old_version) {
    std::vector<std::thread> th;
    for (int t = 0; t < T; ++t)
      th.emplace_back([&, t] {
#ifdef MHA_ROWS_OLD
        if (old_version) {
          namespace was = mha_old::cpu::avx2;
          return run_tiles<was::RowKind>(works[t], kind, R, E, S, which, far, passes, was::dot_rows, was::acc_rows);
        }
#endif
        (void)old_version;
        run_tiles<now::RowKind>(works[t], kind, R, E, S, which, far, passes, now::dot_rows, now::acc_rows);
      });
    for (auto& x : th) x.join();
  };
  auto timed = [&](bool old_version) {
    const auto t0 = std::chrono::steady_clock::now();
    run(old_version);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
#ifdef MHA_ROWS_OLD
  const int versions = 2;
  run(true);  // the two versions' results from the same inputs
  const std::vector<float> s_old = works[0].s, o_old = works[0].o;
  for (Work& w : works) std::fill(w.o.begin(), w.o.end(), 0.0f);
  run(false);
  auto difference = [](const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0, m = 1e-30;
    for (size_t i = 0; i < a.size(); ++i) {
      d = std::max(d, std::fabs(double(a[i]) - b[i]));
      m = std::max(m, std::fabs(double(a[i])));
    }
    return d / m;
  };
  const double ds = difference(s_old, works[0].s), dout = difference(o_old, works[0].o);
#else
  const int versions = 1;
  run(false);
#endif
  std::vector<double> times[2];
  for (int rep = 0; rep < 21; ++rep)
    for (int x = versions - 1; x >= 0; --x) times[x].push_back(timed(x == 1));
  const double bytes = double(T) * S * E * elem * ((which & 1) + (which >> 1));
  std::printf("kind %d, %lld rows, %lld columns, %lld keys a thread x %lld passes, %d threads, %s:", kind,
              (long long)R, (long long)E, (long long)S, (long long)passes, T,
              which == 1 ? "scores" : which == 2 ? "P V" : "both");
  double med[2];
  for (int x = versions - 1; x >= 0; --x) {
    std::sort(times[x].begin(), times[x].end());
    med[x] = times[x][times[x].size() / 2];
    std::printf("  %s %.1f ns a key, %.2f GB/s", x == 1 ? "old" : "this", med[x] * 1e9 / (S * passes),
                bytes * passes / med[x] / 1e9);
  }
#ifdef MHA_ROWS_OLD
  std::printf("  this / old speed %.2f  difference: scores %.1e, O %.1e", med[1] / med[0], ds, dout);
#endif
  std::printf("\n");
  return 0;
}
