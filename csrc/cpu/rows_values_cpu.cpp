// Row primitives of the decode kernel (decode_cpu.cpp), the P V side: O +=
// P V for a few query rows, each value row read whole and in address order
// (bfloat16 / float16 rows widened in registers, or bfloat16 pairs on
// AVX512-BF16), on the run-time instruction-set choice of gemm_cpu.h; groups
// of 16 rows go to rows_lanes_cpu.cpp. The scores are in rows_cpu.cpp.
#include "gemm_cpu.h"

#include "rows_avx2.h"
#include "rows_avx512.h"
#include "x86_intrinsics.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace mha_ext {
namespace cpu {
namespace {
#if MHA_X86
using namespace rows;  // PageFetch, the fetches into L2, lanes, kValueKeys (rows_avx512.h)

// Columns 32 h .. 32 h + 31 of a value row as floats in w[0], w[1], the
// lanes of each register given by m: float32 loaded, bfloat16 / float16
// widened (bfloat16 by pairs of columns: the even ones shifted up, the odd
// ones masked, one instruction for 16 columns; the even columns land in w[0]
// and the odd ones in w[1], interleaved back on the way out).
template <int kKind>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void value_pair(const void* row, int h,
                                                                                         const __mmask16* m, __m512* w) {
  if constexpr (kKind == 0) {
    const float* f = static_cast<const float*>(row) + 32 * h;
    w[0] = _mm512_maskz_loadu_ps(m[0], f);
    w[1] = _mm512_maskz_loadu_ps(m[1], f + 16);
  } else {
    const uint16_t* u = static_cast<const uint16_t*>(row) + 32 * h;
    const __m512i b = _mm512_maskz_loadu_epi16(__mmask32(m[0]) | __mmask32(m[1]) << 16, u);
    if constexpr (kKind == 1) {
      w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
      w[1] = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    } else {
      w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(b));
      w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(b, 1));
    }
  }
}

// O (RB rows from o, ldo) += P (RB x nj, ldp) V (nj rows of v, ldv) over 32 NP
// columns (cols real), RB NP <= 8: the RB x 32 NP sums in up to 16
// registers, each in j order, added to O at the end. Each value row is read
// whole (up to 32 NP columns), in address order, as key rows are (key_dot).
// Rows past rr repeat the last real one (computed, never stored). The same
// columns of the first n_ahead rows of the next chunk (kValueKeys rows on)
// are fetched into L2 (fetch_row_l2) where kFetch (as score_block); `page`,
// the page-ahead fetch at each key.
template <int kKind, int RB, int NP, bool kFetch>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void value_block_e(
    const float* p, int64_t ldp, int64_t rr, int64_t nj, const char* v, int64_t ldv_bytes, int64_t cols, float* o,
    int64_t ldo, int64_t n_ahead, const PageFetch& page_in) {
  PageFetch page = page_in;  // (a local: its count and place stay in registers)
  const float* pr[RB];
  for (int r = 0; r < RB; ++r) pr[r] = p + std::min<int64_t>(r, rr - 1) * ldp;
  __m512 acc[RB][2 * NP];
  for (int r = 0; r < RB; ++r)
    for (int x = 0; x < 2 * NP; ++x) acc[r][x] = _mm512_setzero_ps();
  __mmask16 mk[2 * NP];  // the real columns of each register
  for (int x = 0; x < 2 * NP; ++x) mk[x] = lanes(cols - 16 * x);
  for (int64_t j = 0; j < nj; ++j) {
    page(v + j * ldv_bytes);
    if constexpr (kFetch)
      if (j < n_ahead) fetch_row_l2(v + (j + kValueKeys) * ldv_bytes, cols * (kKind == 0 ? 4 : 2));
    __m512 pb[RB];
    for (int r = 0; r < RB; ++r) pb[r] = _mm512_set1_ps(pr[r][j]);
    for (int h = 0; h < NP; ++h) {
      __m512 w[2];
      value_pair<kKind>(v + j * ldv_bytes, h, mk + 2 * h, w);
      for (int r = 0; r < RB; ++r)
        for (int x = 0; x < 2; ++x) acc[r][2 * h + x] = _mm512_fmadd_ps(pb[r], w[x], acc[r][2 * h + x]);
    }
  }
  // (no branch on rr: rows past it store under an empty mask, so that acc is
  // indexed by constants and stays in registers)
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __mmask16 row = r < rr ? __mmask16(0xFFFF) : __mmask16(0);
#pragma GCC unroll 8
    for (int h = 0; h < NP; ++h) {  // 32 columns at a time
      __m512 lo = acc[r][2 * h], hi = acc[r][2 * h + 1];
      if constexpr (kKind == 1) {  // even / odd columns back to 0 .. 15 and 16 .. 31
        const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i ih = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        const __m512 even = lo;
        lo = _mm512_permutex2var_ps(even, il, hi);
        hi = _mm512_permutex2var_ps(even, ih, hi);
      }
      const __mmask16 ml = mk[2 * h] & row, mh = mk[2 * h + 1] & row;
      float* oc = o + std::min<int64_t>(r, rr - 1) * ldo + 32 * h;
      _mm512_mask_storeu_ps(oc, ml, _mm512_add_ps(_mm512_maskz_loadu_ps(ml, oc), lo));
      _mm512_mask_storeu_ps(oc + 16, mh, _mm512_add_ps(_mm512_maskz_loadu_ps(mh, oc + 16), hi));
    }
  }
}

