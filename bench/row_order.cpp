// Why the CPU decode kernel reads each key / value row whole, in address
// order (csrc/cpu/rows_cpu.cpp): one core, 128 MiB of float32 rows of 128
// columns (far past the caches), the same dot products of four query rows
// with each block of four key rows, read two ways, beside a plain sum; and
// the core's rate of 16-wide fused multiply-adds, which caps decoding with
// many query rows a key/value head. Then the decode kernel's order of reads:
// in-order blocks from a K array and a V array in turn, 256 rows each (a
// key tile's score pass, then its value pass), without and with a fetch of
// each row's bytes 4 KiB ahead into L1 (rows_avx512.h's PageFetch; on a VM
// of 2026-11-27 it cut this loop from 17-19 to 11-12 GB/s, while an earlier
// VM state had measured it 1.3-1.7x faster inside the kernel). Interleaved
// medians of 9.
//
//   g++ -O3 -march=x86-64-v4 bench/row_order.cpp -o /tmp/row_order && /tmp/row_order
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {
constexpr long kRows = 262144, kCols = 128;
float sink;

double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The dot products of 4 query rows with key rows c .. c + 3 for c in
// [c0, c1), 16 sums in registers; interleaved: a 16-column block of each row
// in turn; in order: each row whole before the next, and with kAhead its
// bytes 4 KiB on fetched into L1 first.
template <bool kInOrder, bool kAhead = false>
void scores(const float* k, const float* q, float* s, long c0 = 0, long c1 = kRows) {
  for (long c = c0; c < c1; c += 4) {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    if (kInOrder) {
      for (int j = 0; j < 4; ++j) {
        const char* row = reinterpret_cast<const char*>(k + (c + j) * kCols);
        if (kAhead)
          for (long b = 0; b < kCols * 4; b += 64) _mm_prefetch(row + 4096 + b, _MM_HINT_T0);
        for (int e = 0; e < kCols; e += 16) {
          const __m512 kv = _mm512_load_ps(k + (c + j) * kCols + e);
          for (int r = 0; r < 4; ++r) acc[r * 4 + j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * kCols + e), kv, acc[r * 4 + j]);
        }
      }
    } else {
      for (int e = 0; e < kCols; e += 16)
        for (int j = 0; j < 4; ++j) {
          const __m512 kv = _mm512_load_ps(k + (c + j) * kCols + e);
          for (int r = 0; r < 4; ++r) acc[r * 4 + j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * kCols + e), kv, acc[r * 4 + j]);
        }
    }
    for (int i = 0; i < 16; ++i) s[c * 4 + i] = _mm512_reduce_add_ps(acc[i]);
  }
}
// K and V in turn, 256 rows of each at a time (a decode step's tiles)
template <bool kAhead>
void tiles_in_turn(const float* k, const float* v, const float* q, float* s) {
  for (long c0 = 0; c0 < kRows; c0 += 256) {
    scores<true, kAhead>(k, q, s, c0, c0 + 256);
    scores<true, kAhead>(v, q, s, c0, c0 + 256);
  }
}
// 16 independent chains of n fused multiply-adds each: the core's rate
float fma_chains(long n) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 x = _mm512_set1_ps(1.0000001f);
  const __m512 y = _mm512_set1_ps(0.9999f);
  for (long i = 0; i < n; ++i) {
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(acc[j], x, y);
    __asm__ volatile("" : "+v"(x));
  }
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += _mm512_reduce_add_ps(acc[j]);
  return total;
}
}  // namespace

int main() {
  float* k = static_cast<float*>(aligned_alloc(64, kRows * kCols * sizeof(float)));
  for (long i = 0; i < kRows * kCols; ++i) k[i] = static_cast<float>(i % 7) * 0.1f;
  float* v = static_cast<float*>(aligned_alloc(64, kRows * kCols * sizeof(float)));
  for (long i = 0; i < kRows * kCols; ++i) v[i] = static_cast<float>(i % 5) * 0.1f;
  std::vector<float> q(4 * kCols, 0.01f), s(kRows * 4);
  std::vector<std::pair<const char*, std::function<void()>>> runs = {
      {"plain sum", [&] {
         __m512 a = _mm512_setzero_ps(), b = a;
         for (long i = 0; i < kRows * kCols; i += 32) {
           a = _mm512_add_ps(a, _mm512_load_ps(k + i));
           b = _mm512_add_ps(b, _mm512_load_ps(k + i + 16));
         }
         sink += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
       }},
      {"4 rows interleaved", [&] { scores<false>(k, q.data(), s.data()); }},
      {"4 rows in order", [&] { scores<true>(k, q.data(), s.data()); }},
      {"K, V tiles in turn", [&] { tiles_in_turn<false>(k, v, q.data(), s.data()); }},
      {"  + 4 KiB-ahead fetch", [&] { tiles_in_turn<true>(k, v, q.data(), s.data()); }},
  };
  const double bytes[] = {1, 1, 1, 2, 2};  // of k's size
  std::vector<std::vector<double>> t(runs.size());
  for (auto& r : runs) r.second();
  for (int rep = 0; rep < 9; ++rep)
    for (size_t i = 0; i < runs.size(); ++i) t[i].push_back(seconds(runs[i].second));
  for (size_t i = 0; i < runs.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    std::printf("%-22s %5.1f GB/s\n", runs[i].first, bytes[i] * kRows * kCols * sizeof(float) / t[i][4] / 1e9);
  }
  const long n = 100000000;
  const double fma_s = seconds([&] { sink += fma_chains(n); });
  std::printf("%-22s %5.2f G/s\n", "16-wide FMAs", n * 16 / fma_s / 1e9);
  std::printf("(%g)\n", static_cast<double>(sink + s[5]));
}
