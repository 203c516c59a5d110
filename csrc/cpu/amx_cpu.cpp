// bfloat16 pair products for the CPU kernels: on the AMX (Advanced Matrix
// Extensions) tile unit, or by AVX512-BF16's vdpbf16ps on CPUs without it
// (gemm_bf16_pairs in gemm_cpu.h), their operand packing, and the decode
// kernel's tile routines (AMX only).
#include "gemm_cpu.h"
#include "rows_avx512.h"

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

// GCC's intrinsics (12 here) declare less memory than the tile instructions
// touch: _tile_loadconfig's operand is the first 8 bytes of the 64-byte
// configuration, so the stores of its shapes may be dropped as dead (a
// one-thread driver that inlined configure_split_tiles faulted on ldtilecfg
// with garbage shapes), and _tile_loadd has no memory operand at all, so
// stores to the rows it reads (a zero-padded tail, P rounded to bfloat16) may
// be moved past it. Hence these two forms: the whole configuration as the
// operand, and tile loads that read memory as far as the compiler knows
// (tests/test_cpu_inlining.py fails on the intrinsics' forms in this file).
inline void load_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }
#define MHA_TILE_LOAD(tile, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tile : : "r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride)) : "memory")

// Every tile 16 rows x 64 bytes: C 16 x 16 float, A 16 rows x 32 bf16, B 16
// pair rows x 16 columns (which tile holds which: each routine's comment).
__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
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
        MHA_TILE_LOAD(0, c00, sc);
        MHA_TILE_LOAD(1, c00 + 16, sc);
        MHA_TILE_LOAD(2, c00 + 16 * ldc, sc);
        MHA_TILE_LOAD(3, c00 + 16 * ldc + 16, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t k = 0; k < K; k += 32) {
        MHA_TILE_LOAD(4, a + m * lda + k, sa);
        MHA_TILE_LOAD(5, a + (m + 16) * lda + k, sa);
        MHA_TILE_LOAD(6, b + (k / 2) * ldb + 2 * n, sb);
        MHA_TILE_LOAD(7, b + (k / 2) * ldb + 2 * (n + 16), sb);
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

// The same product by AVX512-BF16's vdpbf16ps, for CPUs without the tile
// unit: 8 rows x 32 columns of C in 16 registers, a pair of A's row (one
// 32-bit word) broadcast against a pair row of B's 32 columns (two vectors).
// Each C element adds its pair products in ascending k (in vdpbf16ps's order
// within a pair, which row_dots_dp reproduces; not the tile unit's sums).
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void gemm_pairs_dp(
    int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
    int64_t ldc, bool accumulate) {
  constexpr int kRows = 8;
  for (int64_t n = 0; n < N; n += 32) {
    for (int64_t m = 0; m < M; m += kRows) {
      __m512 acc[kRows][2];
      float* c0 = c + m * ldc + n;
      for (int r = 0; r < kRows; ++r) {
        acc[r][0] = accumulate ? _mm512_loadu_ps(c0 + r * ldc) : _mm512_setzero_ps();
        acc[r][1] = accumulate ? _mm512_loadu_ps(c0 + r * ldc + 16) : _mm512_setzero_ps();
      }
      const uint16_t* a0 = a + m * lda;
      const uint16_t* b0 = b + 2 * n;
      for (int64_t t = 0; t < K / 2; ++t) {
        const __m512bh lo = (__m512bh)_mm512_loadu_si512(b0 + t * ldb);
        const __m512bh hi = (__m512bh)_mm512_loadu_si512(b0 + t * ldb + 32);
        for (int r = 0; r < kRows; ++r) {
          int32_t word;
          std::memcpy(&word, a0 + r * lda + 2 * t, sizeof(word));
          const __m512bh x = (__m512bh)_mm512_set1_epi32(word);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, lo);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, hi);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        _mm512_storeu_ps(c0 + r * ldc, acc[r][0]);
        _mm512_storeu_ps(c0 + r * ldc + 16, acc[r][1]);
      }
    }
  }
}

