// This CPU's rate, on one core, of the tile-unit steps the AMX decode
// routines (csrc/cpu/amx_cpu.cpp) are made of, each variant timed in turn in
// rounds and reported as the median of its rounds (this VM's tile unit moves
// by up to 4x from run to run): O += P V's inner loop of acc_rows_split (16
// keys a step, a value tile of 16 rows x 64 bytes at the row stride of 128
// bfloat16 columns, P as two A tiles, four tdpbf16ps) with the value rows
// 64-byte aligned (as torch allocates tensors) in L1-sized and L2-sized
// buffers, and the same loop without its value loads, without its products,
// with the value loads alone; and a plain AVX-512 read of the same bytes.
// ns a key = the loop's time over the keys it covers (both 64-column passes
// of 128 columns). Not part of the build:
//
//     g++ -O2 -o /tmp/amx_rates bench/amx_rates.cpp && /tmp/amx_rates
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// (the whole configuration as the operand; see amx_cpu.cpp's load_config)
void load_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }
#define TILE_LOAD(tile, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tile : : "r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride)) : "memory")

constexpr int64_t kCols = 128;               // value columns (bfloat16): rows of 256 bytes
constexpr int64_t kPStride = (256 + 16) * 4;  // P's rows as acc_rows_split lays them out
alignas(64) float p_buf[16 * (256 + 16)];
alignas(64) float c_out[16 * 16];

enum Parts { kLoadsP = 1, kLoadsV = 2, kProducts = 4 };

// O += P V over n keys (a multiple of 16) of v, in acc_rows_split's order:
// two passes of 64 columns over each block of up to 256 keys, 16 keys a step
template <int kParts>
__attribute__((target("amx-tile,amx-bf16"), noinline)) void acc_loop(const uint16_t* v, int64_t n) {
  const int64_t sv = kCols * 2, block = std::min<int64_t>(n, 256);
  for (int64_t j0 = 0; j0 < n; j0 += block)
    for (int64_t g0 = 0; g0 < kCols; g0 += 64)
      for (int64_t j = 0; j < block; j += 16) {
        const uint16_t* vb = v + (j0 + j) * kCols + g0;
        if (kParts & kLoadsP) {
          TILE_LOAD(4, p_buf + j, kPStride);
          TILE_LOAD(5, reinterpret_cast<const char*>(p_buf + j) + 2, kPStride);
        }
        if (kParts & kLoadsV) TILE_LOAD(6, vb, sv);
        if (kParts & kProducts) {
          _tile_dpbf16ps(0, 5, 6);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (kParts & kLoadsV) TILE_LOAD(7, vb + 32, sv);
        if (kParts & kProducts) {
          _tile_dpbf16ps(2, 5, 7);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
}

__attribute__((target("avx512f"), noinline)) void plain_read(const uint16_t* v, int64_t n) {
  __m512 a = _mm512_setzero_ps(), b = a;
  const float* f = reinterpret_cast<const float*>(v);
  for (int64_t i = 0; i < n * kCols / 2; i += 32) {
    a = _mm512_add_ps(a, _mm512_loadu_ps(f + i));
    b = _mm512_add_ps(b, _mm512_loadu_ps(f + i + 16));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(a, b));
  volatile float s = lanes[0];
  (void)s;
}

bool amx_usable() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
}

}  // namespace

int main() {
  if (!amx_usable()) {
    std::printf("this CPU (or kernel) has no usable AMX\n");
    return 0;
  }
  for (int rows : {16, 4}) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = t < 6 ? rows : 16;  // C and A tiles: the rows a key/value head; B: 16 keys
      cfg.colsb[t] = 64;
    }
    load_config(cfg);
    for (int64_t keys : {128, 2048}) {  // 32 KiB of value rows (L1) and 512 KiB (L2)
      // 64-byte aligned, as torch allocates tensors (rows 2 bytes off would cross lines)
      uint16_t* v = static_cast<uint16_t*>(std::aligned_alloc(64, keys * kCols * 2));
      std::fill(v, v + keys * kCols, uint16_t(0x3c00));
      struct Variant {
        const char* name;
        void (*f)(const uint16_t*, int64_t);
      } variants[] = {{"P and V loads, products", acc_loop<kLoadsP | kLoadsV | kProducts>},
                      {"without the V loads", acc_loop<kLoadsP | kProducts>},
                      {"without the products", acc_loop<kLoadsP | kLoadsV>},
                      {"V loads alone", acc_loop<kLoadsV>},
                      {"plain AVX-512 read of V", plain_read}};
      std::vector<double> t[5];
      const int64_t reps = 4000000 / keys;
      for (int round = 0; round < 21; ++round)
        for (int i = 0; i < 5; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          for (int64_t r = 0; r < reps; ++r) variants[i].f(v, keys);
          t[i].push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
                         (double(reps) * keys));
        }
      for (int i = 0; i < 5; ++i) {
        std::sort(t[i].begin(), t[i].end());
        const double ns = t[i][t[i].size() / 2];
        std::printf("%2d rows, V %4lld KiB: %-26s %6.2f ns a key, V at %5.1f GB/s\n", rows,
                    static_cast<long long>(keys * kCols * 2 / 1024), variants[i].name, ns,
                    kCols * 2 / ns);
      }
      std::free(v);
    }
  }
  _tile_stored(0, c_out, 64);
  return 0;
}
