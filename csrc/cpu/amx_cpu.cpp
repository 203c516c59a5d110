// AMX (Advanced Matrix Extensions) bfloat16 tile products for the CPU
// kernels: see amx_gemm_bf16 in gemm_cpu.h.
#include "gemm_cpu.h"

#include <algorithm>
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

// Every tile 16 rows x 64 bytes: C 16 x 16 float, A 16 rows x 32 bf16, B 16
// pair rows x 16 columns (which tile holds which: each routine's comment).
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

// The decode kernel's products on the tile unit (amx_dot_rows_bf16 and
// amx_acc_rows_bf16 in gemm_cpu.h). Rows of K and V are read in place, in
// address order; at each step the bytes kFetchAhead on from its rows are
// fetched into L1, all at once (spread over the step, or the next step's
// rows, or into L2 further on, each ran 0.94-0.98x as fast).
constexpr int64_t kFetchAhead = 4096;
__attribute__((always_inline)) inline void fetch_ahead(const uint16_t* first, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(first) + kFetchAhead;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// S^T (keys x 16 rows), 32 keys a step into C tiles 0 and 1 from their two
// halves of 16 key rows (tiles 2 and 3; a ragged last step from a
// zero-padded copy: a tile load reads 16 rows), then transposed into S.
// Q^T's 32-column pieces stay in tiles 4-7 for the call where E <= 128, else
// each is loaded into tile 4 at its piece. fetch: the page-ahead fetch of
// adjacent rows (not in a paged pool, whose next page is another block).
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void dot_rows_tiles(const uint16_t* q_pairs, int64_t E,
                                                                       const uint16_t* k, int64_t ldk, int64_t n,
                                                                       float* s, int64_t lds, bool fetch) {
  configure_tiles();
  const bool resident = E <= 128;  // Q^T's pieces in tiles 4-7 for the call
  if (resident) {
    _tile_loadd(4, q_pairs, 64);
    if (E > 32) _tile_loadd(5, q_pairs + 512, 64);
    if (E > 64) _tile_loadd(6, q_pairs + 1024, 64);
    if (E > 96) _tile_loadd(7, q_pairs + 1536, 64);
  }
  alignas(64) float st[32 * 16];
  thread_local std::vector<uint16_t> tail;  // a ragged last step's rows, zero-padded to 32
  const int64_t row_bytes = E * 2;
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t nk = std::min<int64_t>(32, n - j0);
    const uint16_t* a = k + j0 * ldk;
    int64_t lda = ldk;
    if (nk < 32) {
      tail.assign(32 * E, 0);
      for (int64_t j = 0; j < nk; ++j) std::memcpy(tail.data() + j * E, a + j * ldk, row_bytes);
      a = tail.data();
      lda = E;
    } else if (fetch && ldk == E) {
      fetch_ahead(a, 32 * row_bytes);
    }
    const uint16_t* a1 = a + 16 * lda;
    const int64_t sa = lda * 2;
    _tile_zero(0);
    _tile_zero(1);
    // piece i of E's 32-column pieces against Q^T's piece in tile b (4 + i;
    // the tile intrinsics take the number as written)
#define MHA_AMX_KEY_PIECE(i, b)              \
  if (resident && E > 32 * i) {              \
    _tile_loadd(2, a + 32 * i, sa);          \
    _tile_loadd(3, a1 + 32 * i, sa);         \
    _tile_dpbf16ps(0, 2, b);                 \
    _tile_dpbf16ps(1, 3, b);                 \
  }
    MHA_AMX_KEY_PIECE(0, 4)
    MHA_AMX_KEY_PIECE(1, 5)
    MHA_AMX_KEY_PIECE(2, 6)
    MHA_AMX_KEY_PIECE(3, 7)
#undef MHA_AMX_KEY_PIECE
    if (!resident) {
      for (int64_t e = 0; e < E; e += 32) {
        _tile_loadd(4, q_pairs + e * 16, 64);
        _tile_loadd(2, a + e, sa);
        _tile_loadd(3, a1 + e, sa);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, st, 64);
    _tile_stored(1, st + 256, 64);
    transpose(st, 16, nk, 16, s + j0, lds);
  }
}

// Step j0 of acc_rows_tiles (64 keys from j0): P's two 32-key pieces
// rounded to bfloat16 into a, V's rows as 32 pair rows into pairs.
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void pack_values(
    const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv, int64_t Ev, int64_t j0,
    bool fetch, uint16_t (*a)[16 * 32], uint16_t* pairs) {
  const int64_t row_bytes = Ev * 2, pair_ld = 2 * Ev;
  const int64_t nk = std::min<int64_t>(64, n - j0);
  if (fetch && ldv == Ev && nk == 64) fetch_ahead(v + j0 * ldv, nk * row_bytes);
  for (int64_t h = 0; h < (nk + 31) / 32; ++h) {
    const int64_t jb = j0 + 32 * h, nh = std::min<int64_t>(32, n - jb);
    pack_float_rows(p + jb, ldp, R, nh, 16, 32, a[h]);
    for (int64_t t = 0; t < 16; ++t) {
      const uint16_t* va = v + (jb + 2 * t) * ldv;
      uint16_t* d = pairs + (h * 16 + t) * pair_ld;
      const bool has_a = 2 * t < nh, has_b = 2 * t + 1 < nh;
      for (int64_t g = 0; g < Ev; g += 32) {
        const __m512i x = has_a ? _mm512_loadu_si512(va + g) : _mm512_setzero_si512();
        const __m512i y = has_b ? _mm512_loadu_si512(va + ldv + g) : _mm512_setzero_si512();
        _mm512_store_si512(d + 2 * g, _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(d + 2 * g + 32, _mm512_unpackhi_epi16(x, y));
      }
    }
  }
}

// O (16 rows, in a C buffer) += P V, 64 keys a step: P's rows rounded to
// bfloat16 (two 32-key A pieces), V's 64 rows as 32 pair rows; the C
// buffer's 16-column pieces four at a time in tiles 0-3 over the step (A in
// tile 4, V's pieces in tiles 5-7 in turn), each loaded and stored once a
// step. Pair rows come from vpunpck{l,h}wd, which interleaves within each
// 128-bit lane: a 32-column group's "lo" piece holds columns 0-3, 8-11,
// 16-19, 24-27 and its "hi" piece 4-7, 12-15, 20-23, 28-31, and the C buffer
// keeps that order (from O and back by a permutation at the call's ends).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void acc_rows_tiles(
    const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv, int64_t Ev, float* o,
    int64_t ldo, bool fetch) {
  configure_tiles();
  // the C buffer (16 x Ev) and two steps of 32 pair rows (2 Ev each), per thread
  thread_local Buffer<float> c_buf;
  thread_local Buffer<uint16_t> pair_buf;
  c_buf.resize(16 * Ev);
  pair_buf.resize(2 * 32 * 2 * Ev);
  float* c = c_buf.data();
  uint16_t* pairs = pair_buf.data();
  alignas(64) uint16_t a[2][2][16 * 32];
  alignas(64) static const int32_t to_lo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  alignas(64) static const int32_t to_hi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  alignas(64) static const int32_t from_0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t from_1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i ilo = _mm512_load_si512(to_lo), ihi = _mm512_load_si512(to_hi);
  for (int64_t r = 0; r < 16; ++r) {
    for (int64_t g = 0; g < Ev; g += 32) {
      __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
      if (r < R) x0 = _mm512_loadu_ps(o + r * ldo + g), x1 = _mm512_loadu_ps(o + r * ldo + g + 16);
      _mm512_store_ps(c + r * Ev + g, _mm512_permutex2var_ps(x0, ilo, x1));
      _mm512_store_ps(c + r * Ev + g + 16, _mm512_permutex2var_ps(x0, ihi, x1));
    }
  }
  const int64_t sc = Ev * 4, pair_ld = 2 * Ev;
  // step i's P and V pieces into buffer i % 2 (written a step before the
  // tile unit reads them: a tile load of bytes just stored by vector
  // stores waited for them, about 15 ns a tile here)
  const int64_t step_pairs = 32 * pair_ld;  // a step's pair rows
  pack_values(p, R, n, ldp, v, ldv, Ev, 0, fetch, a[0], pairs);
  for (int64_t j0 = 0, step = 0; j0 < n; j0 += 64, ++step) {
    if (j0 + 64 < n)
      pack_values(p, R, n, ldp, v, ldv, Ev, j0 + 64, fetch, a[(step + 1) % 2], pairs + (step + 1) % 2 * step_pairs);
    const int64_t pieces = (std::min<int64_t>(64, n - j0) + 31) / 32, buf = step % 2;
    for (int64_t t = 0; t < Ev; t += 64) {
      const int64_t nt = std::min<int64_t>(4, (Ev - t) / 16);
      float* ct = c + t;
      _tile_loadd(0, ct, sc);
      if (nt > 1) _tile_loadd(1, ct + 16, sc);
      if (nt > 2) _tile_loadd(2, ct + 32, sc);
      if (nt > 3) _tile_loadd(3, ct + 48, sc);
      for (int64_t h = 0; h < pieces; ++h) {
        const uint16_t* b = pairs + buf * step_pairs + h * 16 * pair_ld + 2 * t;
        _tile_loadd(4, a[buf][h], 64);
        _tile_loadd(5, b, sc);
        _tile_dpbf16ps(0, 4, 5);
        if (nt > 1) {
          _tile_loadd(6, b + 32, sc);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (nt > 2) {
          _tile_loadd(7, b + 64, sc);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (nt > 3) {
          _tile_loadd(5, b + 96, sc);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, ct, sc);
      if (nt > 1) _tile_stored(1, ct + 16, sc);
      if (nt > 2) _tile_stored(2, ct + 32, sc);
      if (nt > 3) _tile_stored(3, ct + 48, sc);
    }
  }
  const __m512i i0 = _mm512_load_si512(from_0), i1 = _mm512_load_si512(from_1);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g < Ev; g += 32) {
      const __m512 lo = _mm512_load_ps(c + r * Ev + g), hi = _mm512_load_ps(c + r * Ev + g + 16);
      _mm512_storeu_ps(o + r * ldo + g, _mm512_permutex2var_ps(lo, i0, hi));
      _mm512_storeu_ps(o + r * ldo + g + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
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

void amx_pack_query_pairs(const uint16_t* q, int64_t R, int64_t E, uint16_t* dst) {
  if (R > 16) return;  // (the decode kernel's rows a head: at most 16)
  // a pair q[r][2t], q[r][2t + 1] is one 32-bit word: (R x E / 2 words)^T, as
  // floats (the transpose moves their bits unchanged)
  if (R < 16) std::memset(dst, 0, E * 16 * sizeof(uint16_t));
  transpose(reinterpret_cast<const float*>(q), E / 2, R, E / 2, reinterpret_cast<float*>(dst), 16);
}

bool amx_dot_rows_bf16(const uint16_t* q_pairs, int64_t E, const uint16_t* k, int64_t ldk, int64_t n, float* s,
                       int64_t lds, bool fetch) {
  if (active_isa() != Isa::kAmx || E % 32 != 0 || E > 256) return false;
  dot_rows_tiles(q_pairs, E, k, ldk, n, s, lds, fetch);
  return true;
}

bool amx_acc_rows_bf16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv,
                       int64_t Ev, float* o, int64_t ldo, bool fetch) {
  if (active_isa() != Isa::kAmx || Ev % 32 != 0 || Ev > 256 || R > 16) return false;
  acc_rows_tiles(p, R, n, ldp, v, ldv, Ev, o, ldo, fetch);
  return true;
}

#else

bool amx_bf16_usable() { return false; }
void amx_gemm_bf16(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                   bool) {}
void amx_pack_float_rows(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void amx_pack_row_pairs(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void amx_pack_query_pairs(const uint16_t*, int64_t, int64_t, uint16_t*) {}
bool amx_dot_rows_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t, bool) {
  return false;
}
bool amx_acc_rows_bf16(const float*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                       bool) {
  return false;
}

#endif

}  // namespace cpu
}  // namespace mha_ext