// out[r] = the pair products of rows r of a and b in gemm_pairs_dp's
// arithmetic (one vdpbf16ps a pair, pairs in ascending order from a zero
// sum): 16 rows a vector, one row a lane.
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) void row_dots_dp(
    const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t rows, int64_t n, float* out) {
  constexpr int64_t kWords = 32;  // pairs a pass
  alignas(64) uint32_t wa[kWords * 16], wb[kWords * 16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < n / 2; t0 += kWords) {
      const int64_t nt = std::min(kWords, n / 2 - t0);
      std::memset(wa, 0, sizeof(wa));
      std::memset(wb, 0, sizeof(wb));
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t t = 0; t < nt; ++t) {  // word t0 + t of row r0 + r: pair row t, lane r
          std::memcpy(wa + t * 16 + r, a + (r0 + r) * lda + 2 * (t0 + t), 4);
          std::memcpy(wb + t * 16 + r, b + (r0 + r) * ldb + 2 * (t0 + t), 4);
        }
      for (int64_t t = 0; t < nt; ++t)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_load_si512(wa + t * 16), (__m512bh)_mm512_load_si512(wb + t * 16));
    }
    _mm512_mask_storeu_ps(out + r0, static_cast<__mmask16>((1u << nr) - 1), acc);
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
// address order. Adjacent rows (not in a paged pool, whose next rows are
// another block) are fetched ahead in one of two forms, the better of the two
// for their length, each against the other interleaved in one process (Intel
// Xeon with AMX, 2 threads, bfloat16, 4 and 16 rows a key/value head, 8k keys
// from memory and 2k from the caches):
// - rows of more than 64 columns: the next tile's rows (as many as the call's)
//   into L2, a few lines between the tile products over the whole call, so
//   that memory stays busy while the tile unit works: 1.04-1.19x from memory
//   and 1.04-1.09x from the caches (32 x 8 x 128 heads) against the form below;
//   and each step the next step's lines into L1 (another 1.00-1.06x from
//   memory, 1.06-1.08x from the caches);
// - rows of up to 64 columns: at each step the bytes kFetchAhead on from its
//   rows into L1, all at once (the form above ran 0.90-0.96x from memory and
//   0.95x from the caches with 12 x 12 x 64 heads).
constexpr int64_t kFetchAhead = 4096;
constexpr int64_t kPageAheadColumns = 64;
__attribute__((always_inline)) inline void fetch_ahead(const uint16_t* first, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(first) + kFetchAhead;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}
struct SpreadFetch {
  const char* at = nullptr;
  int64_t left = 0, per = 0;
  // `bytes` from `first` over `calls` calls
  SpreadFetch(const void* first, int64_t bytes, int64_t calls) : at(static_cast<const char*>(first)) {
    left = (bytes + 63) / 64;
    per = (left + calls - 1) / std::max<int64_t>(calls, 1);
  }
  __attribute__((always_inline)) void operator()() {
    for (int64_t x = 0; x < per && left > 0; ++x, --left, at += 64) _mm_prefetch(at, _MM_HINT_T1);
  }
};

// Tiles 0-1 (C: 16 keys x 4 rows' scores), 2-3 (A: 16 key rows), 4-7 (B: Q^T
// pieces of 4 rows) for dot_rows_tiles with at most 4 query rows.
__attribute__((target("amx-tile"))) void configure_narrow_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = t == 2 || t == 3 ? 64 : 16;
  }
  load_config(cfg);
}

