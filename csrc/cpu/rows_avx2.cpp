// The AVX2 + FMA decode rows (rows_avx2.h): the decode kernel's scores
// (dot_rows) and P V (acc_rows) for a few query rows, 8 lanes a register, the
// same arithmetic as the AVX-512 routines of rows_cpu.cpp / rows_values_cpu.cpp in the same orders
// where the lanes allow (16 rows a key/value head: rows_lanes_avx2.cpp; the
// softmax rows: softmax_avx2.cpp). Before them an AVX2-only CPU ran the
// decode kernel's scores in scalar C++.
#include "rows_avx2.h"

#include "rows_avx512.h"  // (the fetches: PageFetch, fetch_rows_l2, with_fixed_page_avx2; kValueKeys)
#include "x86_intrinsics.h"

#if MHA_X86
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace mha_ext {
namespace cpu {
namespace avx2 {
namespace {
using rows::PageFetch;

// Lane i of lo (of hi): the sum of the lanes of x[i] (x[4 + i]), by a
// fixed tree ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), so that each sum is
// the same wherever it sits: 128-bit halves added first (an extract and an
// add a vector), then pairs and quads by 128-bit horizontal adds, and
// score_block stores each row's sums from these registers. Measured against a
// tree of 256-bit horizontal adds and two lane-crossing permutes with the sums
// copied out through a buffer (AMD EPYC of family 23, interleaved,
// bench/decode_rows.cpp): the scores of 1-16 query rows of 64 and 128
// columns, every kind, 1.02-1.23x in the caches (four float32 rows of 64
// columns 1.17x); from memory mostly 1.00-1.10x, with this VM's run-to-run
// spread of 0.85-1.48x.
MHA_AVX2_INLINE void sum8(const __m256* x, __m128& lo, __m128& hi) {
  __m128 y[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) y[i] = _mm_add_ps(_mm256_castps256_ps128(x[i]), _mm256_extractf128_ps(x[i], 1));
  lo = _mm_hadd_ps(_mm_hadd_ps(y[0], y[1]), _mm_hadd_ps(y[2], y[3]));
  hi = _mm_hadd_ps(_mm_hadd_ps(y[4], y[5]), _mm_hadd_ps(y[6], y[7]));
}

template <int kKind>
using Row = std::conditional_t<kKind == 0, float, uint16_t>;

// 8 columns of a row as floats: float32 loaded, bfloat16 shifted up, float16 by F16C
template <int kKind>
MHA_AVX2_INLINE __m256 load8(const Row<kKind>* row) {
  if constexpr (kKind == 0) {
    return _mm256_loadu_ps(row);
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    if constexpr (kKind == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
    return _mm256_cvtph_ps(x);
  }
}
// the first `left` (< 8) columns, zero after (nothing past them read)
template <int kKind>
MHA_AVX2_INLINE __m256 load_part(const Row<kKind>* row, int64_t left) {
  Row<kKind> t[8] = {};
  std::memcpy(t, row, static_cast<size_t>(left) * sizeof(Row<kKind>));
  return load8<kKind>(t);
}

// 16 bfloat16 columns as two vectors of floats, the even columns (the low
// halves of the 32-bit words, shifted up) and the odd ones (the high halves,
// masked): a shift and an and for 16 columns where load8 takes a widening
// and a shift for 8. The scores' query rows are put in that order (each
// dot product then sums the even columns of a 16 before the odd: other
// roundings than before, the same for any thread count); the P V sums are
// put back in column order (the same sums, bit for bit). Two threads, K/V
// from memory, against load8 (AMD EPYC of family 23): scores 1.07-1.11x,
// P V 0.98-1.28x (1, 4 and 16 query rows of 64 and 128 columns).
MHA_AVX2_INLINE void load16_pairs(const uint16_t* row, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// acc[r KB + C] += the dot products of key row k with query rows q + r E,
// the key row read whole in address order (rows_cpu.cpp's key_dot); `page`
// takes its page-ahead share at the row.
template <int kKind, int RB, int KB, int C>
MHA_AVX2_INLINE void key_dot(__m256* acc, const float* q, int64_t E, const Row<kKind>* k, PageFetch& page) {
  page(k);
  int64_t e = 0;
  for (; e + 8 <= E; e += 8) {
    const __m256 kv = load8<kKind>(k + e);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[r * KB + C] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * E + e), kv, acc[r * KB + C]);
  }
  if (e < E) {
    const __m256 kv = load_part<kKind>(k + e, E - e);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r)
      acc[r * KB + C] = _mm256_fmadd_ps(load_part<0>(q + r * E + e, E - e), kv, acc[r * KB + C]);
  }
}

template <int kKind, int RB, int KB, int... C>
MHA_AVX2_INLINE void keys_dot(__m256* acc, const float* q, int64_t E, const Row<kKind>* k, int64_t ldk, int64_t nk,
                              PageFetch& page, std::integer_sequence<int, C...>) {
  (key_dot<kKind, RB, KB, C>(acc, q, E, k + std::min<int64_t>(C, nk - 1) * ldk, page), ...);
}

// acc[r KB + c] += the dot products of key rows k + c ldk (c < KB, those
// past nk repeating the last) with query rows q + r E, the KB key rows read
// side by side: RB KB independent sums a step, where keys_dot has RB (four
// float32 rows of 32 x 8 x 128 heads: 4 sums in flight for a multiply-add
// latency of 5 cycles on Zen 1, and 5 loads for 4 multiply-adds). With 2-4
// query rows a pass, interleaved on an AMD EPYC of family 23, K/V from
// memory: bfloat16 1.04-1.07x, float32 1.00-1.03x. One float32 or float16
// query row keeps keys_dot's rows read whole, in address order (0.84-0.94x
// side by side); one bfloat16 row takes this routine, a key row at a time
// (12 registers: 8 sums in flight where keys_dot's one row had a chain of
// multiply-adds a key, and the widening took about as long as the memory).
// The query vectors are kept in registers (the compiler would otherwise
// reload them as an operand of each multiply-add, and a 256-bit load takes
// both of Zen 1's load ports).
template <int kKind, int RB, int KB>
MHA_AVX2_INLINE void keys_dot_mixed(__m256* acc, const float* q, int64_t E, const Row<kKind>* k, int64_t ldk,
                                    int64_t nk, PageFetch& page) {
  const Row<kKind>* kr[KB];
#pragma GCC unroll 8
  for (int c = 0; c < KB; ++c) {
    kr[c] = k + std::min<int64_t>(c, nk - 1) * ldk;
    page(kr[c]);
  }
  int64_t e = 0;
  if constexpr (kKind == 1) {  // (the query rows' columns in load16_pairs' order)
    for (; e + 16 <= E; e += 16) {
      if constexpr (RB == 1) {
        __m256 qe = _mm256_loadu_ps(q + e), qo = _mm256_loadu_ps(q + e + 8);
        asm("" : "+x"(qe), "+x"(qo));
#pragma GCC unroll 8
        for (int c = 0; c < KB; ++c) {
          __m256 ke, ko;
          load16_pairs(kr[c] + e, ke, ko);
          acc[c] = _mm256_fmadd_ps(qo, ko, _mm256_fmadd_ps(qe, ke, acc[c]));
        }
      } else {
        __m256 ke[KB], ko[KB];
#pragma GCC unroll 8
        for (int c = 0; c < KB; ++c) load16_pairs(kr[c] + e, ke[c], ko[c]);
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          __m256 qe = _mm256_loadu_ps(q + r * E + e), qo = _mm256_loadu_ps(q + r * E + e + 8);
          asm("" : "+x"(qe), "+x"(qo));
#pragma GCC unroll 8
          for (int c = 0; c < KB; ++c)
            acc[r * KB + c] = _mm256_fmadd_ps(qo, ko[c], _mm256_fmadd_ps(qe, ke[c], acc[r * KB + c]));
        }
      }
    }
  }
  for (; e + 8 <= E; e += 8) {
    __m256 kv[KB];
#pragma GCC unroll 8
    for (int c = 0; c < KB; ++c) kv[c] = load8<kKind>(kr[c] + e);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      __m256 qv = _mm256_loadu_ps(q + r * E + e);
      asm("" : "+x"(qv));
#pragma GCC unroll 8
      for (int c = 0; c < KB; ++c) acc[r * KB + c] = _mm256_fmadd_ps(qv, kv[c], acc[r * KB + c]);
    }
  }
  if (e < E) {
    __m256 kv[KB];
#pragma GCC unroll 8
    for (int c = 0; c < KB; ++c) kv[c] = load_part<kKind>(kr[c] + e, E - e);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = load_part<0>(q + r * E + e, E - e);
#pragma GCC unroll 8
      for (int c = 0; c < KB; ++c) acc[r * KB + c] = _mm256_fmadd_ps(qv, kv[c], acc[r * KB + c]);
    }
  }
}

