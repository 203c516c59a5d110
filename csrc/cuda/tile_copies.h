// Global -> shared tile copies of the CUDA attention kernels: the plain
// element-by-element copy (load_tile) and the cp.async forms (load_tile_async,
// load_whole_tile_async, load_tile_async_fixed), with the zero padding of rows
// and columns past the matrix. Included by warp_tiles.h; written only against
// simt.h / mma.h, like the kernels.
#pragma once

#include "mma.h"

#include <cstdint>

namespace mha_ext::device {

using namespace mha_ext::simt;

// Copies rows [r0, r0 + rows) x cols [0, cols) of a strided global matrix
// into a (kRows x kCols) shared tile with row stride ld, zero elsewhere.
template <typename T>
MHA_DEVICE void load_tile(T* dst, int ld, int k_rows, int k_cols, const T* src, int64_t rs, int64_t cs,
                          int64_t r0, int64_t rows, int64_t cols) {
  const int n = k_rows * k_cols, step = static_cast<int>(block_dim().x);
  for (int idx = static_cast<int>(thread_idx().x); idx < n; idx += step) {
    const int r = idx / k_cols, c = idx % k_cols;
    const bool valid = r0 + r < rows && c < cols;
    dst[r * ld + c] = valid ? src[(r0 + r) * rs + c * cs] : to_elem<T>(0.f);
  }
}

// The same copy issued asynchronously: 16-byte cp.async chunks where the
// source rows are contiguous and 16-byte aligned (the common case), plain
// stores for the rest (strided or misaligned inputs, the zero padding, a
// partial last chunk). The caller commits the group and waits for it before
// a barrier: cp.async data lands at the wait, the plain stores are visible
// after the barrier. kStepped: the whole-tile loop below with pointers
// stepped instead of an index divided (the plain forward kernel's copies).
template <typename T, bool kStepped = false>
MHA_DEVICE void load_tile_async(T* dst, int ld, int k_rows, int k_cols, const T* src, int64_t rs, int64_t cs,
                                int64_t rows, int64_t cols) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool vec = cs == 1 && (rs * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (!vec) return load_tile(dst, ld, k_rows, k_cols, src, rs, cs, 0, rows, cols);
  const int chunks = k_cols / kVec, n = k_rows * chunks, step = static_cast<int>(block_dim().x);
  // (float16 / bfloat16: in the float and double kernels the extra loop cost
  // registers, float's dQ 16 -> 8 warps per SM on sm_90, double new spills)
  if (sizeof(T) == 2 && rows >= k_rows && cols == k_cols && step % chunks == 0) {
    // a whole tile (every key tile but a sequence's last, at head dims 64 /
    // 128 / 256): no bounds tests, unsigned index arithmetic (19 SASS
    // instructions a chunk on sm_90, 3 of them the never-executed loads nvcc
    // puts before each cp.async; the general loop below takes 39)
    const unsigned uchunks = static_cast<unsigned>(chunks);
    if constexpr (kStepped) {
      // each thread copies one column chunk of rows step / chunks apart, two
      // pointers stepped a pass: 12 SASS instructions a chunk (3 of them those
      // loads). In the general forward kernel it cost registers (head dim 64:
      // 168 -> 173 on sm_90, 12 -> 8 warps per SM), so only the plain one asks.
      const unsigned tid = thread_idx().x, rstep = static_cast<unsigned>(step) / uchunks;
      unsigned r = tid / uchunks;
      T* d = dst + r * static_cast<unsigned>(ld) + (tid % uchunks) * kVec;
      const T* s = src + static_cast<int64_t>(r) * rs + (tid % uchunks) * kVec;
      const unsigned d_step = rstep * static_cast<unsigned>(ld);
      const int64_t s_step = static_cast<int64_t>(rstep) * rs;
      for (; r < static_cast<unsigned>(k_rows); r += rstep, d += d_step, s += s_step) cp_async_16(d, s);
    } else {
      for (unsigned idx = thread_idx().x; idx < static_cast<unsigned>(n); idx += static_cast<unsigned>(step)) {
        const unsigned r = idx / uchunks, c = (idx % uchunks) * kVec;
        cp_async_16(dst + r * static_cast<unsigned>(ld) + c, src + static_cast<int64_t>(r) * rs + c);
      }
    }
    return;
  }
  for (int idx = static_cast<int>(thread_idx().x); idx < n; idx += step) {
    const int r = idx / chunks, c = (idx % chunks) * kVec;
    T* d = dst + r * ld + c;
    if (r < rows && c + kVec <= cols) {
      cp_async_16(d, src + r * rs + c);
    } else {
MHA_UNROLL
      for (int x = 0; x < kVec; ++x) d[x] = (r < rows && c + x < cols) ? src[r * rs + c + x] : to_elem<T>(0.f);
    }
  }
}

// A whole kRows x kCols tile of a 16-bit type by cp.async, where the caller
// has checked once what load_tile_async checks at every call (unit column
// stride, 16-byte aligned rows, kCols columns) and, per tile, that the rows
// are all there, and whole_tile_rounds_even: the block's threads cover the
// column chunks by whole rows an even number of times. Each thread copies
// one column chunk of rows block_dim / chunks apart, two a pass from two
// stepped pointers. (The plain forward kernel at head dim 64: its K/V copies
// by load_tile_async's stepped loop took 11 SASS instructions a chunk on
// sm_90 and about 50 more a call in those checks and their set-up; this took
// that kernel 0.91-0.94 of the time before on an H200, bench/cuda_ab.py,
// 2026-11-28. At head dim 128 it took 1.03-1.08 of it: more spills, 140 ->
// 172 bytes on sm_90; it stays off there.)
template <typename T, int kRows, int kCols>
MHA_DEVICE bool whole_tile_rounds_even() {
  constexpr unsigned kChunks = kCols / (16 / sizeof(T));
  const unsigned step = block_dim().x;
  return step % kChunks == 0 && (kRows / (step / kChunks)) % 2 == 0 && kRows % (step / kChunks) == 0;
}
template <typename T, int kRows, int kCols>
MHA_DEVICE void load_whole_tile_async(T* dst, int ld, const T* src, int64_t rs) {
  constexpr unsigned kVec = 16 / sizeof(T), kChunks = kCols / kVec;
  const unsigned tid = thread_idx().x, rstep = block_dim().x / kChunks;
  unsigned r = tid / kChunks;
  T* d = dst + r * static_cast<unsigned>(ld) + (tid % kChunks) * kVec;
  const T* s = src + static_cast<int64_t>(r) * rs + (tid % kChunks) * kVec;
  const unsigned d_step = rstep * static_cast<unsigned>(ld);
  const int64_t s_step = static_cast<int64_t>(rstep) * rs;
  for (; r < static_cast<unsigned>(kRows); r += 2 * rstep, d += 2 * d_step, s += 2 * s_step) {
    cp_async_16(d, s);
    cp_async_16(d + d_step, s + s_step);
  }
}

// load_tile_async of a kRows x kCols tile by a block of kThreads threads,
// all known at compile time (the backward's tiles). A whole 16-bit tile
// whose chunks the threads cover by rows takes a fixed number of rounds,
// unrolled: each thread copies the same column chunk of rows kRowStep apart,
// so a round is one cp.async at constant offsets from two pointers. Other
// tiles as load_tile_async.
template <typename T, int kRows, int kCols, int kThreads>
MHA_DEVICE void load_tile_async_fixed(T* dst, int ld, const T* src, int64_t rs, int64_t cs, int64_t rows,
                                      int64_t cols) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T)), kChunks = kCols / kVec;
  constexpr int kRowStep = kThreads / kChunks > 0 ? kThreads / kChunks : 1;
  if constexpr (sizeof(T) == 2 && kThreads % kChunks == 0 && kRows % kRowStep == 0) {
    const bool whole = cs == 1 && (rs * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(src) % 16 == 0 && rows >= kRows && cols == kCols;
    if (whole) {
      const int tid = static_cast<int>(thread_idx().x), r = tid / kChunks, c = (tid % kChunks) * kVec;
      T* d = dst + r * ld + c;
      const T* s = src + r * rs + c;
      const int64_t step = kRowStep * rs;
MHA_UNROLL
      for (int i = 0; i < kRows / kRowStep; ++i) cp_async_16(d + i * kRowStep * ld, s + i * step);
      return;
    }
  }
  load_tile_async(dst, ld, kRows, kCols, src, rs, cs, rows, cols);
}

}  // namespace mha_ext::device
