// What the AVX-512 row primitives of the decode kernel share (rows_cpu.cpp and rows_values_cpu.cpp:
// a few query rows a pass; rows_lanes_cpu.cpp: 16 float32 query rows, one a
// vector lane): masks, the L1-sized value chunk, fetches into L2, and the
// entry points of the one-row-a-lane routines. Empty without MHA_X86.
#pragma once

#include <algorithm>
#include <cstdint>

#include "x86_intrinsics.h"

#if MHA_X86
namespace mha_ext {
namespace cpu {
namespace rows {

__attribute__((target("avx512f"))) inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}
// the same for 32 16-bit lanes
inline __mmask32 lanes32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1);
}

// Key (value) rows a P V chunk takes at a time: L1-sized (acc_rows_avx512).
constexpr int64_t kValueKeys = 32;

// A row of `bytes` bytes fetched into L2. With more query rows than one
// pass holds, a block's first pass reads its key (or value) rows from
// memory and the other passes from L1, which leaves memory idle meanwhile:
// with three passes or more, the second fetches the next block's rows into
// L2 for the next first pass, spread over the pass (measured in the README,
// "Decoding"; into L1, all at once before the pass, or with two passes it
// did worse, two blocks ahead no better). Rows that are not adjacent in
// memory (a (B, S, H, D) KV cache: a row every H D elements), which the
// hardware prefetcher does not follow, are fetched by the block's first
// pass where it is a pass of several rows (a row a key: 1.03-1.14x against
// all at once, K/V read from memory, 2 to 8 rows a key/value head; one row
// a head, 12 x 64 heads, fetched so: 0.72x), else all at once before it
// (fetch_rows_l2).
__attribute__((always_inline)) inline void fetch_row_l2(const void* row, int64_t bytes) {
  const char* c = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// `rows` rows of `bytes` bytes, `stride` bytes apart from `first`, fetched into L2.
inline void fetch_rows_l2(const void* first, int64_t stride, int64_t rows, int64_t bytes) {
  const char* row = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r, row += stride) fetch_row_l2(row, bytes);
}


// Rows `stride` bytes apart from `first`, fetched a few lines at each step
// of the current block or chunk: lines [lo, hi) of them, row after row (each
// row's lines in order), spread over `steps` calls (operator()); into L2
// (kHint = _MM_HINT_T1) or L1 (_MM_HINT_T0). Adjacent rows (stride = row
// bytes) are one run of lines. Uses: the next block's (chunk's) rows in the
// 16-row routines (rows_lanes_cpu.cpp), adjacent or in a (B, S, H, D) KV
// cache, whose rows (one every H D elements) the hardware prefetcher does
// not follow (spread rather than all at once before the block: 16 query rows
// a key/value head, 32 x 8 x 128 heads: float32 1.05-1.18x, bfloat16
// 1.14-1.31x); and the page-ahead fetch of rows of more than
// kPerRowColumns columns (PageFetch::first_pass).
template <int kHint = _MM_HINT_T1>
struct RowFetch {
  const char* row = nullptr;
  int64_t stride = 0, lpr = 1, col = 0, left = 0, per = 0;
  RowFetch() = default;  // fetches nothing
  RowFetch(const char* first, int64_t stride_, int64_t row_bytes, int64_t lo, int64_t hi, int64_t steps)
      : stride(stride_), lpr(std::max<int64_t>((row_bytes + 63) / 64, 1)), left(std::max<int64_t>(hi - lo, 0)) {
    row = first + lo / lpr * stride;
    col = lo % lpr;
    per = (left + steps - 1) / std::max<int64_t>(steps, 1);
  }
  // (always inlined, as PageFetch's and sum16: a call from a routine's loop
  // would put every live vector register on the stack around it, as the
  // x86-64 ABI keeps none across calls)
  __attribute__((always_inline)) void operator()() {
    for (int64_t x = 0; x < per && left > 0; ++x, --left) {
      _mm_prefetch(row + 64 * col, static_cast<_mm_hint>(kHint));
      if (++col == lpr) col = 0, row += stride;
    }
  }
};