// The scores of RB query rows with nc <= 16 keys, KB = 8 / RB keys at a
// time: the RB x KB dot products in 8 registers, summed by sum8. Keys past
// nc repeat the last real one (read, never stored).
template <int kKind, int RB>
MHA_AVX2_INLINE void score_block_e(const float* q, int64_t E, const Row<kKind>* k, int64_t ldk, int64_t nc, float* s,
                                   int64_t lds, const PageFetch& page_in) {
  PageFetch page = page_in;  // (a local: its count and place stay in registers)
  constexpr int KB = 8 / RB;
  for (int64_t k0 = 0; k0 < nc; k0 += KB) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    if constexpr (RB == 1 && kKind != 1)
      keys_dot<kKind, RB, KB>(acc, q, E, k + k0 * ldk, ldk, nc - k0, page, std::make_integer_sequence<int, KB>{});
    else
      keys_dot_mixed<kKind, RB, KB>(acc, q, E, k + k0 * ldk, ldk, nc - k0, page);
    __m128 lo, hi;  // lane r KB + c of (lo, hi): row r, key k0 + c
    sum8(acc, lo, hi);
    float* out = s + k0;
    if (k0 + KB <= nc) {  // each row's KB scores stored whole
      if constexpr (KB == 8) {
        _mm_storeu_ps(out, lo), _mm_storeu_ps(out + 4, hi);
      } else if constexpr (KB == 4) {
        _mm_storeu_ps(out, lo), _mm_storeu_ps(out + lds, hi);
      } else {
        _mm_storel_pi(reinterpret_cast<__m64*>(out), lo), _mm_storeh_pi(reinterpret_cast<__m64*>(out + lds), lo);
        _mm_storel_pi(reinterpret_cast<__m64*>(out + 2 * lds), hi);
        _mm_storeh_pi(reinterpret_cast<__m64*>(out + 3 * lds), hi);
      }
    } else {
      alignas(16) float t[8];
      _mm_store_ps(t, lo), _mm_store_ps(t + 4, hi);
      for (int r = 0; r < RB; ++r)
        for (int64_t c = 0; c < nc - k0; ++c) out[r * lds + c] = t[r * KB + c];
    }
  }
}

