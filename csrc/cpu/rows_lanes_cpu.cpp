// Float32 decode rows of a 16-row group (R = G L = 16: four query rows of
// a 4-head GQA group, say), one query row a vector lane, for the decode
// kernel (forward_cpu.cpp through rows_cpu.cpp). With a row a lane every
// lane of every multiply-add is a product that counts: no horizontal sums
// (score_block spends 30 shuffles on each 16 sums) and no value row read by
// several passes; Q, P and O are turned into lanes and back by 16 x 16
// transposes. Float32 sums in key (column) order, as the other routines.
#include "rows_avx512.h"

#if MHA_X86
#include <algorithm>
#include <vector>

namespace mha_ext {
namespace cpu {
namespace rows {
namespace {

// acc[j] (lane r: S[r][j]) to rows: out[r] lane j = S[r][j], in three steps
// of 16 shuffles (pairs within 128-bit lanes, quads, then 128-bit lanes).
__attribute__((target("avx512f"), always_inline)) inline void transpose16(__m512* a) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  // u[4 i + m], 128-bit lane L: column 4 L + m of inputs 4 i .. 4 i + 3
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 v = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88), w = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
    a[m] = _mm512_shuffle_f32x4(v, v2, 0x88);
    a[8 + m] = _mm512_shuffle_f32x4(v, v2, 0xDD);
    a[4 + m] = _mm512_shuffle_f32x4(w, w2, 0x88);
    a[12 + m] = _mm512_shuffle_f32x4(w, w2, 0xDD);
  }
}

// dst (m x 16) = src (16 x m, row stride lds) transposed.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_to_lanes(const float* src, int64_t lds, int64_t m,
                                                                      float* dst) {
  for (int64_t c0 = 0; c0 < m; c0 += 16) {
    const __mmask16 mc = lanes(m - c0);
    __m512 a[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) a[r] = _mm512_maskz_loadu_ps(mc, src + r * lds + c0);
    transpose16(a);
    for (int c = 0; c < 16 && c0 + c < m; ++c) _mm512_storeu_ps(dst + 16 * (c0 + c), a[c]);
  }
}

// The inverse: dst (16 x m, row stride ldd) = src (m x 16) transposed.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void lanes_to_rows(const float* src, int64_t m, float* dst,
                                                                      int64_t ldd) {
  for (int64_t c0 = 0; c0 < m; c0 += 16) {
    const __mmask16 mc = lanes(m - c0);
    __m512 a[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) a[c] = c0 + c < m ? _mm512_loadu_ps(src + 16 * (c0 + c)) : _mm512_setzero_ps();
    transpose16(a);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(dst + r * ldd + c0, mc, a[r]);
  }
}

// The scores of 16 float32 query rows, one a lane, with the keys of a block:
// qt holds Q transposed (column e of the 16 rows at qt + 16 e), 8 of its
// vectors in registers at a time, each key column broadcast into one
// multiply-add per vector. Every lane is a product that counts, no
// horizontal sums are needed (score_block spends 30 shuffles on each 16
// sums), and the block's key rows are read once, not once per 4 rows; the
// 16 sums of each key are turned into rows at the end (transpose16). Keys
// past nc repeat the last real one (read, never stored). The next block's
// rows (nb bytes from `ahead`, adjacent) are fetched into L2 over the steps.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void score_block_t(const float* qt, int64_t E, const float* k,
                                                                      int64_t ldk, int64_t nc, float* s, int64_t lds,
                                                                      const char* ahead, int64_t nb) {
  const float* kr[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) kr[j] = k + std::min<int64_t>(j, nc - 1) * ldk;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t chunks = (E + 7) / 8;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t e0 = 8 * c;
    for (int64_t b = (nb * c / chunks) & ~int64_t(63), b_end = nb * (c + 1) / chunks; b < b_end; b += 64)
      _mm_prefetch(ahead + b, _MM_HINT_T1);  // this step's share of the next block
    if (e0 + 8 <= E) {
      __m512 qv[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) qv[i] = _mm512_loadu_ps(qt + 16 * (e0 + i));
      // keys in pairs (two chains of multiply-adds at a time)
#pragma GCC unroll 8
      for (int jp = 0; jp < 16; jp += 2) {
        const float *k0 = kr[jp] + e0, *k1 = kr[jp + 1] + e0;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          acc[jp] = _mm512_fmadd_ps(qv[i], _mm512_set1_ps(k0[i]), acc[jp]);
          acc[jp + 1] = _mm512_fmadd_ps(qv[i], _mm512_set1_ps(k1[i]), acc[jp + 1]);
        }
      }
    } else {  // the last columns, one at a time
      for (int64_t e = e0; e < E; ++e) {
        const __m512 qv = _mm512_loadu_ps(qt + 16 * e);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kr[j][e]), acc[j]);
      }
    }
  }
  transpose16(acc);
  const __mmask16 kc = lanes(nc);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(s + r * lds, kc, acc[r]);
}

