// Float32 decode rows of a 16-row group (R = G L = 16: four query rows of
// a 4-head GQA group, say), one query row a vector lane (bfloat16 rows on
// AVX512-BF16 likewise, by pairs of columns or keys), for the decode
// kernel (decode_cpu.cpp through rows_cpu.cpp and rows_values_cpu.cpp). With a row a lane every
// lane of every multiply-add is a product that counts: no horizontal sums
// (score_block spends 30 shuffles on each 16 sums) and no value row read by
// several passes; Q, P and O are turned into lanes and back by 16 x 16
// transposes. Float32 sums in key (column) order, as the other routines.
#include "rows_avx512.h"

#if MHA_X86
#include <algorithm>
#include <cstring>
#include <type_traits>
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

// acc += the pairs of a times the 32-bit pair at `pair` in every lane:
// vdpbf16ps with its broadcast from memory, written out (one instruction
// where the intrinsic takes a vpbroadcastd more; no AVX512-BF16 target
// needed by the callers, which run it only where the CPU has it)
__attribute__((always_inline)) inline __m512 dp_bcast(__m512 acc, __m512 a, const void* pair) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*static_cast<const uint32_t*>(pair)));
  return acc;
}

// One step of the scores for one key row: float32, column e's product
// (a multiply-add of the broadcast key element); bfloat16 (bits) on
// AVX512-BF16, column pair e's two products summed in float (vdpbf16ps).
template <typename K>
__attribute__((target("avx512f"), always_inline)) inline __m512 lane_step(__m512 acc, __m512 qv, const K* krow,
                                                                         int64_t e) {
  if constexpr (std::is_same_v<K, float>)
    return _mm512_fmadd_ps(qv, _mm512_set1_ps(krow[e]), acc);
  else
    return dp_bcast(acc, qv, krow + 2 * e);
}