// score_block_e with the head dim (64 or 128) and the page-ahead fetch as
// constants where they take those forms, as the AVX-512 score_block
// (rows_cpu.cpp). Against the run-time forms, interleaved in one process (the
// AVX2 path forced on an Intel Xeon with AMX, 2 threads, 2k keys in the
// caches): one row of 12 x 64 heads float16 1.45x, bfloat16 1.19x, float32
// 1.04-1.05x; four float32 rows 1.13x; from memory (8k keys) 0.98-1.07x.
// The value side's blocks (StripFetch) keep their run-time forms.
template <int kKind, int RB>
MHA_AVX2 void score_block(const float* q, int64_t E, const Row<kKind>* k, int64_t ldk, int64_t nc, float* s,
                          int64_t lds, const PageFetch& page) {
  auto fixed = [&](auto e) MHA_AVX2_LAMBDA {
    return E == e && rows::with_fixed_page_avx2(page, e * static_cast<int64_t>(sizeof(Row<kKind>)),
                                                [&](const PageFetch& pg) MHA_AVX2_LAMBDA {
                                                  score_block_e<kKind, RB>(q, e, k, ldk, nc, s, lds, pg);
                                                });
  };
  if (fixed(std::integral_constant<int64_t, 64>{}) || fixed(std::integral_constant<int64_t, 128>{})) return;
  score_block_e<kKind, RB>(q, E, k, ldk, nc, s, lds, page);
}