// S^T (keys x 16 rows, or 4 rows where R <= 4), 32 keys a step into C tiles 0
// and 1 from their two halves of 16 key rows (tiles 2 and 3; a ragged last
// step from a zero-padded copy: a tile load reads 16 rows), then transposed
// into S's R rows. Q^T's 32-column pieces stay in tiles 4-7 for the call where
// E <= 128, else each is loaded into tile 4 at its piece. fetch: fetch
// adjacent rows ahead (above). With 4 rows (a GQA group of four, one query),
// the narrow tiles and their transposition ran the call 1.04-1.09x faster
// (interleaved, 12 x 12 x 64 and 32 x 8 x 128 heads, 2k and 8k keys).
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void dot_rows_tiles(const uint16_t* q_pairs, int64_t R, int64_t E,
                                                                       const uint16_t* k, int64_t ldk, int64_t n,
                                                                       float* s, int64_t lds, bool fetch) {
  const bool narrow = R <= 4;
  if (narrow) configure_narrow_tiles(); else configure_tiles();
  const bool resident = E <= 128;  // Q^T's pieces in tiles 4-7 for the call
  if (resident) {
    MHA_TILE_LOAD(4, q_pairs, 64);
    if (E > 32) MHA_TILE_LOAD(5, q_pairs + 512, 64);
    if (E > 64) MHA_TILE_LOAD(6, q_pairs + 1024, 64);
    if (E > 96) MHA_TILE_LOAD(7, q_pairs + 1536, 64);
  }
  alignas(64) float st[32 * 16];
  thread_local std::vector<uint16_t> tail;  // a ragged last step's rows, zero-padded to 32
  const int64_t row_bytes = E * 2;
  const bool page = fetch && ldk == E && E <= kPageAheadColumns;
  const bool spread = fetch && ldk == E && !page;
  SpreadFetch next(k + n * ldk, spread ? n * row_bytes : 0, (n + 31) / 32 * ((E + 31) / 32));
  alignas(64) static const int32_t pick[4][16] = {{0, 4, 8, 12, 16, 20, 24, 28}, {1, 5, 9, 13, 17, 21, 25, 29},
                                                  {2, 6, 10, 14, 18, 22, 26, 30}, {3, 7, 11, 15, 19, 23, 27, 31}};
  // S's rows from the step's S^T (nk keys from j0): with at most 4 rows, its
  // two tiles of 16 keys x 4 floats by two permutes and a shuffle a row
  auto to_rows = [&](int64_t j0, int64_t nk) __attribute__((target("avx512f"))) {
    if (!narrow) return transpose(st, 16, nk, 16, s + j0, lds);
    for (int64_t h = 0; h < 2 && 16 * h < nk; ++h) {
      const float* x = st + 64 * h;
      const __m512 z0 = _mm512_load_ps(x), z1 = _mm512_load_ps(x + 16), z2 = _mm512_load_ps(x + 32),
                   z3 = _mm512_load_ps(x + 48);
      const __mmask16 m = rows::lanes(nk - 16 * h);
      for (int64_t r = 0; r < R; ++r) {  // keys 0-7 of row r from z0, z1, keys 8-15 from z2, z3
        const __m512i idx = _mm512_load_si512(pick[r]);
        const __m512 t = _mm512_permutex2var_ps(z0, idx, z1), u = _mm512_permutex2var_ps(z2, idx, z3);
        _mm512_mask_storeu_ps(s + r * lds + j0 + 16 * h, m, _mm512_shuffle_f32x4(t, u, 0x44));
      }
    }
  };
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int64_t nk = std::min<int64_t>(32, n - j0);
    const uint16_t* a = k + j0 * ldk;
    int64_t lda = ldk;
    if (nk < 32) {
      tail.assign(32 * E, 0);
      for (int64_t j = 0; j < nk; ++j) std::memcpy(tail.data() + j * E, a + j * ldk, row_bytes);
      a = tail.data();
      lda = E;
    } else if (page) {
      fetch_ahead(a, 32 * row_bytes);
    }
    const uint16_t* a1 = a + 16 * lda;
    const int64_t sa = lda * 2;
    // (the spread form: the next step's rows into L1 as well, a quarter at each piece where E = 128)
    const bool l1 = spread && j0 + 64 <= n;
    const char* nx = reinterpret_cast<const char*>(k + (j0 + 32) * ldk);
    _tile_zero(0);
    _tile_zero(1);
    // piece i of E's 32-column pieces against Q^T's piece in tile b (4 + i;
    // the tile intrinsics take the number as written)
#define MHA_AMX_KEY_PIECE(i, b)        \
  if (resident && E > 32 * i) {        \
    MHA_TILE_LOAD(2, a + 32 * i, sa);  \
    MHA_TILE_LOAD(3, a1 + 32 * i, sa); \
    _tile_dpbf16ps(0, 2, b);           \
    _tile_dpbf16ps(1, 3, b);           \
    next();                            \
    if (l1) for (int x = 0; x < 32; ++x) _mm_prefetch(nx + (32 * i + x) * 64, _MM_HINT_T0); \
  }
    MHA_AMX_KEY_PIECE(0, 4)
    MHA_AMX_KEY_PIECE(1, 5)
    MHA_AMX_KEY_PIECE(2, 6)
    MHA_AMX_KEY_PIECE(3, 7)
#undef MHA_AMX_KEY_PIECE
    if (!resident) {
      for (int64_t e = 0; e < E; e += 32) {
        MHA_TILE_LOAD(4, q_pairs + e * 16, 64);
        MHA_TILE_LOAD(2, a + e, sa);
        MHA_TILE_LOAD(3, a1 + e, sa);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
        next();
      }
    }
    _tile_stored(0, st, narrow ? 16 : 64);
    _tile_stored(1, st + (narrow ? 64 : 256), narrow ? 16 : 64);
    to_rows(j0, nk);
  }
}

// Tiles 0-3 and 4-5 of R rows (C and A of acc_rows_split), 6-7 of 16 (B).
__attribute__((target("amx-tile"))) void configure_split_tiles(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t < 6 ? R : 16);
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