// lane_step for key row 4 m + s of a whole block at a run-time stride: the
// broadcast's address is base (row 4 m, column pair or column kI) plus s
// rows, as x86 addressing forms it (base + index * scale + displacement:
// s = 1, 2 from the stride, s = 3 from three times it), so that 16 rows take
// four base registers and two index registers. Written out: left to itself
// the compiler held the 16 row addresses in vector registers and moved one
// back before each broadcast (a (B, S, H, D) KV cache: 7% of the score
// routine's time sat on one such move). The asm reads the key row without
// telling the compiler, which is sound as nothing writes keys meanwhile.
template <typename K, int kS, int kI>
__attribute__((target("avx512f"), always_inline)) inline __m512 lane_step_at(__m512 acc, __m512 qv, const char* base,
                                                                            int64_t ld, int64_t ld3) {
  constexpr int kDisp = 4 * kI;  // step kI's 4 bytes (a float32 column, a bfloat16 column pair)
  if constexpr (std::is_same_v<K, float>) {
    if constexpr (kS == 0) asm("vfmadd231ps %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp));
    if constexpr (kS == 1) asm("vfmadd231ps %c3(%2,%4,1)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp), "r"(ld));
    if constexpr (kS == 2) asm("vfmadd231ps %c3(%2,%4,2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp), "r"(ld));
    if constexpr (kS == 3) asm("vfmadd231ps %c3(%2,%4,1)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp), "r"(ld3));
  } else {
    if constexpr (kS == 0) asm("vdpbf16ps %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp));
    if constexpr (kS == 1) asm("vdpbf16ps %c3(%2,%4,1)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp), "r"(ld));
    if constexpr (kS == 2) asm("vdpbf16ps %c3(%2,%4,2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp), "r"(ld));
    if constexpr (kS == 3) asm("vdpbf16ps %c3(%2,%4,1)%{1to16%}, %1, %0" : "+v"(acc) : "v"(qv), "r"(base), "i"(kDisp), "r"(ld3));
  }
  return acc;
}

// Step kI of all 16 keys (key 4 m + s from base[m]), in key order.
template <typename K, int kI, int... J>
__attribute__((target("avx512f"), always_inline)) inline void lane_steps_at(__m512* acc, __m512 qv,
                                                                           const char* const* base, int64_t ld,
                                                                           int64_t ld3, std::integer_sequence<int, J...>) {
  ((acc[J] = lane_step_at<K, J % 4, kI>(acc[J], qv, base[J / 4], ld, ld3)), ...);
}
template <typename K, int... I>
__attribute__((target("avx512f"), always_inline)) inline void lane_chunk_at(__m512* acc, const __m512* qv,
                                                                           const char* const* base, int64_t ld,
                                                                           int64_t ld3, std::integer_sequence<int, I...>) {
  (lane_steps_at<K, I>(acc, qv[I], base, ld, ld3, std::make_integer_sequence<int, 16>{}), ...);
}

// The scores of 16 query rows, one a lane, with the keys of a block: qt
// holds Q transposed (step e of the 16 rows at qt + 16 e: column e in
// float32, the pair of columns 2 e, 2 e + 1 as one 32-bit word in
// bfloat16), 8 of its vectors in registers at a time, each key step
// broadcast into one instruction per vector (lane_step). Every lane is a
// product that counts, no horizontal sums are needed (score_block spends 30
// shuffles on each 16 sums), and the block's key rows are read once, not
// once per 4 rows; the 16 sums of each key are turned into rows at the end
// (transpose16). The next block's rows are fetched into L2 over the steps
// (`fetch`). How the 16 key rows are addressed (kRows):
// - kRows > 0: a whole block (nc = 16) of rows kRows elements apart (ldk =
//   kRows), every key row one base register and a constant offset;
// - kStrided: a whole block at a stride known at run time, from four base
//   registers and the stride (lane_step_at);
// - kPartial: nc < 16 keys, those past nc repeating the last real one (read,
//   never stored).
// With a stride known only at run time and a row pointer each, the 16 row
// addresses took more registers than there are, and the compiler kept them
// in vector registers, one move back before each broadcast (32 x 8 x 128
// heads, four query rows, K/V in the caches: float32 1.05x against that;
// bfloat16 with value_rows_bf16's constant stride 1.21x, 1.01-1.08x from
// memory; a (B, S, H, D) KV cache, kStrided: float32 1.09-1.12x, bfloat16
// 1.02-1.06x).
constexpr int kStrided = 0, kPartial = -1;
template <typename K, int kRows>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void score_block_t(const float* qt, int64_t steps, const K* k,
                                                                      int64_t ldk, int64_t nc, float* s, int64_t lds,
                                                                      RowFetch<> fetch) {
  constexpr int64_t kPer = sizeof(float) / sizeof(K);  // columns a step
  const K* kr[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) kr[j] = kRows > 0 ? k + j * kRows : k + std::min<int64_t>(j, nc - 1) * ldk;
  const int64_t ld = ldk * static_cast<int64_t>(sizeof(K));  // bytes from a key row to the next
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t chunks = (steps + 7) / 8;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t e0 = 8 * c;
    fetch();  // this step's share of the next block
    if (e0 + 8 <= steps) {
      __m512 qv[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) qv[i] = _mm512_loadu_ps(qt + 16 * (e0 + i));
      // a step for all 16 keys, then the next: 16 independent products in a
      // row (keys in pairs, 8 steps each, ran float32 0.95-0.97x of this at
      // 32 x 8 x 128 heads, four query rows; bfloat16 0.97-1.02x)
      if constexpr (kRows == kStrided) {
        const char* base[4];  // key rows 0, 4, 8, 12 at step e0
        for (int m = 0; m < 4; ++m) base[m] = reinterpret_cast<const char*>(k + 4 * m * ldk + kPer * e0);
        lane_chunk_at<K>(acc, qv, base, ld, 3 * ld, std::make_integer_sequence<int, 8>{});
      } else {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) acc[j] = lane_step(acc[j], qv[i], kr[j], e0 + i);
        }
      }
    } else {  // the last steps, one at a time
      for (int64_t e = e0; e < steps; ++e) {
        const __m512 qv = _mm512_loadu_ps(qt + 16 * e);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = lane_step(acc[j], qv, kr[j], e);
      }
    }
  }
  transpose16(acc);
  const __mmask16 kc = lanes(nc);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(s + r * lds, kc, acc[r]);
}

// The line of each value row that the next pass reads first, fetched into L1
// a row a key over this pass (the chunk is in L2 by then, fetched a chunk
// ahead: without this, half the float32 value pass's time sat on the first
// broadcast of each key): column c0 + 16 of the chunk's rows, or after its
// last pass the first columns of the next chunk's rows. Float32 32 x 8 x 128
// heads, four query rows: 1.01-1.14x; bfloat16 0.97-1.07x.
template <typename T>
struct NextPassL1 {
  const char* at;
  int64_t stride, rows;
  NextPassL1(const T* v, int64_t ldv, int64_t n, int64_t j0, int64_t nj, int64_t c0, int64_t Ev)
      : at(reinterpret_cast<const char*>(c0 + 16 < Ev ? v + j0 * ldv + c0 + 16 : v + (j0 + kValueKeys) * ldv)),
        stride(ldv * static_cast<int64_t>(sizeof(T))),
        rows(c0 + 16 < Ev ? nj : std::clamp<int64_t>(n - j0 - kValueKeys, 0, nj)) {}
  void operator()(int64_t j) const {  // key j of the chunk
    if (j < rows) _mm_prefetch(at + j * stride, _MM_HINT_T0);
  }
};

// S (R x n) = Q K^T for the groups of 16 rows (dot_rows_lanes, dot_rows_lanes_bf16)
template <typename K>
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t dot_rows_t(const K* q, int64_t R, int64_t E,
                                                                      const K* k, int64_t ldk, int64_t n, float* s,
                                                                      int64_t lds, int64_t rows_after) {
  constexpr int64_t kPer = sizeof(float) / sizeof(K);  // columns a step
  static thread_local std::vector<float> qt;  // (E / kPer x 16): Q's 16 rows as lanes
  const int64_t steps = E / kPer, row_bytes = E * static_cast<int64_t>(sizeof(K));
  int64_t r0 = 0;
  for (; R - r0 >= 16; r0 += 16) {
    qt.resize(16 * steps);
    // (bfloat16 pairs as 32-bit words moved as they are: the transposes only shuffle bits)
    rows_to_lanes(reinterpret_cast<const float*>(q + r0 * E), steps, steps, qt.data());
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, n - c0);
      // rows of the next block; past the n rows, the caller's next ones
      // (rows_after). Where the last block fetched nothing, the next call's
      // first block and chunk waited on memory: against that, interleaved
      // (AMD EPYC of family 25 model 17, 2 threads, 16 rows of 32 x 8 x 128
      // heads, splits of several tiles, bit-identical), 32k keys bfloat16
      // 1.07-1.15x, float32 1.06-1.08x; 12 layers' caches of 8k keys 1.05-1.08x
      const int64_t ahead = std::clamp<int64_t>(n + rows_after - c0 - nc, 0, 16);
      const RowFetch<> fetch(reinterpret_cast<const char*>(k + (c0 + nc) * ldk), ldk * static_cast<int64_t>(sizeof(K)),
                           row_bytes, 0, ahead * ((row_bytes + 63) / 64), (steps + 7) / 8);
      const K* kc = k + c0 * ldk;
      float* sc = s + r0 * lds + c0;
      // Float32 key rows a multiple of 4 KiB apart (a (B, S, H, D) cache of
      // 8 heads of 128 columns, 16 of 64) all fall in the same sets of the
      // 8-way L1: each step reads a column of all 16 rows, so their lines
      // evict each other and every broadcast went to L2. Copied into a
      // dense block first (16 rows of a few hundred bytes, in L1), 16 query
      // rows of 32 x 8 x 128 heads ran 1.24x from memory (quartiles
      // 1.21-1.25; 16k-32k keys) and 1.36x (1.34-1.40) at 2k keys in the
      // caches (interleaved, AMD EPYC of family 25 model 17, 2 threads,
      // bit-identical). bfloat16 rows (2 KiB apart there) gained nothing so
      // (1.00x) and are read in place.
      if (std::is_same_v<K, float> && nc == 16 && ldk != E && ldk * 4 % 4096 == 0 && (E == 128 || E == 64)) {
        static thread_local std::vector<K> dense;
        dense.resize(16 * E);
        for (int j = 0; j < 16; ++j) std::memcpy(dense.data() + j * E, kc + j * ldk, row_bytes);
        if (E == 128)
          score_block_t<K, 128>(qt.data(), steps, dense.data(), E, nc, sc, lds, fetch);
        else
          score_block_t<K, 64>(qt.data(), steps, dense.data(), E, nc, sc, lds, fetch);
      } else if (nc == 16 && ldk == E && E == 128)  // the usual head dims, rows adjacent: constant offsets
        score_block_t<K, 128>(qt.data(), steps, kc, ldk, nc, sc, lds, fetch);
      else if (nc == 16 && ldk == E && E == 64)
        score_block_t<K, 64>(qt.data(), steps, kc, ldk, nc, sc, lds, fetch);
      else if (nc == 16)
        score_block_t<K, kStrided>(qt.data(), steps, kc, ldk, nc, sc, lds, fetch);
      else
        score_block_t<K, kPartial>(qt.data(), steps, kc, ldk, nc, sc, lds, fetch);
    }
  }
  return r0;
}

// O (16 x Ev) += P (16 x n) V (n x Ev) for float32 value rows with one query
// row a lane: P and O transposed (rows_to_lanes; O back by lanes_to_rows),
// then by chunks of kValueKeys keys and 16 columns, the 16 columns' sums of
// all rows in 16 registers, each value element broadcast into one
// multiply-add. No row of O is split over passes (value_block takes 2 rows of
// 16 at a time, so a chunk's rows are read 8 times, the first time from
// memory), and each 64-byte line of a value row is read by one pass only.
// The next chunk's rows are fetched into L2, a line or a few per key over the
// passes (RowFetch).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void value_rows_t(const float* p, int64_t ldp, int64_t n,
                                                                     const float* v, int64_t ldv, int64_t Ev, float* o,
                                                                     int64_t ldo, int64_t rows_after) {
  static thread_local std::vector<float> pt, ot;
  pt.resize(16 * n);
  ot.resize(16 * Ev);
  rows_to_lanes(p, ldp, n, pt.data());
  rows_to_lanes(o, ldo, Ev, ot.data());
  const int64_t passes = (Ev + 15) / 16, full = Ev / 16;
  for (int64_t j0 = 0; j0 < n; j0 += kValueKeys) {
    const int64_t nj = std::min(kValueKeys, n - j0);
    const int64_t ahead = std::clamp<int64_t>(n + rows_after - j0 - nj, 0, kValueKeys);  // rows of the next chunk
    const char* next = reinterpret_cast<const char*>(v + (j0 + nj) * ldv);
    const int64_t lines = ahead * ((Ev * 4 + 63) / 64);
    // one fetch spread over all the chunk's passes (a line or a few a key of
    // each) and whole passes apart from a partial last: against a fetch made
    // a pass (two divisions each) and each pass's column indices,
    // bench/lanes_rows.cpp in L2 (AMD EPYC of family 25 model 17, 20
    // alternated runs) P V 1.04x (1.00-1.08), scores and P V on two threads
    // 1.03x (1.01-1.05); the op within its build-to-build spread
    RowFetch<> fetch(next, ldv * 4, Ev * 4, 0, lines, nj * passes);
    const float* pj0 = pt.data() + 16 * j0;
    int64_t c0 = 0;
    for (int64_t pass = 0; pass < full; ++pass, c0 += 16) {
      float* oc = ot.data() + 16 * c0;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) acc[c] = _mm512_loadu_ps(oc + 16 * c);
      const float* vr = v + j0 * ldv + c0;  // (constant offsets from it: no register per column)
      const float* pj = pj0;
      const NextPassL1<float> next_pass(v, ldv, n, j0, nj, c0, Ev);
      for (int64_t j = 0; j < nj; ++j, vr += ldv, pj += 16) {
        fetch();
        next_pass(j);
        const __m512 pv = _mm512_loadu_ps(pj);
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(vr[c]), pv, acc[c]);
      }
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(oc + 16 * c, acc[c]);
    }
    if (c0 < Ev) {  // a last partial pass: columns past cols repeat the last real one (summed, never stored)
      const int64_t cols = Ev - c0;
      int64_t ci[16];
      for (int c = 0; c < 16; ++c) ci[c] = c0 + std::min<int64_t>(c, cols - 1);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) acc[c] = _mm512_loadu_ps(ot.data() + 16 * ci[c]);
      const float* vr = v + j0 * ldv + c0;
      const float* pj = pj0;
      for (int64_t j = 0; j < nj; ++j, vr += ldv, pj += 16) {
        fetch();
        const __m512 pv = _mm512_loadu_ps(pj);
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(vr[ci[c] - c0]), pv, acc[c]);
      }
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c)
        if (c < cols) _mm512_storeu_ps(ot.data() + 16 * (c0 + c), acc[c]);
    }
  }
  lanes_to_rows(ot.data(), Ev, o, ldo);
}