// S = Q K^T by blocks of 16 keys (in L1 for the passes after the first):
// four query rows a pass, then two, then one. The first pass fetches
// adjacent rows a page ahead (PageFetch); rows that are not adjacent (a
// (B, S, H, D) cache) have the next block's rows fetched into L2 before the
// block, as on AVX-512.
template <int kKind>
MHA_AVX2 void dot_rows_t(const float* q, int64_t R, int64_t E, const Row<kKind>* k, int64_t ldk, int64_t n, float* s,
                         int64_t lds, bool far_fetch) {
  const int64_t elem = sizeof(Row<kKind>), row_bytes = E * elem;
  const bool adjacent = ldk == E;
  if constexpr (kKind == 1) {  // the query rows' columns in load16_pairs' order: each 16 even, then odd
    thread_local std::vector<float> pairs;
    pairs.resize(static_cast<size_t>(R * E));
    const int64_t whole = E / 16 * 16;
    for (int64_t r = 0; r < R; ++r) {
      const float* from = q + r * E;
      float* to = pairs.data() + r * E;
      for (int64_t e = 0; e < whole; e += 16)
        for (int i = 0; i < 8; ++i) to[e + i] = from[e + 2 * i], to[e + 8 + i] = from[e + 2 * i + 1];
      std::copy(from + whole, from + E, to + whole);
    }
    q = pairs.data();
  }
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t nc = std::min<int64_t>(16, n - c0);
    const Row<kKind>* kc = k + c0 * ldk;
    PageFetch page = adjacent ? PageFetch::first_pass(kc, row_bytes, row_bytes, nc, elem, 0, far_fetch)
                              : PageFetch::strided(far_fetch, ldk * elem, row_bytes);
    // 16-bit rows of more than kPerRowColumns columns with two query rows or
    // more: each row's own bytes a page on at the row, as narrower rows, for
    // the block's spread lines (RowFetch), whose count and branches at every
    // key kept the 2-4 row score blocks from their fixed-E forms. Against the
    // spread form, interleaved (AMD EPYC of family 25, Zen 3, 2 threads,
    // bit-identical): bfloat16 scores of 4 rows of 128 columns 1.26x in L2,
    // 1.09-1.12x from memory (bench/decode_rows.cpp); whole decode steps of
    // the op, bfloat16 and float16, 1-2 query rows of 32 x 8 x 128 and
    // 16 x 16 x 128 heads: 1.09-1.16x in the caches, 1.00-1.04x from memory.
    // Float32 rows keep the spread form (0.82x from memory, 1.00x in the
    // caches) and so does one query row (0.60x: its 8 key rows a block
    // side by side would fetch 8 rows at once).
    if (kKind != 0 && adjacent && R >= 2) page.block = {}, page.bytes = row_bytes;
    const PageFetch none;
    if (!adjacent) rows::fetch_rows_l2(kc + 16 * ldk, ldk * elem, std::clamp<int64_t>(n - c0 - 16, 0, 16), row_bytes);
    for (int64_t r0 = 0; r0 < R;) {
      const int64_t rr = R - r0, rb = rr >= 4 ? 4 : rr >= 2 ? 2 : 1;
      const PageFetch& pg = r0 == 0 ? page : none;
      if (rb == 4)
        score_block<kKind, 4>(q + r0 * E, E, kc, ldk, nc, s + r0 * lds + c0, lds, pg);
      else if (rb == 2)
        score_block<kKind, 2>(q + r0 * E, E, kc, ldk, nc, s + r0 * lds + c0, lds, pg);
      else
        score_block<kKind, 1>(q + r0 * E, E, kc, ldk, nc, s + r0 * lds + c0, lds, pg);
      r0 += rb;
    }
  }
}