// O (16 x Ev) += P (16 x n) V (n x Ev) for float32 value rows with one query
// row a lane: P and O transposed (rows_to_lanes; O back by lanes_to_rows),
// then by chunks of kValueKeys keys and 16 columns, the 16 columns' sums of
// all rows in 16 registers, each value element broadcast into one
// multiply-add. No row of O is split over passes (value_block takes 2 rows of
// 16 at a time, so a chunk's rows are read 8 times, the first time from
// memory), and each 64-byte line of a value row is read by one pass only.
// The next chunk's rows are fetched into L2, a line or a few per key over the
// passes (a burst at each pass stalls once the core's outstanding misses
// are all in use: 4-5% slower), or all at once before them where the rows are
// not adjacent (fetch_rows_l2).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void value_rows_t(const float* p, int64_t ldp, int64_t n,
                                                                     const float* v, int64_t ldv, int64_t Ev, float* o,
                                                                     int64_t ldo) {
  static thread_local std::vector<float> pt, ot;
  pt.resize(16 * n);
  ot.resize(16 * Ev);
  rows_to_lanes(p, ldp, n, pt.data());
  rows_to_lanes(o, ldo, Ev, ot.data());
  const bool adjacent = ldv == Ev;
  const int64_t passes = (Ev + 15) / 16;
  for (int64_t j0 = 0; j0 < n; j0 += kValueKeys) {
    const int64_t nj = std::min(kValueKeys, n - j0);
    const int64_t ahead = std::clamp<int64_t>(n - j0 - kValueKeys, 0, kValueKeys);  // rows of the next chunk
    const char* next = reinterpret_cast<const char*>(v + (j0 + kValueKeys) * ldv);
    const int64_t nb = adjacent ? ahead * Ev * 4 : 0;
    if (!adjacent) fetch_rows_l2(next, ldv * 4, ahead, Ev * 4);
    for (int64_t c0 = 0, pass = 0; c0 < Ev; c0 += 16, ++pass) {
      // this pass's share of the next chunk, a line or a few a key
      int64_t pf = (nb * pass / passes) & ~int64_t(63);
      const int64_t pf_end = nb * (pass + 1) / passes, per = (pf_end - pf + 64 * nj - 1) / (64 * nj);
      const auto fetch = [&]() {
        for (int64_t x = 0; x < per && pf < pf_end; ++x, pf += 64) _mm_prefetch(next + pf, _MM_HINT_T1);
      };
      const int64_t cols = std::min<int64_t>(16, Ev - c0);
      int64_t ci[16];  // columns past cols repeat the last real one (summed, never stored)
      for (int c = 0; c < 16; ++c) ci[c] = c0 + std::min<int64_t>(c, cols - 1);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) acc[c] = _mm512_loadu_ps(ot.data() + 16 * ci[c]);
      const float* vr = v + j0 * ldv + c0;  // (constant offsets from it: no register per column)
      const float* pj = pt.data() + 16 * j0;
      if (cols == 16) {
        for (int64_t j = 0; j < nj; ++j, vr += ldv, pj += 16) {
          fetch();
          const __m512 pv = _mm512_loadu_ps(pj);
#pragma GCC unroll 16
          for (int c = 0; c < 16; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(vr[c]), pv, acc[c]);
        }
      } else {
        for (int64_t j = 0; j < nj; ++j, vr += ldv, pj += 16) {
          fetch();
          const __m512 pv = _mm512_loadu_ps(pj);
#pragma GCC unroll 16
          for (int c = 0; c < 16; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(vr[ci[c] - c0]), pv, acc[c]);
        }
      }
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c)
        if (c < cols) _mm512_storeu_ps(ot.data() + 16 * (c0 + c), acc[c]);
    }
  }
  lanes_to_rows(ot.data(), Ev, o, ldo);
}

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t dot_rows_lanes(const float* q, int64_t R, int64_t E,
                                                                          const float* k, int64_t ldk, int64_t n,
                                                                          float* s, int64_t lds) {
  static thread_local std::vector<float> qt;  // (E x 16): Q's 16 rows as lanes
  const bool adjacent = ldk == E;
  const int64_t row_bytes = E * static_cast<int64_t>(sizeof(*k));
  int64_t r0 = 0;
  for (; R - r0 >= 16; r0 += 16) {
    qt.resize(16 * E);
    rows_to_lanes(q + r0 * E, E, E, qt.data());
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t ahead = std::clamp<int64_t>(n - c0 - 16, 0, 16);  // rows of the next block
      const char* next = reinterpret_cast<const char*>(k + (c0 + 16) * ldk);
      if (!adjacent) fetch_rows_l2(next, ldk * static_cast<int64_t>(sizeof(*k)), ahead, row_bytes);
      score_block_t(qt.data(), E, k + c0 * ldk, ldk, std::min<int64_t>(16, n - c0), s + r0 * lds + c0, lds, next,
                    adjacent ? ahead * row_bytes : 0);
    }
  }
  return r0;
}

int64_t acc_rows_lanes(const float* p, int64_t R, int64_t n, int64_t ldp, const float* v, int64_t ldv, int64_t Ev,
                       float* o, int64_t ldo) {
  int64_t r0 = 0;
  for (; R - r0 >= 16; r0 += 16) value_rows_t(p + r0 * ldp, ldp, n, v, ldv, Ev, o + r0 * ldo, ldo);
  return r0;
}

}  // namespace rows
}  // namespace cpu
}  // namespace mha_ext
#endif  // MHA_X86