// O (16 x Ev) += P (16 x n) V (n x Ev) for bfloat16 value rows on
// AVX512-BF16, two keys an instruction: P rounded to bfloat16 (as
// value_block_dp in rows_values_cpu.cpp rounds it) and kept by rows, so that
// (P[r][j], P[r][j + 1]) is one 32-bit word to broadcast; the pass's 16
// columns of value rows j and j + 1 widened into the pairs
// (V[j][c], V[j + 1][c]) once, for the 16 rows' sums in 16 registers, one
// register a row (here a lane is a column: the value pairs come from
// memory as vectors, the P pairs as broadcasts, and O stays by rows). Each
// value row is read by one pass a 16 columns; the next chunk is fetched into
// L2 as in value_rows_t. A last odd key pairs with a zero row, never read.
// At most kPairKeys keys a call, P's rows kPairKeys / 2 words apart: a
// constant, so that the 16 rows' broadcasts take one base register and
// constant offsets (as score_block_t's kRows > 0).
constexpr int64_t kPairKeys = 256;
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void value_rows_bf16(
    const float* p, int64_t ldp, int64_t n, const uint16_t* v, int64_t ldv, int64_t Ev, float* o, int64_t ldo,
    int64_t rows_after) {
  constexpr int64_t np = kPairKeys / 2;  // P's row stride in key pairs
  static thread_local std::vector<uint32_t> pw;  // (16 x np): P's rows in bfloat16 pairs
  pw.resize(16 * np);
  uint32_t* const pwr = pw.data();
  for (int r = 0; r < 16; ++r)
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const __m512 lo = _mm512_maskz_loadu_ps(lanes(n - j0), p + r * ldp + j0);
      const __m512 hi = _mm512_maskz_loadu_ps(lanes(n - j0 - 16), p + r * ldp + j0 + 16);
      _mm512_mask_storeu_epi32(pwr + r * np + j0 / 2, lanes(np - j0 / 2),
                               reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  const int64_t passes = (Ev + 15) / 16;
  for (int64_t j0 = 0; j0 < n; j0 += kValueKeys) {
    const int64_t nj = std::min(kValueKeys, n - j0);
    const int64_t ahead = std::clamp<int64_t>(n + rows_after - j0 - nj, 0, kValueKeys);  // rows of the next chunk
    const char* next = reinterpret_cast<const char*>(v + (j0 + nj) * ldv);
    const int64_t lines = ahead * ((Ev * 2 + 63) / 64);
    for (int64_t c0 = 0, pass = 0; c0 < Ev; c0 += 16, ++pass) {
      RowFetch<> fetch(next, ldv * 2, Ev * 2, lines * pass / passes, lines * (pass + 1) / passes,
                     (nj + 1) / 2);  // over its key pairs
      const __mmask16 mc = lanes(Ev - c0);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_maskz_loadu_ps(mc, o + r * ldo + c0);
      const uint32_t* pj = pwr + j0 / 2;
      const NextPassL1<uint16_t> next_pass(v, ldv, n, j0, nj, c0, Ev);
      for (int64_t j = 0; j < nj; j += 2, ++pj) {
        fetch();
        next_pass(j);
        next_pass(j + 1);
        const uint16_t* va = v + (j0 + j) * ldv + c0;
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mc, va));
        const __m512i b =
            j + 1 < nj ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mc, va + ldv)) : _mm512_setzero_si512();
        const __m512 w = _mm512_castsi512_ps(_mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
          acc[r] = dp_bcast(acc[r], w, pj + r * np);
      }
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(o + r * ldo + c0, mc, acc[r]);
    }
  }
}

}  // namespace