// What the blocks of a chunk's first pass fetch at each key.
// - 16-bit rows: the lines of their columns l1 bytes on into L1 and l2 bytes
//   on into L2 (0: the row itself, about to be read). Against block 0
//   fetching whole rows a page ahead and the other blocks nothing, two
//   threads, K/V from memory (AMD EPYC of family 23): bfloat16 P V of 4
//   query rows 1.31-1.40x with the far fetch, bfloat16 and float16 1, 4 and
//   16 rows 0.92-1.14x whole decode steps.
// - Adjacent float32 rows (`next` set): at each key, the next block's
//   columns of the same row into L1 (the block after reads them; they are
//   in L2 from the chunk before's stream, except in a call's first chunk;
//   the last block's go to the next row's first columns, already read), and
//   the block's share of the next chunk's lines into L2, in address order
//   from `next` (each block as many lines a key as its columns take, a whole
//   line for a block of 8 columns or fewer: a little more than the chunk
//   where Ev is not a multiple of the block, fetched twice), the blocks one
//   after another. Branch-free: a fixed count of prefetches a key at
//   addresses one add apart. Against block 0 fetching
//   whole rows a page ahead with its line count and row kept a key, and the
//   other blocks the next chunk a few lines at a key in the same way (their
//   bookkeeping, a few branches and reloads a key, cost the P V of 4 rows
//   of 128 columns half its time in L1: 58-64 ns a key against 32-33 with
//   no fetch at all), two threads, AMD EPYC of family 23, interleaved,
//   scores and P V: from memory 4 rows of 128 columns 1.14-1.18x, of 64
//   1.10-1.12x, 6 and 8 rows 1.15-1.20x, 1 and 2 rows 0.99-1.07x; in the
//   caches 4 rows 1.33-1.39x, 1 row 1.24-1.28x. The same stream with the
//   chunk's lines a page ahead into L1 in place of the next block's did
//   the same within noise. Columns of each block fetched a page ahead (the
//   16-bit form) ran float32 rows 0.84-0.93x in an earlier measurement.
// Rows that are not adjacent fetch the next chunk before it (acc_rows_t).
struct StripFetch {
  int64_t l1 = 0, l2 = 0;
  const char* next = nullptr;
};

// The cache lines a block of 8 NV columns fetches at each key (at least one)
template <int kKind, int NV>
constexpr int kBlockLines = std::max<int>(1, 8 * NV * static_cast<int>(sizeof(Row<kKind>)) / 64);