// value_block_e with the columns and the page-ahead fetch as constants
// where the rows fill the 32 NP columns (as score_block; 1.01-1.05x on top
// of the scores' constant forms, one row of 12 x 64 heads, 2k keys in the
// caches)
template <int kKind, int RB, int NP, bool kFetch = false>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void value_block(const float* p, int64_t ldp, int64_t rr,
                                                                    int64_t nj, const char* v, int64_t ldv_bytes,
                                                                    int64_t cols, float* o, int64_t ldo,
                                                                    int64_t n_ahead, const PageFetch& page) {
  auto fixed = [&](const PageFetch& pg) __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) {
    value_block_e<kKind, RB, NP, kFetch>(p, ldp, rr, nj, v, ldv_bytes, 32 * NP, o, ldo, n_ahead, pg);
  };
  if (cols == 32 * NP && rows::with_fixed_page(page, 32 * NP * (kKind == 0 ? 4 : 2), fixed)) return;
  value_block_e<kKind, RB, NP, kFetch>(p, ldp, rr, nj, v, ldv_bytes, cols, o, ldo, n_ahead, page);
}

// value_block for bfloat16 value rows on AVX512-BF16 (kind 3): P rounded to
// bfloat16 (as the AMX path and torch's reduced-precision P V round it) and
// two keys an instruction, vdpbf16ps adding P[j] v[j][c] + P[j + 1] v[j + 1][c]
// to each float sum: half the multiply-add instructions of the widened rows,
// and no widening (four query rows of a 4-head GQA group are compute-bound).
// Rows j and j + 1 are interleaved by 16-bit unpacks, which work within
// 128-bit lanes: the low unpack holds columns 8 L .. 8 L + 3 of lane L, the
// high one 8 L + 4 .. 8 L + 7, sorted back on the way out. An odd last key
// pairs with a zero row, never read. Same signature as value_block.
template <int RB, int NP, bool kFetch = false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void value_block_dp(
    const float* p, int64_t ldp, int64_t rr, int64_t nj, const char* v, int64_t ldv_bytes, int64_t cols, float* o,
    int64_t ldo, int64_t n_ahead, const PageFetch& page_in) {
  PageFetch page = page_in;  // (a local: its count and place stay in registers)
  alignas(64) uint16_t pb[RB][kValueKeys];  // P rows in bfloat16, zero past nj
  for (int r = 0; r < RB; ++r) {
    const float* pr = p + std::min<int64_t>(r, rr - 1) * ldp;
    const __m512 lo = _mm512_maskz_loadu_ps(lanes(nj), pr), hi = _mm512_maskz_loadu_ps(lanes(nj - 16), pr + 16);
    _mm512_store_si512(pb[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  __m512 acc[RB][2 * NP];
  for (int r = 0; r < RB; ++r)
    for (int x = 0; x < 2 * NP; ++x) acc[r][x] = _mm512_setzero_ps();
  __mmask32 mc[NP];  // the real columns of each 32
  for (int h = 0; h < NP; ++h) mc[h] = lanes32(cols - 32 * h);
  for (int64_t j = 0; j < nj; j += 2) {
    const uint16_t* v0 = reinterpret_cast<const uint16_t*>(v + j * ldv_bytes);
    const uint16_t* v1 = reinterpret_cast<const uint16_t*>(v + (j + 1) * ldv_bytes);
    const bool two = j + 1 < nj;
    page(v0);
    if (two) page(v1);
    if constexpr (kFetch)
      for (int64_t x = j; x < j + 2 && x < n_ahead; ++x) fetch_row_l2(v + (x + kValueKeys) * ldv_bytes, cols * 2);
    __m512i pw[RB];  // (P[j], P[j + 1]) of row r in every 32-bit lane
    for (int r = 0; r < RB; ++r) {
      int32_t w;
      std::memcpy(&w, pb[r] + j, sizeof(w));
      pw[r] = _mm512_set1_epi32(w);
    }
    for (int h = 0; h < NP; ++h) {
      const __m512i a = _mm512_maskz_loadu_epi16(mc[h], v0 + 32 * h);
      const __m512i b = two ? _mm512_maskz_loadu_epi16(mc[h], v1 + 32 * h) : _mm512_setzero_si512();
      const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
      const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
      for (int r = 0; r < RB; ++r) {
        acc[r][2 * h] = _mm512_dpbf16_ps(acc[r][2 * h], lo, reinterpret_cast<__m512bh>(pw[r]));
        acc[r][2 * h + 1] = _mm512_dpbf16_ps(acc[r][2 * h + 1], hi, reinterpret_cast<__m512bh>(pw[r]));
      }
    }
  }
  // columns back in order: c of the first 16 from lane 4 (c / 8) + c % 4 of
  // the low (c % 8 < 4) or the high unpack; the next 16 likewise
  alignas(64) static const int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t kSecond[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __mmask16 row = r < rr ? __mmask16(0xFFFF) : __mmask16(0);
#pragma GCC unroll 8
    for (int h = 0; h < NP; ++h) {
      const __m512 lo = _mm512_permutex2var_ps(acc[r][2 * h], first, acc[r][2 * h + 1]);
      const __m512 hi = _mm512_permutex2var_ps(acc[r][2 * h], second, acc[r][2 * h + 1]);
      const __mmask16 ml = lanes(cols - 32 * h) & row, mh = lanes(cols - 32 * h - 16) & row;
      float* oc = o + std::min<int64_t>(r, rr - 1) * ldo + 32 * h;
      _mm512_mask_storeu_ps(oc, ml, _mm512_add_ps(_mm512_maskz_loadu_ps(ml, oc), lo));
      _mm512_mask_storeu_ps(oc + 16, mh, _mm512_add_ps(_mm512_maskz_loadu_ps(mh, oc + 16), hi));
    }
  }
}

// value_block, or for kind 3 value_block_dp where it serves several rows (one
// row a pass spends as much on pairing the value rows as it saves: 0.89-0.98x
// with one query row a head, 12 x 64 heads)
template <int kKind, int RB, int NP, bool kFetch = false>
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline void value_rows(
    const float* p, int64_t ldp, int64_t rr, int64_t nj, const char* v, int64_t ldv_bytes, int64_t cols, float* o,
    int64_t ldo, int64_t n_ahead, const PageFetch& page) {
  if constexpr (kKind == 3 && RB > 1)
    value_block_dp<RB, NP, kFetch>(p, ldp, rr, nj, v, ldv_bytes, cols, o, ldo, n_ahead, page);
  else
    value_block<kKind == 3 ? 1 : kKind, RB, NP, kFetch>(p, ldp, rr, nj, v, ldv_bytes, cols, o, ldo, n_ahead, page);
}

// O (R x Ev) += P (R x n) V (n x Ev) by chunks of kValueKeys keys (L1-sized),
// each read from memory once by the first rows' pass and from L1 by the
// rest: 8 rows at a time with up to 32 columns, 4 with up to 64, 2 with up
// to 128, else 1 row and 256 columns at a time; a last single row alone,
// over the columns it has. The next chunk's rows are fetched into L2
// (fetch_row_l2, fetch_rows_l2), adjacent rows a page on into L1 by the
// chunk's first pass (PageFetch).
template <int kKind>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void acc_rows_avx512(const float* p, int64_t R, int64_t n,
                                                                         int64_t ldp, const void* v, int64_t ldv,
                                                                         int64_t Ev, float* o, int64_t ldo, bool far_fetch,
                                                                         int64_t rows_after = 0) {
  if constexpr (kKind == 0) {  // float32, groups of 16 rows: one a lane (rows_lanes_cpu.cpp)
    const int64_t r_t = rows::acc_rows_lanes(p, R, n, ldp, static_cast<const float*>(v), ldv, Ev, o, ldo, rows_after);
    if (r_t >= R) return;
    p += r_t * ldp, o += r_t * ldo, R -= r_t;
  }
  if constexpr (kKind == 3) {  // bfloat16 on AVX512-BF16, groups of 16 rows: one a lane
    const int64_t r_t =
        rows::acc_rows_lanes_bf16(p, R, n, ldp, static_cast<const uint16_t*>(v), ldv, Ev, o, ldo, rows_after);
    if (r_t >= R) return;
    p += r_t * ldp, o += r_t * ldo, R -= r_t;
  }
  const int64_t elem = kKind == 0 ? 4 : 2, ldv_bytes = ldv * elem;
  const char* vb = static_cast<const char*>(v);
  // rows a pass takes, of rr left, over `cols` columns
  auto pass_rows = [](int64_t rr, int64_t cols) -> int64_t {
    return rr == 1 ? 1 : cols <= 32 ? 8 : cols <= 64 ? 4 : cols <= 128 ? 2 : 1;
  };
  for (int64_t j0 = 0; j0 < n; j0 += kValueKeys) {
    const int64_t nj = std::min(kValueKeys, n - j0);
    for (int64_t c0 = 0; c0 < Ev; c0 += 256) {
      const int64_t cols = std::min<int64_t>(256, Ev - c0);
      const char* vc = vb + j0 * ldv_bytes + c0 * elem;
      int64_t ahead = std::clamp<int64_t>(n - j0 - kValueKeys, 0, kValueKeys);  // rows of the next chunk
      // rows not adjacent in memory: the first pass fetches them a row a key
      // where it is a pass of 4 or 2 rows, else all at once here
      const int64_t rb0 = pass_rows(R, cols);
      const bool spread = ldv != Ev && (rb0 == 4 || rb0 == 2);
      // the first pass's page-ahead fetch; later passes take none
      const int64_t per_row = R >= 2 ? rows::kPerRowBytes : 0;
      const PageFetch page = ldv == Ev ? PageFetch::first_pass(vc, ldv_bytes, cols * elem, nj, elem, per_row, far_fetch)
                                       : PageFetch::strided(far_fetch, ldv_bytes, cols * elem),
                      none;
      if (ldv != Ev && !spread) {
        fetch_rows_l2(vc + kValueKeys * ldv_bytes, ldv_bytes, std::exchange(ahead, 0), cols * elem);
      }
      for (int64_t r0 = 0; r0 < R;) {
        const float* pr = p + r0 * ldp + j0;
        float* orow = o + r0 * ldo + c0;
        const int64_t rr = R - r0, rb = pass_rows(rr, cols);
        const PageFetch& pg = r0 == 0 ? page : none;
        // (adjacent rows: the second of 3 or more passes, of 4 or 2 rows, fetches)
        const int64_t na =
            (spread ? r0 == 0 : r0 > 0 && rr > rb && (rb == 4 || rb == 2)) ? std::exchange(ahead, 0) : 0;
        if (rr == 1 && cols <= 128) {  // one row: no work on copies of it
          if (cols <= 32)
            value_rows<kKind, 1, 1>(pr, ldp, 1, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
          else if (cols <= 64)
            value_rows<kKind, 1, 2>(pr, ldp, 1, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
          else
            value_rows<kKind, 1, 4>(pr, ldp, 1, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
        } else if (rb == 8) {
          value_rows<kKind, 8, 1>(pr, ldp, rr, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
        } else if (rb == 4) {
          if (na > 0)
            value_rows<kKind, 4, 2, true>(pr, ldp, rr, nj, vc, ldv_bytes, cols, orow, ldo, na, pg);
          else
            value_rows<kKind, 4, 2>(pr, ldp, rr, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
        } else if (rb == 2) {
          if (na > 0)
            value_rows<kKind, 2, 4, true>(pr, ldp, rr, nj, vc, ldv_bytes, cols, orow, ldo, na, pg);
          else
            value_rows<kKind, 2, 4>(pr, ldp, rr, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
        } else {
          value_rows<kKind, 1, 8>(pr, ldp, rr, nj, vc, ldv_bytes, cols, orow, ldo, 0, pg);
        }
        r0 += rb;
      }
    }
  }
}
#endif  // MHA_X86

}  // namespace

bool acc_rows(const float* p, int64_t R, int64_t n, int64_t ldp, const float* v, int64_t ldv, int64_t Ev, float* o,
              int64_t ldo, bool far_fetch, int64_t rows_after) {
#if MHA_X86
  if (active_isa() >= Isa::kAvx512) {
    acc_rows_avx512<0>(p, R, n, ldp, v, ldv, Ev, o, ldo, far_fetch, rows_after);
    return true;
  }
  if (active_isa() >= Isa::kAvx2) {
    avx2::acc_rows(p, R, n, ldp, v, avx2::RowKind::kFloat, ldv, Ev, o, ldo, far_fetch, rows_after);
    return true;
  }
#endif
  (void)p, (void)R, (void)n, (void)ldp, (void)v, (void)ldv, (void)Ev, (void)o, (void)ldo, (void)far_fetch,
      (void)rows_after;
  return false;
}

bool acc_rows_16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv, int64_t Ev,
                 float* o, int64_t ldo, bool bf16, bool far_fetch, int64_t rows_after) {
#if MHA_X86
  if (bf16 && active_isa() >= Isa::kAvx512Bf16) {
    acc_rows_avx512<3>(p, R, n, ldp, v, ldv, Ev, o, ldo, far_fetch, rows_after);
    return true;
  }
  if (active_isa() >= Isa::kAvx512) {
    bf16 ? acc_rows_avx512<1>(p, R, n, ldp, v, ldv, Ev, o, ldo, far_fetch)
         : acc_rows_avx512<2>(p, R, n, ldp, v, ldv, Ev, o, ldo, far_fetch);
    return true;
  }
  if (active_isa() >= Isa::kAvx2) {
    avx2::acc_rows(p, R, n, ldp, v, bf16 ? avx2::RowKind::kBf16 : avx2::RowKind::kHalf, ldv, Ev, o, ldo, far_fetch);
    return true;
  }
#endif
  (void)p, (void)R, (void)n, (void)ldp, (void)v, (void)ldv, (void)Ev, (void)o, (void)ldo, (void)bf16, (void)far_fetch,
      (void)rows_after;
  return false;
}

}  // namespace cpu
}  // namespace mha_ext
