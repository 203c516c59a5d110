// The memory's rate for the read orders a decode step can take through a
// (B, S, H, D) KV cache (kvcache_attention's layout: a key's H heads of D
// elements side by side), without the attention's arithmetic: T threads, each
// summing its own K and V arrays of H = 8 heads of 256 bytes a key (bfloat16
// D = 128; 64 MiB each a thread, from memory), the orders interleaved rep by
// rep, GB/s and the ratio to address order in the same rep (medians).
//
//   g++ -O2 -std=c++20 -pthread bench/kv_read_order.cpp -o /tmp/kv_read_order && /tmp/kv_read_order [REPS [T]]
//
// Orders (tiles of 256 keys, K's tile then V's, as the decode kernel reads them):
//   0 address order: each key's H heads in turn (a whole row of H D elements);
//   1 head after head: a tile's rows of head 0, then of head 1, ... (the
//     decode kernel's split-major items, one head a routine call);
//   2 the same, each row also fetched 32 keys on into L2 (the kernel's far
//     fetch of strided rows);
//   3 the same, each head's pass also fetching its eighth of the next tile's
//     bytes in address order, four lines a key, into L2;
//   4-7 orders 2 and 3 over tiles of 64 keys, then of 32 (the heads in turn
//     within each smaller tile: an item of all a batch's heads walking its
//     keys in sub-blocks).
// Needs AVX-512 (the sums are 512-bit loads).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {
constexpr size_t kBytes = 64ull << 20;  // of K (and of V) a thread
constexpr size_t kHeads = 8, kChunk = 256, kRow = kHeads * kChunk, kTile = 256;  // kTile: the largest tile
constexpr int kOrders = 8;
float sink[64 * 16];

__attribute__((target("avx512f"), always_inline)) inline __m512 sum_chunk(const char* p, __m512 a) {
  for (size_t o = 0; o < kChunk; o += 64) a = _mm512_add_ps(a, _mm512_load_ps(reinterpret_cast<const float*>(p + o)));
  return a;
}

// one head's pass over a tile of x (K or V) in the order `order` (1-3)
template <size_t kTile>
__attribute__((target("avx512f"), always_inline)) inline __m512 head_pass(const char* x, size_t j0, size_t h,
                                                                         int order, __m512 a) {
  constexpr size_t kLinesPerKey = kRow / 64 / kHeads;  // of the next tile, a head's pass: 4
  const char* next = x + (j0 + kTile) * kRow + h * kTile * kLinesPerKey * 64;
  for (size_t j = j0; j < j0 + kTile; ++j) {
    if (order == 2)
      for (size_t o = 0; o < kChunk; o += 64) _mm_prefetch(x + (j + 32) * kRow + h * kChunk + o, _MM_HINT_T1);
    if (order == 3)
      for (size_t l = 0; l < kLinesPerKey; ++l) _mm_prefetch(next + ((j - j0) * kLinesPerKey + l) * 64, _MM_HINT_T1);
    a = sum_chunk(x + j * kRow + h * kChunk, a);
  }
  return a;
}

template <size_t kTile>
__attribute__((target("avx512f"))) float read_tiles(int order, const char* k, const char* v) {
  __m512 a = _mm512_setzero_ps();
  for (size_t j0 = 0; j0 < kBytes / kRow; j0 += kTile) {
    if (order == 0) {
      for (size_t j = j0; j < j0 + kTile; ++j)
        for (size_t h = 0; h < kHeads; ++h) a = sum_chunk(k + j * kRow + h * kChunk, a);
      for (size_t j = j0; j < j0 + kTile; ++j)
        for (size_t h = 0; h < kHeads; ++h) a = sum_chunk(v + j * kRow + h * kChunk, a);
    } else {
      for (size_t h = 0; h < kHeads; ++h) {
        a = head_pass<kTile>(k, j0, h, order, a);
        a = head_pass<kTile>(v, j0, h, order, a);
      }
    }
  }
  return _mm512_reduce_add_ps(a);
}

float read(int order, const char* k, const char* v) {
  if (order < 4) return read_tiles<kTile>(order, k, v);
  const int base = 2 + order % 2;  // 4, 6: rows 32 keys on; 5, 7: the next tile's share
  return order < 6 ? read_tiles<64>(base, k, v) : read_tiles<32>(base, k, v);
}
}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 21, threads = argc > 2 ? std::atoi(argv[2]) : 2;
  std::vector<char*> k(threads), v(threads);
  const size_t pad = (kTile + 64) * kRow;  // the fetches past the last tile stay inside the arrays
  for (int t = 0; t < threads; ++t) {
    k[t] = static_cast<char*>(std::aligned_alloc(4096, kBytes + pad));
    v[t] = static_cast<char*>(std::aligned_alloc(4096, kBytes + pad));
    std::memset(k[t], 0, kBytes + pad);
    std::memset(v[t], 0, kBytes + pad);
  }
  std::barrier sync(threads + 1);
  std::atomic<int> order{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (;;) {
        sync.arrive_and_wait();
        if (stop) return;
        sink[16 * t] += read(order, k[t], v[t]);
        sync.arrive_and_wait();
      }
    });
  std::vector<std::vector<double>> gbs(kOrders);
  for (int r = 0; r < reps; ++r)
    for (int i = 0; i < kOrders; ++i) {
      const int o = (i + r) % kOrders;  // a different order first each rep
      order = o;
      const auto t0 = std::chrono::steady_clock::now();
      sync.arrive_and_wait();
      sync.arrive_and_wait();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      gbs[o].push_back(2.0 * threads * kBytes / s / 1e9);
    }
  stop = true;
  sync.arrive_and_wait();
  for (auto& t : pool) t.join();
  const char* names[kOrders] = {"address order", "head after head", "head after head, rows 32 keys on into L2",
                                "head after head, the next tile's share in address order",
                                "tiles of 64 keys: rows 32 keys on into L2", "tiles of 64 keys: the next tile's share",
                                "tiles of 32 keys: rows 32 keys on into L2", "tiles of 32 keys: the next tile's share"};
  std::printf("%d threads, %d heads of %zu bytes a key, %zu MiB of K and of V a thread, medians of %d reps\n",
              threads, static_cast<int>(kHeads), kChunk, kBytes >> 20, reps);
  for (int o = 0; o < kOrders; ++o) {
    std::vector<double> g = gbs[o], ratio;
    for (int r = 0; r < reps; ++r) ratio.push_back(gbs[o][r] / gbs[0][r]);
    std::sort(g.begin(), g.end());
    std::sort(ratio.begin(), ratio.end());
    std::printf("%-58s %5.1f GB/s   / address order %.2f (quartiles %.2f-%.2f)\n", names[o], g[reps / 2],
                ratio[reps / 2], ratio[reps / 4], ratio[3 * reps / 4]);
  }
}