// O (RB rows, ldo) += P (RB x nj, ldp) V (nj rows, ldv) over 8 NV columns
// (or, with NV = 1, cols <= 8 of them): the RB x NV sums in registers, each
// in key order, added to O at the end. Rows past rr repeat the last real
// one (computed, never stored). bfloat16 blocks of 16 columns or more read
// them as even and odd columns (load16_pairs), the sums put back in column
// order at the end. Only a block with kFetch fetches at each key (StripFetch).
template <int kKind, int RB, int NV, bool kFetch>
MHA_AVX2 void value_block(const float* p, int64_t ldp, int64_t rr, int64_t nj, const Row<kKind>* v, int64_t ldv,
                          int64_t cols, float* o, int64_t ldo, const StripFetch& strip = {}) {
  constexpr bool kPairs = kKind == 1 && NV % 2 == 0;
  constexpr int kLines = kBlockLines<kKind, NV>;
  const char* next = strip.next;
  const float* pr[RB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) pr[r] = p + std::min<int64_t>(r, rr - 1) * ldp;
  __m256 acc[RB][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < NV; ++x) acc[r][x] = _mm256_setzero_ps();
  const bool part = NV == 1 && cols < 8;
  for (int64_t j = 0; j < nj; ++j) {
    const Row<kKind>* vr = v + j * ldv;
    if constexpr (kFetch && kKind == 0) {
      const char* at = reinterpret_cast<const char*>(vr + 8 * NV);
#pragma GCC unroll 4
      for (int x = 0; x < kLines; ++x) {
        _mm_prefetch(at + 64 * x, _MM_HINT_T0);
        _mm_prefetch(next + 64 * x, _MM_HINT_T1);
      }
      next += 64 * kLines;
    } else if constexpr (kFetch) {
      const char* at = reinterpret_cast<const char*>(vr);
#pragma GCC unroll 4
      for (int x = 0; x < kLines; ++x) {
        _mm_prefetch(at + strip.l1 + 64 * x, _MM_HINT_T0);
        _mm_prefetch(at + strip.l2 + 64 * x, _MM_HINT_T1);
      }
    }
    if constexpr (kPairs && RB == 1) {
      const __m256 pb = _mm256_broadcast_ss(pr[0] + j);
#pragma GCC unroll 8
      for (int y = 0; y < NV / 2; ++y) {
        __m256 we, wo;
        load16_pairs(vr + 16 * y, we, wo);
        acc[0][2 * y] = _mm256_fmadd_ps(pb, we, acc[0][2 * y]);
        acc[0][2 * y + 1] = _mm256_fmadd_ps(pb, wo, acc[0][2 * y + 1]);
      }
    } else if constexpr (kPairs) {
      __m256 w[NV];
#pragma GCC unroll 8
      for (int y = 0; y < NV / 2; ++y) load16_pairs(vr + 16 * y, w[2 * y], w[2 * y + 1]);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m256 pb = _mm256_broadcast_ss(pr[r] + j);
#pragma GCC unroll 8
        for (int x = 0; x < NV; ++x) acc[r][x] = _mm256_fmadd_ps(pb, w[x], acc[r][x]);
      }
    } else if constexpr (RB == 1) {  // a value vector for one multiply-add: loaded as it is used
      const __m256 pb = _mm256_broadcast_ss(pr[0] + j);
#pragma GCC unroll 8
      for (int x = 0; x < NV; ++x)
        acc[0][x] = _mm256_fmadd_ps(pb, part ? load_part<kKind>(vr, cols) : load8<kKind>(vr + 8 * x), acc[0][x]);
    } else {
      __m256 w[NV];
#pragma GCC unroll 8
      for (int x = 0; x < NV; ++x) w[x] = part ? load_part<kKind>(vr, cols) : load8<kKind>(vr + 8 * x);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m256 pb = _mm256_broadcast_ss(pr[r] + j);
#pragma GCC unroll 8
        for (int x = 0; x < NV; ++x) acc[r][x] = _mm256_fmadd_ps(pb, w[x], acc[r][x]);
      }
    }
  }
  if constexpr (kPairs) {  // even and odd columns of each 16 back in column order
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 8
      for (int y = 0; y < NV / 2; ++y) {
        const __m256 lo = _mm256_unpacklo_ps(acc[r][2 * y], acc[r][2 * y + 1]);  // columns 0-3 | 8-11
        const __m256 hi = _mm256_unpackhi_ps(acc[r][2 * y], acc[r][2 * y + 1]);  // 4-7 | 12-15
        acc[r][2 * y] = _mm256_permute2f128_ps(lo, hi, 0x20);
        acc[r][2 * y + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
      }
    }
  }
  const __m256i t = lanes(cols);
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    if (r >= rr) break;
    float* orow = o + r * ldo;
