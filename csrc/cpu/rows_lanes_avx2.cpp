// The decode scores of 16 query rows at a time on AVX2 (a GQA group of 4
// heads x 4 query rows, say), one query row a vector lane: two vectors of 8
// rows a key, each broadcast key element feeding both (on Zen 1 a broadcast
// takes a vector-pipe slot as a multiply-add does: one broadcast a
// multiply-add ran at 0.61 of the multiply-add rate in L1, one for two at
// 0.96). Every lane of every multiply-add is a product that counts: no
// horizontal sums (score_block spends 22 instructions on each 8 sums), and
// each key row is read once for the 16 rows, not once per 4. The sums are
// turned into rows by a 4 x 8 transpose a block as they are stored. Against
// score_block's passes of 4 rows (AMD EPYC of family 23, interleaved): the
// scores 1.21-1.47x in the caches and 1.14-1.46x from memory
// (bench/decode_rows.cpp, 64 and 128 columns, every kind); whole decode steps
// of the op 1.00-1.09x with 16 rows of 32 x 8 x 128 heads, 1.13-1.24x of
// 16 x 4 x 64 (float32 and bfloat16, 2k-32k keys).
// The AVX-512 twin is rows_lanes_cpu.cpp (16 rows a 512-bit vector).
#include "rows_avx2.h"

#include "rows_avx512.h"  // (the fetches: PageFetch, fetch_rows_l2)
#include "x86_intrinsics.h"

#if MHA_X86
#include <algorithm>
#include <cstring>
#include <vector>

namespace mha_ext {
namespace cpu {
namespace avx2 {
namespace {

constexpr int kKeys = 4;  // keys a block: 2 x 4 sums in registers, 2 query vectors, a broadcast

// a[i] (key i, lane r: row r's score) stored as rows: row r's kKeys scores
// at s + r lds (rows 0-7 of a[]), by unpacks and in-lane shuffles only (the
// 128-bit halves stored apart rather than crossed).
MHA_AVX2_INLINE void store_as_rows(const __m256* a, float* s, int64_t lds) {
  const __m256 t0 = _mm256_unpacklo_ps(a[0], a[1]), t1 = _mm256_unpackhi_ps(a[0], a[1]);
  const __m256 t2 = _mm256_unpacklo_ps(a[2], a[3]), t3 = _mm256_unpackhi_ps(a[2], a[3]);
  // u[m]: row m's 4 scores in the low half, row 4 + m's in the high half
  const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    _mm_storeu_ps(s + m * lds, _mm256_castps256_ps128(u[m]));
    _mm_storeu_ps(s + (4 + m) * lds, _mm256_extractf128_ps(u[m], 1));
  }
}

// Column e of a widened bfloat16 row (widen_row) is column pair_order(e) of
// the row: in each whole 16 the even columns, then the odd ones.
inline int64_t pair_order(int64_t e, int64_t E) {
  if (e >= E / 16 * 16) return e;
  const int64_t i = e % 16;
  return e - i + (i < 8 ? 2 * i : 2 * (i - 8) + 1);
}

// E columns of a 16-bit key row as floats: bfloat16 16 columns a load as
// even and odd columns (a shift and an and: pair_order), float16 by F16C.
MHA_AVX2_INLINE void widen_row(const uint16_t* row, int64_t E, bool bf16, float* out) {
  int64_t e = 0;
  if (bf16) {
    for (; e + 16 <= E; e += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + e));
      _mm256_storeu_ps(out + e, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
      _mm256_storeu_ps(out + e + 8,
                       _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))));
    }
    for (; e < E; ++e) {
      const uint32_t bits = static_cast<uint32_t>(row[e]) << 16;
      std::memcpy(out + e, &bits, 4);
    }
    return;
  }
  for (; e + 8 <= E; e += 8)
    _mm256_storeu_ps(out + e, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + e))));
  for (; e < E; ++e) out[e] = _cvtsh_ss(row[e]);
}

// Column e of a block (lane_block): two query vectors, a broadcast of each key's element.
MHA_AVX2_INLINE void lane_column(const float* qt, const float* const* kr, int64_t e, __m256* lo, __m256* hi) {
  const __m256 q0 = _mm256_loadu_ps(qt + 16 * e), q1 = _mm256_loadu_ps(qt + 16 * e + 8);
#pragma GCC unroll 4
  for (int i = 0; i < kKeys; ++i) {
    const __m256 b = _mm256_broadcast_ss(kr[i] + e);
    lo[i] = _mm256_fmadd_ps(b, q0, lo[i]);
    hi[i] = _mm256_fmadd_ps(b, q1, hi[i]);
  }
}