// O (R rows in the split order) += P V for n keys, 16 keys a step, with V's
// rows as they lie in memory as the B tiles: a B tile of 16 value rows x 32
// columns pairs columns 2c and 2c + 1 of one row where the tile unit pairs
// two rows. So P enters twice, as an A tile with each bfloat16 in the low half
// of its 32-bit pair and zero in the high half (giving the even columns), and
// with the two halves swapped (the odd columns): one buffer of P rounded to
// bfloat16 and held as floats (low half zero) is the latter, read two bytes
// on the former. No value row is repacked; the products double. The split
// order of a 32-column group: its 16 even columns, then its 16 odd ones.
// A value that is not finite in the zero half's column would make 0 x inf a
// NaN in its partner column: a pass (up to 64 columns over the call's keys)
// that leaves any accumulator non-finite is redone by plain loops from the O
// before it (nothing of O is written before the check).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,avx512vl"))) void acc_rows_split(
    const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv, int64_t Ev, float* o,
    int64_t ldo, bool fetch) {
  if (n <= 0 || R <= 0) return;
  const int64_t n16 = (n + 15) / 16 * 16, ldb = n16 + 16;
  thread_local Buffer<float> p_buf, c_buf;
  thread_local Buffer<uint16_t> tail;
  p_buf.resize(R * ldb);
  c_buf.resize(R * 64);
  float* pb = p_buf.data();
  for (int64_t r = 0; r < R; ++r) {
    float* d = pb + r * ldb;
    for (int64_t c = 0; c < n16; c += 16) {
      const __m512 x = _mm512_maskz_loadu_ps(rows::lanes(n - c), p + r * ldp + c);
      const __m256bh h = _mm512_cvtneps_pbh(x);
      _mm512_store_si512(d + c, _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h)), 16));
    }
    _mm512_store_si512(d + n16, _mm512_setzero_si512());
  }
  // a ragged last step's value rows, zero-padded to 16
  const int64_t n_full = n / 16 * 16;
  const uint16_t* v_last = v + n_full * ldv;
  int64_t ldv_last = ldv;
  if (n_full < n) {
    tail.assign(16 * Ev, 0);
    for (int64_t j = n_full; j < n; ++j) std::memcpy(tail.data() + (j - n_full) * Ev, v + j * ldv, Ev * 2);
    v_last = tail.data();
    ldv_last = Ev;
  }
  configure_split_tiles(R);
  const int64_t sp = ldb * 4, row_bytes = Ev * 2;
  float* cs = c_buf.data();
  const bool page = fetch && ldv == Ev && Ev <= kPageAheadColumns;
  const bool spread = fetch && ldv == Ev && !page;
  SpreadFetch next(v + n * ldv, spread ? n * row_bytes : 0, (Ev + 63) / 64 * (n16 / 16) * 2);
  for (int64_t g0 = 0; g0 < Ev; g0 += 64) {
    const bool two = g0 + 64 <= Ev;  // two 32-column groups, else one
    MHA_TILE_LOAD(0, o + g0, ldo * 4);
    MHA_TILE_LOAD(1, o + g0 + 16, ldo * 4);
    if (two) {
      MHA_TILE_LOAD(2, o + g0 + 32, ldo * 4);
      MHA_TILE_LOAD(3, o + g0 + 48, ldo * 4);
    }
    for (int64_t j = 0; j < n16; j += 16) {
      const bool last = j == n_full;
      const uint16_t* vb = last ? v_last : v + j * ldv;
      const int64_t sv = (last ? ldv_last : ldv) * 2;
      if (page && g0 == 0 && !last) fetch_ahead(vb, 16 * row_bytes);
      if (spread && j + 32 <= n_full) {  // the next step's lines of this pass into L1
        const char* nx = reinterpret_cast<const char*>(vb + 16 * ldv + g0);
        for (int r = 0; r < 16; ++r) {
          _mm_prefetch(nx + r * row_bytes, _MM_HINT_T0);
          if (two) _mm_prefetch(nx + r * row_bytes + 64, _MM_HINT_T0);
        }
      }
      next();
      MHA_TILE_LOAD(4, pb + j, sp);                                   // P in the high halves: odd columns
      MHA_TILE_LOAD(5, reinterpret_cast<const char*>(pb + j) + 2, sp);  // in the low halves: even columns
      MHA_TILE_LOAD(6, vb + g0, sv);
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 4, 6);
      next();
      if (two) {
        MHA_TILE_LOAD(7, vb + g0 + 32, sv);
        _tile_dpbf16ps(2, 5, 7);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    _tile_stored(0, cs, 256);
    _tile_stored(1, cs + 16, 256);
    if (two) {
      _tile_stored(2, cs + 32, 256);
      _tile_stored(3, cs + 48, 256);
    }
    const int64_t w = two ? 64 : 32;
    const __m512i exp_bits = _mm512_set1_epi32(0x7f800000);  // all exponent bits set: inf or NaN
    __mmask16 bad = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < w; c += 16)
        bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_load_si512(cs + r * 64 + c), exp_bits), exp_bits);
    if (bad == 0) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < w; c += 16) _mm512_storeu_ps(o + r * ldo + g0 + c, _mm512_load_ps(cs + r * 64 + c));
      continue;
    }
    // (not finite somewhere: the columns of this pass by plain loops, in the split order)
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < w; ++c) {
        const int64_t col = g0 + c / 32 * 32 + (c % 32 < 16 ? 2 * (c % 16) : 2 * (c % 16) + 1);
        float acc = o[r * ldo + g0 + c];
        for (int64_t j = 0; j < n; ++j) {
          uint32_t bits;
          std::memcpy(&bits, pb + r * ldb + j, 4);
          const uint32_t vb = static_cast<uint32_t>(v[j * ldv + col]) << 16;
          float pv, vv;
          std::memcpy(&pv, &bits, 4);
          std::memcpy(&vv, &vb, 4);
          acc += pv * vv;
        }
        o[r * ldo + g0 + c] = acc;
      }
    }
  }
}