#pragma GCC unroll 8
    for (int x = 0; x < NV; ++x) {
      if (part)
        _mm256_maskstore_ps(orow, t, _mm256_add_ps(_mm256_maskload_ps(orow, t), acc[r][x]));
      else
        _mm256_storeu_ps(orow + 8 * x, _mm256_add_ps(_mm256_loadu_ps(orow + 8 * x), acc[r][x]));
    }
  }
}

// The rows of the next pass with rr rows left (acc_rows_t), and its vectors
// a block (value_pass's NV).
constexpr int64_t pass_rows(int64_t rr) { return rr >= 6 ? 6 : rr >= 4 ? 4 : rr >= 2 ? 2 : 1; }
constexpr int64_t pass_vectors(int64_t rb) { return rb >= 4 ? 2 : rb == 2 ? 4 : 8; }

// One pass of RB rows over the columns [0, cols) of a chunk: blocks of 8 NV
// columns, then single vectors, the last maybe partial (with NV = 1 only
// that one). In the chunk's first pass (`first`) the blocks fetch at each
// key what `strip` says (float32 rows only where it has `next`, each block
// from where the one before left off); the other passes fetch nothing.
template <int kKind, int RB, int NV>
MHA_AVX2 void value_pass(const float* p, int64_t ldp, int64_t rr, int64_t nj, const Row<kKind>* v, int64_t ldv,
                         int64_t cols, float* o, int64_t ldo, bool first, StripFetch strip) {
  const bool fetch = first && (kKind != 0 || strip.next != nullptr);
  auto block = [&](auto nv, int64_t c0, int64_t width) {
    constexpr int kNV = decltype(nv)::value;
    if (fetch)
      value_block<kKind, RB, kNV, true>(p, ldp, rr, nj, v + c0, ldv, width, o + c0, ldo, strip);
    else
      value_block<kKind, RB, kNV, false>(p, ldp, rr, nj, v + c0, ldv, width, o + c0, ldo);
    if (strip.next != nullptr) strip.next += 64 * kBlockLines<kKind, kNV> * nj;
  };
  int64_t c0 = 0;
  for (; c0 + 8 * NV <= cols; c0 += 8 * NV) block(std::integral_constant<int, NV>{}, c0, 8 * NV);
  for (; c0 < cols; c0 += 8) block(std::integral_constant<int, 1>{}, c0, std::min<int64_t>(8, cols - c0));
}