// S (16 rows, lds) for the keys [0, kKeys) of rows kr[0..3]: qt holds the 16
// query rows transposed (column e of the 16 at qt + 16 e); each lane sums
// its row's products in column order. With kStep > 0 one line from `fetch`
// on is fetched into L1 every kStep columns (the block's kKeys E elem bytes
// spread over its E columns: kStep = 64 / (kKeys elem)), on a fixed schedule
// unrolled kStep columns at a time. Against a test at every column for the
// next line's place, interleaved (AMD EPYC of family 25, Zen 3, 2 threads,
// bit-identical): the scores of 16 rows of 128 columns 1.25x in L2 and
// 1.02-1.39x from memory (bench/decode_rows.cpp, run to run), of 64 columns
// 1.08x; whole decode steps of the op with 16 rows a key/value head
// 0.97-1.06x (float32 0.97-1.05, bfloat16 and float16 1.06).
template <int kStep>
MHA_AVX2_INLINE void lane_block(const float* qt, int64_t E, const float* const* kr, float* s, int64_t lds,
                                const char* fetch) {
  __m256 lo[kKeys], hi[kKeys];  // key i: rows 0-7, rows 8-15
#pragma GCC unroll 4
  for (int i = 0; i < kKeys; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t e = 0;
  if constexpr (kStep > 0) {
    for (; e + kStep <= E; e += kStep, fetch += 64) {
      _mm_prefetch(fetch, _MM_HINT_T0);
#pragma GCC unroll 8
      for (int c = 0; c < kStep; ++c) lane_column(qt, kr, e + c, lo, hi);
    }
  }
  for (; e < E; ++e) lane_column(qt, kr, e, lo, hi);
  store_as_rows(lo, s, lds);
  store_as_rows(hi, s + 8 * lds, lds);
}
}  // namespace

MHA_AVX2 int64_t dot_rows_lanes(const float* q, int64_t R, int64_t E, const void* k, RowKind kind, int64_t ldk,
                                int64_t n, float* s, int64_t lds, bool far_fetch) {
  const int64_t groups = R / 16;
  if (groups == 0 || E == 0) return 0;
  const int64_t elem = kind == RowKind::kFloat ? 4 : 2, row_bytes = E * elem;
  const bool adjacent = ldk == E;
  thread_local std::vector<float> qt, widened;
  qt.resize(static_cast<size_t>(16 * E));
  if (kind != RowKind::kFloat) widened.resize(static_cast<size_t>(kKeys * E));
  const char* kb = static_cast<const char*>(k);
  for (int64_t g = 0; g < groups; ++g) {
    const float* qg = q + g * 16 * E;
    const bool pairs = kind == RowKind::kBf16;  // (Q's columns in widen_row's order)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t from = pairs ? pair_order(e, E) : e;
      for (int64_t r = 0; r < 16; ++r) qt[16 * e + r] = qg[r * E + from];
    }
    float* sg = s + g * 16 * lds;
    // The first group reads the keys from memory (the others find them in
    // the caches): adjacent rows have each block's bytes a page on fetched
    // into L1 over its columns (lane_block; against all at the block's
    // start, from memory: 16 float32 rows of 128 columns 1.09-1.10x, of 64
    // 1.00x, bfloat16 0.99-1.03x; with the far fetch into L2 as well,
    // bfloat16 0.98-1.00x: none); strided rows (a (B, S, H, D) cache) the
    // next 16 rows into L2 before each 16, and with far_fetch each row
    // kFarRows keys on (PageFetch).
    const bool fetch = g == 0;
    rows::PageFetch strided = rows::PageFetch::strided(fetch && far_fetch, ldk * elem, row_bytes);
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, n - c0);
      const char* kc = kb + c0 * ldk * elem;
      if (!adjacent && fetch)
        rows::fetch_rows_l2(kc + 16 * ldk * elem, ldk * elem, std::clamp<int64_t>(n - c0 - 16, 0, 16), row_bytes);
      for (int64_t k0 = 0; k0 < nc; k0 += kKeys) {
        const int64_t m = std::min<int64_t>(kKeys, nc - k0);
        const char* ahead = adjacent && fetch ? kc + k0 * row_bytes + rows::kFetchAhead : nullptr;
        const float* kr[kKeys];  // keys past m repeat the last real one (read, never stored)
        for (int i = 0; i < kKeys; ++i) {
          const char* row = kc + std::min<int64_t>(k0 + i, nc - 1) * ldk * elem;
          if (!adjacent && fetch && i < m) strided(row);
          if (kind == RowKind::kFloat) {
            kr[i] = reinterpret_cast<const float*>(row);
          } else {
            if (i < m)
              widen_row(reinterpret_cast<const uint16_t*>(row), E, kind == RowKind::kBf16, widened.data() + i * E);
            kr[i] = widened.data() + std::min<int64_t>(i, m - 1) * E;
          }
        }
        float* out = sg + c0 + k0;
        alignas(16) float t[16 * kKeys];
        float* to = m == kKeys ? out : t;
        const int64_t ld = m == kKeys ? lds : kKeys;
        if (ahead == nullptr)
          lane_block<0>(qt.data(), E, kr, to, ld, nullptr);
        else if (elem == 4)
          lane_block<64 / (4 * kKeys)>(qt.data(), E, kr, to, ld, ahead);
        else
          lane_block<64 / (2 * kKeys)>(qt.data(), E, kr, to, ld, ahead);
        if (m < kKeys) {
          for (int64_t r = 0; r < 16; ++r) std::copy(t + r * kKeys, t + r * kKeys + m, out + r * lds);
        }
      }
    }
  }
  return groups * 16;
}

}  // namespace avx2
}  // namespace cpu
}  // namespace mha_ext
#endif  // MHA_X86