// O's rows from the split order of acc_rows_split back to column order.
__attribute__((target("avx512f"))) void unsplit_rows(float* o, int64_t R, int64_t Ev, int64_t ldo) {
  alignas(64) static const int32_t to_0[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t to_1[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i i0 = _mm512_load_si512(to_0), i1 = _mm512_load_si512(to_1);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g + 32 <= Ev; g += 32) {
      float* x = o + r * ldo + g;
      const __m512 ev = _mm512_loadu_ps(x), od = _mm512_loadu_ps(x + 16);
      _mm512_storeu_ps(x, _mm512_permutex2var_ps(ev, i0, od));
      _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(ev, i1, od));
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

void gemm_bf16_pairs(int64_t M, int64_t N, int64_t K, const uint16_t* a, int64_t lda, const uint16_t* b,
                     int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if (active_isa() == Isa::kAmx) return gemm_tiles(M, N, K, a, lda, b, ldb, c, ldc, accumulate);
  gemm_pairs_dp(M, N, K, a, lda, b, ldb, c, ldc, accumulate);  // (Isa::kAvx512Bf16)
}

bool row_dots_bf16_pairs(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t rows, int64_t n,
                         float* out) {
  if (active_isa() != Isa::kAvx512Bf16) return false;
  row_dots_dp(a, lda, b, ldb, rows, n, out);
  return true;
}

void pack_bf16_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, int64_t rows_pad, int64_t ld,
                         uint16_t* dst) {
  pack_float_rows(src, lds, rows, cols, rows_pad, ld, dst);
}

void pack_row_pairs_bf16(const uint16_t* src, int64_t rs, int64_t n, int64_t cols, int64_t n_pad, int64_t cols_pad,
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

bool amx_dot_rows_bf16(const uint16_t* q_pairs, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n,
                       float* s, int64_t lds, bool fetch) {
  if (active_isa() != Isa::kAmx || E % 32 != 0 || E > 256 || R > 16) return false;
  dot_rows_tiles(q_pairs, R, E, k, ldk, n, s, lds, fetch);
  return true;
}

bool amx_acc_rows_bf16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv,
                       int64_t Ev, float* o, int64_t ldo, bool fetch) {
  if (active_isa() != Isa::kAmx || Ev % 32 != 0 || Ev > 256 || R > 16) return false;
  acc_rows_split(p, R, n, ldp, v, ldv, Ev, o, ldo, fetch);
  return true;
}

void amx_unsplit_rows(float* o, int64_t R, int64_t Ev, int64_t ldo) { unsplit_rows(o, R, Ev, ldo); }

namespace {
__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }
}  // namespace

void amx_release() {
  if (amx_bf16_usable()) release_tiles();
}

#else

bool amx_bf16_usable() { return false; }
void gemm_bf16_pairs(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                     bool) {}
bool row_dots_bf16_pairs(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t, float*) {
  return false;
}
void pack_bf16_rows(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void pack_row_pairs_bf16(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void amx_pack_query_pairs(const uint16_t*, int64_t, int64_t, uint16_t*) {}
bool amx_dot_rows_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                       bool) {
  return false;
}
bool amx_acc_rows_bf16(const float*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t,
                       bool) {
  return false;
}
void amx_unsplit_rows(float*, int64_t, int64_t, int64_t) {}
void amx_release() {}

#endif

}  // namespace cpu
}  // namespace mha_ext