// O (R x Ev) += P (R x n) V (n x Ev) by chunks of rows::kValueKeys keys
// (L1-sized), each read from memory by the first pass and from L1 by the
// rest: 6 rows by 16 columns a pass, then 4 by 16, 2 by 32, 1 by 64 (a
// block's sums in 12 or 8 registers; 6 x 16 takes 8 loads, value vectors
// and broadcasts of P, for 12 multiply-adds, where the 8 x 8 of before
// took 9 for 8). The first pass fetches as StripFetch says; rows not
// adjacent have the next chunk fetched into L2 first.
template <int kKind>
MHA_AVX2 void acc_rows_t(const float* p, int64_t R, int64_t n, int64_t ldp, const Row<kKind>* v, int64_t ldv,
                         int64_t Ev, float* o, int64_t ldo, bool far_fetch, int64_t rows_after = 0) {
  const int64_t elem = sizeof(Row<kKind>), row_bytes = Ev * elem;
  StripFetch strip;  // (16-bit rows) adjacent: a page ahead into L1; far into L2 (strided rows: kFarRows keys on)
  if (kKind != 0 && ldv == Ev) strip.l1 = rows::kFetchAhead;
  if (kKind != 0 && far_fetch) strip.l2 = ldv == Ev ? rows::kFarAhead : rows::kFarRows * ldv * elem;
  for (int64_t j0 = 0; j0 < n; j0 += rows::kValueKeys) {
    const int64_t nj = std::min(rows::kValueKeys, n - j0);
    const Row<kKind>* vc = v + j0 * ldv;
    if (ldv != Ev) {
      const int64_t ahead = std::clamp<int64_t>(n - j0 - rows::kValueKeys, 0, rows::kValueKeys);
      rows::fetch_rows_l2(vc + rows::kValueKeys * ldv, ldv * elem, ahead, row_bytes);
    } else if (kKind == 0) {
      // the next chunk, into the caller's next rows (rows_after) at the
      // call's end; where fewer than a whole chunk follow, this chunk again
      // (in the caches: nothing read from memory past the rows in use)
      const bool whole = n + rows_after - j0 - rows::kValueKeys >= rows::kValueKeys;
      strip.next = reinterpret_cast<const char*>(whole ? vc + rows::kValueKeys * ldv : vc);
    }
    for (int64_t r0 = 0; r0 < R;) {
      const int64_t rr = R - r0, rb = pass_rows(rr);
      const float* pr = p + r0 * ldp + j0;
      float* orow = o + r0 * ldo;
      if (rb == 6)
        value_pass<kKind, 6, pass_vectors(6)>(pr, ldp, rr, nj, vc, ldv, Ev, orow, ldo, r0 == 0, strip);
      else if (rb == 4)
        value_pass<kKind, 4, pass_vectors(4)>(pr, ldp, rr, nj, vc, ldv, Ev, orow, ldo, r0 == 0, strip);
      else if (rb == 2)
        value_pass<kKind, 2, pass_vectors(2)>(pr, ldp, rr, nj, vc, ldv, Ev, orow, ldo, r0 == 0, strip);
      else
        value_pass<kKind, 1, pass_vectors(1)>(pr, ldp, rr, nj, vc, ldv, Ev, orow, ldo, r0 == 0, strip);
      r0 += rb;
    }
  }
}
}  // namespace

// Float32 rows go without the far fetch (PageFetch, rows_avx512.h) here:
// on an AMD EPYC of family 23 it cost them 2-8% (interleaved, 1-16 query
// rows of 32 x 8 x 128 and 12 x 12 x 64 heads, K/V from memory), bfloat16
// rows 0.98-1.05x, kept.
void dot_rows(const float* q, int64_t R, int64_t E, const void* k, RowKind kind, int64_t ldk, int64_t n, float* s,
              int64_t lds, bool far_fetch) {
  far_fetch = far_fetch && kind != RowKind::kFloat;
  const int64_t taken = dot_rows_lanes(q, R, E, k, kind, ldk, n, s, lds, far_fetch);
  if (taken == R) return;
  q += taken * E, s += taken * lds, R -= taken;
  if (kind == RowKind::kFloat) return dot_rows_t<0>(q, R, E, static_cast<const float*>(k), ldk, n, s, lds, far_fetch);
  const auto* k16 = static_cast<const uint16_t*>(k);
  if (kind == RowKind::kBf16) return dot_rows_t<1>(q, R, E, k16, ldk, n, s, lds, far_fetch);
  dot_rows_t<2>(q, R, E, k16, ldk, n, s, lds, far_fetch);
}

void acc_rows(const float* p, int64_t R, int64_t n, int64_t ldp, const void* v, RowKind kind, int64_t ldv, int64_t Ev,
              float* o, int64_t ldo, bool far_fetch, int64_t rows_after) {
  far_fetch = far_fetch && kind != RowKind::kFloat;
  if (kind == RowKind::kFloat)
    return acc_rows_t<0>(p, R, n, ldp, static_cast<const float*>(v), ldv, Ev, o, ldo, far_fetch, rows_after);
  const auto* v16 = static_cast<const uint16_t*>(v);
  if (kind == RowKind::kBf16) return acc_rows_t<1>(p, R, n, ldp, v16, ldv, Ev, o, ldo, far_fetch);
  acc_rows_t<2>(p, R, n, ldp, v16, ldv, Ev, o, ldo, far_fetch);
}

}  // namespace avx2
}  // namespace cpu
}  // namespace mha_ext
#endif  // MHA_X86