int64_t dot_rows_lanes(const float* q, int64_t R, int64_t E, const float* k, int64_t ldk, int64_t n, float* s,
                       int64_t lds, int64_t rows_after) {
  return dot_rows_t(q, R, E, k, ldk, n, s, lds, rows_after);
}

int64_t acc_rows_lanes(const float* p, int64_t R, int64_t n, int64_t ldp, const float* v, int64_t ldv, int64_t Ev,
                       float* o, int64_t ldo, int64_t rows_after) {
  int64_t r0 = 0;
  for (; R - r0 >= 16; r0 += 16) value_rows_t(p + r0 * ldp, ldp, n, v, ldv, Ev, o + r0 * ldo, ldo, rows_after);
  return r0;
}

int64_t dot_rows_lanes_bf16(const uint16_t* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n,
                            float* s, int64_t lds, int64_t rows_after) {
  return E % 2 == 0 ? dot_rows_t(q, R, E, k, ldk, n, s, lds, rows_after) : 0;  // whole column pairs only
}

int64_t acc_rows_lanes_bf16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv,
                            int64_t Ev, float* o, int64_t ldo, int64_t rows_after) {
  int64_t r0 = 0;
  for (; R - r0 >= 16; r0 += 16)
    for (int64_t j0 = 0; j0 < n; j0 += kPairKeys) {  // (the same sums in the same order as one call)
      const int64_t nj = std::min(kPairKeys, n - j0);
      value_rows_bf16(p + r0 * ldp + j0, ldp, nj, v + j0 * ldv, ldv, Ev, o + r0 * ldo, ldo, n + rows_after - j0 - nj);
    }
  return r0;
}

}  // namespace rows
}  // namespace cpu
}  // namespace mha_ext
#endif  // MHA_X86
