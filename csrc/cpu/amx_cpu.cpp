// AMX (Advanced Matrix Extensions) bfloat16 tile products for the CPU
// kernels: see amx_gemm_bf16 in gemm_cpu.h.
#include "gemm_cpu.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define MHA_AMX 1
#else
#define MHA_AMX 0
#endif

namespace mha_ext {
namespace cpu {

#if MHA_AMX
namespace {

// The 64-byte tile configuration (palette 1): bytes per row and rows per tile.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C, 16 x 16 float; 4-5: A, 16 rows x 32 bf16; 6-7: B, 16 pair rows x 16 columns.
__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 32 x 32 blocks of C, four C tiles each: every A and B tile loaded serves
// two products.
__attribute__((target("amx-tile,amx-bf16"))) void gemm_tiles(int64_t M, int64_t N, int64_t K, const uint16_t* a,
                                                              int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                                                              int64_t ldc, bool accumulate) {
  configure_tiles();
  const int64_t sa = lda * 2, sb = ldb * 2, sc = ldc * 4;  // strides in bytes
  for (int64_t m = 0; m < M; m += 32) {
    for (int64_t n = 0; n < N; n += 32) {
      float* c00 = c + m * ldc + n;
      if (accumulate) {
        _tile_loadd(0, c00, sc);
        _tile_loadd(1, c00 + 16, sc);
        _tile_loadd(2, c00 + 16 * ldc, sc);
        _tile_loadd(3, c00 + 16 * ldc + 16, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, a + m * lda + k, sa);
        _tile_loadd(5, a + (m + 16) * lda + k, sa);
        _tile_loadd(6, b + (k / 2) * ldb + 2 * n, sb);
        _tile_loadd(7, b + (k / 2) * ldb + 2 * (n + 16), sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c00, sc);
      _tile_stored(1, c00 + 16, sc);
      _tile_stored(2, c00 + 16 * ldc, sc);
      _tile_stored(3, c00 + 16 * ldc + 16, sc);
    }
  }
}

__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void pack_float_rows(const float* src, int64_t lds,
                                                                              int64_t rows, int64_t cols,
                                                                              int64_t rows_pad, int64_t ld,
                                                                              uint16_t* dst) {
  for (int64_t r = 0; r < rows_pad; ++r) {
    uint16_t* d = dst + r * ld;
    int64_t c = 0;
    if (r < rows) {
      const float* s = src + r * lds;
      for (; c + 16 <= cols; c += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), reinterpret_cast<const __m256i&>(h));
      }
      if (c < cols) {
        const __mmask16 m = static_cast<__mmask16>((1u << (cols - c)) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + c));
        _mm256_mask_storeu_epi16(d + c, m, reinterpret_cast<const __m256i&>(h));
        c = cols;
      }
    }
    std::memset(d + c, 0, (ld - c) * sizeof(uint16_t));
  }
}

__attribute__((target("avx512f,avx512bw"))) void pack_row_pairs(const uint16_t* src, int64_t rs, int64_t n,
                                                                 int64_t cols, int64_t n_pad, int64_t cols_pad,
                                                                 int64_t ld, uint16_t* dst) {
  // out[2i] = a[i], out[2i + 1] = b[i] for 16 columns at a time (lo: 0..15, hi: 16..31)
  alignas(64) uint16_t idx_lo[32], idx_hi[32];
  for (int i = 0; i < 32; ++i) {
    idx_lo[i] = static_cast<uint16_t>((i % 2 ? 32 : 0) + i / 2);
    idx_hi[i] = static_cast<uint16_t>(idx_lo[i] + 16);
  }
  const __m512i lo = _mm512_load_si512(idx_lo), hi = _mm512_load_si512(idx_hi);
  for (int64_t t = 0; t < n_pad / 2; ++t) {
    uint16_t* d = dst + t * ld;
    const int64_t j = 2 * t;
    if (j + 1 >= n) {  // the last pair is partial or padding
      for (int64_t c = 0; c < cols_pad; ++c) {
        d[2 * c] = (j < n && c < cols) ? src[j * rs + c] : 0;
        d[2 * c + 1] = 0;
      }
      std::memset(d + 2 * cols_pad, 0, (ld - 2 * cols_pad) * sizeof(uint16_t));
      continue;
    }
    const uint16_t* a = src + j * rs;
    const uint16_t* b = a + rs;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
      const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
      _mm512_storeu_si512(d + 2 * c, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(d + 2 * c + 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
    for (; c < cols; ++c) {
      d[2 * c] = a[c];
      d[2 * c + 1] = b[c];
    }
    std::memset(d + 2 * cols, 0, (ld - 2 * cols) * sizeof(uint16_t));
  }
}

bool detect_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
  if (!tile || !bf16) return false;
  // Linux: the tile data state must be requested before first use.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_bf16_usable() {
  static const bool ok = detect_amx();
  return ok;
}

void amx_gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                   int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_tiles(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
}

void amx_pack_float_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, int64_t rows_pad, int64_t ld,
                         uint16_t* dst) {
  pack_float_rows(src, lds, rows, cols, rows_pad, ld, dst);
}

void amx_pack_row_pairs(const uint16_t* src, int64_t rs, int64_t n, int64_t cols, int64_t n_pad, int64_t cols_pad,
                        int64_t ld, uint16_t* dst) {
  pack_row_pairs(src, rs, n, cols, n_pad, cols_pad, ld, dst);
}

#else

bool amx_bf16_usable() { return false; }
void amx_gemm_bf16(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                   bool) {}
void amx_pack_float_rows(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void amx_pack_row_pairs(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}

#endif

}  // namespace cpu
}  // namespace mha_ext