// Adjacent rows read in address order: the same bytes a page (4 KiB) further
// on are fetched into L1 as the block's (chunk's) first pass reads them, a
// line per 64 bytes. The hardware's stream prefetcher stops at each 4 KiB
// page and learns the stream again on the next (a profile of a one-row
// bfloat16 decode put half the score routine's time on one load a block);
// fetched a page ahead, a one-row a head decode (12 x 64 heads, S = 32k) read
// bfloat16 K/V 1.7x and float32 1.3x faster (AMD EPYC family 26, the README,
// "Decoding on a newer CPU"). Into L1 did better than into L2, 2-16 KiB ahead
// within noise of each other. Called at each key with its row, in one of two
// forms, each the better of the two where measured (docs/performance.md,
// "Decoding"; rows of 64 and 128 columns, 16-bit rows against the block's
// lines at once, the former burst):
// - rows of up to kPerRowColumns columns fetch their own bytes at the row
//   (`bytes`): the block's lines issued at its start left a one-row
//   bfloat16 decode at 40% of the streaming read in one VM state (94% in
//   another), and float32 rows of 64 columns ran 1.14x in the caches
//   against the spread form (1.01-1.03x from memory). So do 16-bit rows of
//   up to kPerRowBytes bytes (128 columns) where the caller passes that
//   limit (two query rows or more a pass set): since the blocks' fixed-E
//   forms (with_fixed_page, which the spread form never takes), against
//   the spread form, interleaved (AMD EPYC of family 25 model 17, 2
//   threads, bit-identical): four bfloat16 rows of 32 x 8 x 128 heads at
//   2k keys 1.30-1.36x in the caches, float16 1.17x; over 12 layers' caches
//   (from memory, no far fetch) 0.99-1.02x; one row a head lost there
//   (0.79x) and keeps the spread form. With the far fetch too (first timed
//   at 0.89-0.90x in single calls past 32 MiB, 0.89-1.23x there since;
//   with the far fetch from 4 MiB for such rows, decode_cpu.cpp, 1.11-1.49x
//   over several layers' caches from memory, the figures there);
// - longer rows take the block's lines a few at each key (`block`, a
//   RowFetch over the same lines; the routines keep a local copy of it, in
//   registers): float32 at 128 columns 1.03-1.10x the per-row form from
//   memory (0.92x where the keys stay in the caches); bfloat16 on
//   AVX512-BF16 at 128 columns 1.09-1.20x from memory with one or two query
//   rows of 32 x 8 heads (AMD EPYC family 25), 0.95x where a batch's 8 MiB
//   stay in the caches (both before the fixed-E forms); float16 0.99-1.01x.
//
// Far: a call whose K and V would not stay in the caches from one call to the
// next (over kFromMemoryBytes, or kFarNarrowBytes for rows of at most 64
// columns, decode_cpu.cpp) also fetches each row's bytes kFarAhead further on
// into L2, so that the L1 fetch a page ahead finds them there rather than in
// memory. Against none, interleaved in one process
// (AMD EPYC family 25, 2 threads, 8-32k keys): one float32 row of 32 x 8 x 128
// heads 1.18-1.22x (K/V at the streaming read), bfloat16 1.08-1.11x; four
// float32 rows of 12 x 64 heads 1.15x; one row of 12 x 64 heads, already at
// the streaming read, 0.96-1.03x; 16-row routines (their own fetches) 1.00x.
// Ungated, 16 MiB of K/V that stayed in the caches ran 0.93x: hence the gate.
// Not in a paged pool: 24 KiB on from a block's rows lies in another block.
// Strided rows (a (B, S, H, D) cache) fetch the row kFarRows keys on instead:
// one bfloat16 row of 32 x 8 x 128 heads 1.12-1.13x, float32 1.02-1.05x,
// 16 rows a head 1.00x (16 and 64 keys on did about as well).
// 12-32 KiB ahead did about the same. docs/performance.md, "Decoding".
constexpr int64_t kFetchAhead = 4096;
constexpr int64_t kFarAhead = 24576;
constexpr int64_t kFarRows = 32;  // the far fetch of strided rows: this many keys on
constexpr int64_t kPerRowColumns = 64;
constexpr int64_t kPerRowBytes = 256;  // 16-bit rows of 128 columns
struct PageFetch {
  int64_t bytes = 0;                         // of each row, or 0
  RowFetch<_MM_HINT_T0> block;               // or the block's lines (empty by default)
  int64_t far_bytes = 0;                     // of each row fetched far_ahead bytes on, or 0
  int64_t far_ahead = kFarAhead;
  __attribute__((always_inline)) void operator()(const void* row) {
    block();
    const char* at = static_cast<const char*>(row) + kFetchAhead;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
    if (far_bytes > 0) {
      const char* on = static_cast<const char*>(row) + far_ahead;
      for (int64_t b = 0; b < far_bytes; b += 64) _mm_prefetch(on + b, _MM_HINT_T1);
    }
  }
  // The fetch of a block's (chunk's) first pass over `rows` adjacent rows
  // `stride` bytes apart from `first` (rows of elements of elem_bytes),
  // row_bytes of each read, in the form above; with the far fetch where far_fetch.
  // Rows up to per_row_bytes apart (or kPerRowColumns columns, whichever is
  // more) fetch their own bytes, with the far fetch or without.
  // Rows `stride` bytes apart that are not adjacent (a (B, S, H, D) KV
  // cache): no page-ahead fetch (their other fetches are the callers'), and
  // with far_fetch the row kFarRows keys on into L2.
  static PageFetch strided(bool far_fetch, int64_t stride, int64_t row_bytes) {
    PageFetch f;
    if (far_fetch) f.far_bytes = row_bytes, f.far_ahead = kFarRows * stride;
    return f;
  }
  static PageFetch first_pass(const void* first, int64_t stride, int64_t row_bytes, int64_t rows, int64_t elem_bytes,
                              int64_t per_row_bytes, bool far_fetch) {
    PageFetch f;
    if (far_fetch) f.far_bytes = row_bytes;
    if (stride > std::max(per_row_bytes, kPerRowColumns * elem_bytes))
      f.block = RowFetch<_MM_HINT_T0>(static_cast<const char*>(first) + kFetchAhead, stride, row_bytes, 0,
                                      rows * ((row_bytes + 63) / 64), rows);
    else
      f.bytes = row_bytes;
    return f;
  }
};

// f(page) with page's fields as constants the compiler sees, where page is
// one of the forms a pass of adjacent rows of row_bytes takes (none, the
// row's own bytes a page on, with the far fetch or without), or the far
// fetch of strided rows (a (B, S, H, D) KV cache past kFromMemoryBytes: the
// row kFarRows keys on, a distance known at run time); false otherwise.
// Strided rows with the far fetch had taken the run-time forms (E and the
// fetch loops' counts unknown): against those, interleaved in one process
// (AMD EPYC of family 25 model 17, 2 threads, kvcache_attention, bit-
// identical), one and four query rows a key/value head of 32 x 8 x 128 and
// 12 x 12 x 64 heads, float32 and bfloat16, 8k-32k keys from memory
// 1.05-1.12x; 12 x 12 x 64 bfloat16 rows 1.00x; the AVX2 path 0.98-1.03x.
// Defined for each instruction set whose routines call it (f is inlined, so
// the function needs f's target): with_fixed_page for AVX-512, and
// with_fixed_page_avx2 (rows_avx2.cpp).
#define MHA_DEFINE_WITH_FIXED_PAGE(NAME, TARGET)                                                           \
  template <typename F>                                                                                    \
  __attribute__((target(TARGET), always_inline)) inline bool NAME(const PageFetch& page, int64_t row_bytes, \
                                                                  F&& f) {                                 \
    if (page.block.left != 0) return false;                                                                \
    PageFetch c;                                                                                           \
    if (page.bytes == 0 && page.far_bytes == 0) return f(c), true;                                         \
    if (page.bytes == 0) { /* strided rows' far fetch (PageFetch::strided), its distance at run time */    \
      if (page.far_bytes != row_bytes) return false;                                                       \
      c.far_bytes = row_bytes, c.far_ahead = page.far_ahead;                                               \
      return f(c), true;                                                                                   \
    }                                                                                                      \
    if (page.far_ahead != kFarAhead) return false;                                                         \
    if (page.bytes != row_bytes || (page.far_bytes != 0 && page.far_bytes != row_bytes)) return false;     \
    c.bytes = row_bytes;                                                                                   \
    if (page.far_bytes == 0) return f(c), true;                                                            \
    c.far_bytes = row_bytes;                                                                               \
    return f(c), true;                                                                                     \
  }
MHA_DEFINE_WITH_FIXED_PAGE(with_fixed_page, "avx512f,avx512bw,avx512vl")
MHA_DEFINE_WITH_FIXED_PAGE(with_fixed_page_avx2, "avx2,fma,f16c")

// Float32 query rows in groups of 16, one a lane (rows_lanes_cpu.cpp); each
// returns how many of the R rows it took (a multiple of 16), the caller
// takes the rest; rows_after as gemm_cpu.h's (the next block or chunk past
// the n rows is fetched from them). AVX-512 only.
// S (R x n, row stride lds) = Q (R x E, dense) K^T (K: n rows, row stride ldk).
int64_t dot_rows_lanes(const float* q, int64_t R, int64_t E, const float* k, int64_t ldk, int64_t n, float* s,
                       int64_t lds, int64_t rows_after);
// O (R x Ev, row stride ldo) += P (R x n, row stride ldp) V (n rows, row stride ldv).
int64_t acc_rows_lanes(const float* p, int64_t R, int64_t n, int64_t ldp, const float* v, int64_t ldv, int64_t Ev,
                       float* o, int64_t ldo, int64_t rows_after);
// The same for bfloat16 rows on AVX512-BF16 (kind 3 of rows_cpu.cpp): Q and K
// as bit patterns (dot_rows_lanes_bf16 takes none where E is odd), V with P
// rounded to bfloat16.
int64_t dot_rows_lanes_bf16(const uint16_t* q, int64_t R, int64_t E, const uint16_t* k, int64_t ldk, int64_t n,
                            float* s, int64_t lds, int64_t rows_after);
int64_t acc_rows_lanes_bf16(const float* p, int64_t R, int64_t n, int64_t ldp, const uint16_t* v, int64_t ldv,
                            int64_t Ev, float* o, int64_t ldo, int64_t rows_after);

}  // namespace rows
}  // namespace cpu
}  // namespace mha_ext
#endif  // MHA_X86
