// The one score policy of the CUDA kernels: which keys a row sees (interior_tile and
// masked_score), the score transform of the attention variants
// (masked_score, score_slope), the softmax units (base 2 for float
// accumulation) and the plain path's test (plain_scores), and the dropout
// draws of a fragment (Philox, as the CPU kernels draw them).
#pragma once

#include "../attention_params.h"
#include "../dropout.h"
#include "warp_tiles.h"

namespace mha_ext::device {

using namespace mha_ext::simt;

// The one score transform of the CUDA kernels (AttentionVariant): the score
// of query row i and key column j of head (b, h) from the raw dot product s:
// scaled, softcapped, ALiBi, the mask, and -inf where the row may not see
// the key (causal alignment and window).
template <typename T, typename A>
MHA_DEVICE A masked_score(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j, A s) {
  const AttentionVariant& w = p.variant;
  A x = s * static_cast<A>(p.scale);
  if (w.softcap > 0.0) x = static_cast<A>(w.softcap) * ftanh(x / static_cast<A>(w.softcap));
  if (w.alibi != nullptr) {
    const int64_t d = i + w.diag_offset - j;
    x -= static_cast<const A*>(w.alibi)[b * w.alibi_stride_b + h * w.alibi_stride_h] * static_cast<A>(d < 0 ? -d : d);
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t off = b * p.mask_stride.b + h * p.mask_stride.h + i * p.mask_stride.row + j * p.mask_stride.col;
    if (p.mask_kind == MaskKind::kBool) {
      if (!as<bool>(p.mask)[off]) x = -INFINITY;
    } else {
      x += static_cast<A>(to_float(as<T>(p.mask)[off]));
    }
  }
  if (j < w.begin(i) || j >= w.end(i, p.len_kv)) x = -INFINITY;
  return x;
}

// Columns of a bool mask: whether any of `rows` rows from m0 (row stride rs,
// column stride cs) shows column x.
struct MaskColumns {
  const bool* m0;
  int64_t rs, cs;
  int rows;
  MHA_DEVICE bool operator()(int x) const {
    bool any = false;
    for (int r = 0; r < rows && !any; ++r) any = m0[r * rs + x * cs];
    return any;
  }
};

// The smallest and the largest column of [0, n) that `shown` shows (n and
// -1 where it shows none), found by every thread of the block: each scans
// from both ends, a column a thread, and stops at its first shown one; the
// block's result lands in scratch[2 warps] and scratch[2 warps + 1] (shared
// memory: two ints a warp and two more; two barriers).
MHA_DEVICE void block_shown_span(const MaskColumns& shown, int n, int* scratch) {
  const int tid = static_cast<int>(thread_idx().x), threads = static_cast<int>(block_dim().x);
  int lo = n, last = -1;
  for (int x = tid; x < n; x += threads)
    if (shown(x)) {
      lo = x;
      break;
    }
  for (int x = n - 1 - tid; x >= 0; x -= threads)
    if (shown(x)) {
      last = x;
      break;
    }
  for (int d = kWarpSize / 2; d > 0; d /= 2) {
    const int other_lo = shfl_xor(lo, d), other_last = shfl_xor(last, d);
    lo = other_lo < lo ? other_lo : lo;
    last = other_last > last ? other_last : last;
  }
  const int warps = (threads + kWarpSize - 1) / kWarpSize;
  if (tid % kWarpSize == 0) scratch[2 * (tid / kWarpSize)] = lo, scratch[2 * (tid / kWarpSize) + 1] = last;
  sync_threads();
  if (tid == 0) {
    for (int w = 1; w < warps; ++w) {
      lo = scratch[2 * w] < lo ? scratch[2 * w] : lo;
      last = scratch[2 * w + 1] > last ? scratch[2 * w + 1] : last;
    }
    scratch[2 * warps] = lo;
    scratch[2 * warps + 1] = last;
  }
  sync_threads();
}

// The keys [first, end) of [j_lo, j_hi) from the first to the last one a
// bool mask shows some row i_lo .. i_hi of head (b, h), or [j_hi, j_lo)
// where it shows none (first rounded down to `align`), by every thread of
// the block (block_shown_span; scratch: its shared memory, free until the
// call returns). The block's result is read from the two words thread 0
// wrote by every thread, so that ptxas knows it for a value of the block:
// taken from each thread's own reduction, the decode kernel spilled. A
// decode step against transformers' StaticCache, whose rows past its length
// the mask hides, then reads only the rows written, and a left-padded
// batch's step skips its padding keys (as the CPU kernels,
// kernel_common_cpu.h's bool_mask_hides_tile).
MHA_DEVICE void bool_mask_keys_range(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i_lo, int64_t i_hi,
                                     int64_t j_lo, int64_t j_hi, int64_t align, int* scratch, int64_t& first,
                                     int64_t& end) {
  const int64_t rs = p.mask_stride.row, cs = p.mask_stride.col;
  const MaskColumns shown{as<bool>(p.mask) + b * p.mask_stride.b + h * p.mask_stride.h + i_lo * rs + j_lo * cs, rs, cs,
                          rs == 0 ? 1 : static_cast<int>(i_hi - i_lo + 1)};  // (rows a broadcast repeats, once)
  block_shown_span(shown, static_cast<int>(j_hi - j_lo), scratch);
  const int warps = (static_cast<int>(block_dim().x) + kWarpSize - 1) / kWarpSize;
  const int block_lo = scratch[2 * warps], block_last = scratch[2 * warps + 1];  // (one address each)
  sync_threads();  // every thread has read them before the scratch is used again
  first = block_last < 0 ? j_hi : (j_lo + block_lo) / align * align;
  end = j_lo + block_last + 1;
}

// A bool mask's shown ranges, found before the forward and backward
// launches (launch.h): for each block of `group` along one index of the
// mask (a kernel's query block of rows, or key block) the range [lo, hi) of
// the other index (keys, or rows) that it shows to some of the block; lo =
// len_x, hi = 0 where it shows none. The general forward and the dQ kernel
// take their key tiles from the first key to the last one shown, the
// key-block backward its query tiles from the first row to the last one
// shown (narrow_to_mask_range): a StaticCache's rows past its length, a
// left-padded batch's leading keys, and under a causal or banded mask given
// as a bool mask the tiles past the band are neither read nor computed, as
// the CPU kernels skip tiles a bool mask hides (kernel_common_cpu.h's
// bool_mask_hides_tile); a non-finite value there no longer reaches the
// output. One pass over the mask: the block's threads scan its columns from
// both ends of the scanned index at once and stop at the first shown one (a
// StaticCache's hidden rows are read from the end up to its last written one).
struct MaskRangeParams {
  const bool* mask = nullptr;
  int64_t stride_b = 0, stride_h = 0;  // the mask's, in elements (0: broadcast)
  int64_t stride_g = 0, stride_x = 0;  // along the grouped and the scanned index
  int64_t heads = 1;                   // the mask's heads (1 where broadcast)
  int len_g = 0, len_x = 0;            // extents of the grouped and the scanned index
  int group = 16;                      // indices of the grouped index a range
  int32_t* out = nullptr;              // (batches, heads, groups, 2): lo, hi
};
// the ranges a (batch, head) pair has: one where the grouped index broadcasts
MHA_HOST_DEVICE int64_t mask_groups(int64_t stride_g, int64_t len_g, int64_t group) {
  return stride_g == 0 ? 1 : (len_g + group - 1) / group;
}

// Grid: a block a group of each (batch, head) pair of the mask, groups
// fastest; kWarps warps a block; shared: block_shown_span's.
template <int kWarps>
MHA_KERNEL mask_ranges_kernel(const MaskRangeParams p) {
  const int64_t groups = mask_groups(p.stride_g, p.len_g, p.group);
  const int64_t bh = block_idx().x / groups, g = block_idx().x % groups;
  const int g0 = static_cast<int>(g) * p.group;
  const MaskColumns shown{p.mask + bh / p.heads * p.stride_b + bh % p.heads * p.stride_h + g0 * p.stride_g, p.stride_g,
                          p.stride_x, p.stride_g == 0 ? 1 : (p.len_g - g0 < p.group ? p.len_g - g0 : p.group)};
  int* scratch = dynamic_shared<int>();
  block_shown_span(shown, p.stride_x == 0 ? 1 : p.len_x, scratch);  // (a broadcast index: its one entry stands for all)
  if (thread_idx().x != 0) return;
  int lo = scratch[2 * kWarps], hi = scratch[2 * kWarps + 1] + 1;
  if (p.stride_x == 0 && hi > lo) lo = 0, hi = p.len_x;
  if (hi <= lo) lo = p.len_x, hi = 0;
  int32_t* out = p.out + 2 * (bh * groups + g);
  out[0] = lo;
  out[1] = hi;
}

// [first, end) narrowed to the range of the block of `group` indices of the
// grouped index (rows, or keys where keys_grouped) that starts at `start`,
// of (b, h) (mask_ranges_kernel's out for the mask's strides s, which
// extend len_g along the grouped index): first = max(first, lo rounded down
// to align), end = min(end, hi). Called by every thread of the block. With
// `scratch` (two words of shared memory, free until the call returns; two
// barriers) thread 0 reads the range and every thread reads the result back
// from there, else every thread reads the range itself; each kernel takes
// the form its registers allow (ptxas, scripts/kernel_report.py): read
// directly, the loop bounds of the key-block backward left ptxas's uniform
// registers and its 16-bit kernels at head dim 64 went from 0 to 76 bytes of
// spill stores on sm_90 (the backward kernels read back from shared memory,
// at their registers of before within 2); read back, the general forward
// went from 168 to 200 registers on sm_90 at head dim 64 (12 -> 8 warps a
// multiprocessor) and spilled at 256 (it reads directly: registers as before
// at head dims 64 and 128, 244 -> 254 on sm_90 at 256, no spill).
MHA_DEVICE void narrow_to_mask_range(const int32_t* ranges, const Strides4& s, bool keys_grouped, int64_t heads,
                                     int64_t len_g, int64_t group, int64_t b, int64_t h, int64_t start,
                                     int64_t align, int64_t& first, int64_t& end, int64_t* scratch) {
  auto narrow = [&](int64_t& f, int64_t& e) {
    const int64_t stride_g = keys_grouped ? s.col : s.row, groups = mask_groups(stride_g, len_g, group);
    const int32_t* r = ranges + 2 * (((s.b == 0 ? 0 : b) * (s.h == 0 ? 1 : heads) + (s.h == 0 ? 0 : h)) * groups +
                                     (stride_g == 0 ? 0 : start / group));
    const int64_t lo = r[0] / align * align, hi = r[1];
    f = lo > f ? lo : f;
    e = hi < e ? hi : e;
  };
  if (scratch == nullptr) {
    narrow(first, end);
    return;
  }
  if (thread_idx().x == 0) {
    narrow(first, end);
    scratch[0] = first;
    scratch[1] = end;
  }
  sync_threads();
  first = scratch[0];
  end = scratch[1];
  sync_threads();  // every thread has read them before the scratch is used again
}

// Whether every score of rows [i_lo, i_hi] and keys [j_lo, j_hi] is the
// scaled dot product alone: inside the lengths and the causal / window band,
// no mask, no softcap or ALiBi. Such tiles skip masked_score's per-element
// checks (edge and diagonal tiles take them).
MHA_DEVICE bool interior_tile(const AttentionFwdParams& p, int64_t i_lo, int64_t i_hi, int64_t j_lo, int64_t j_hi) {
  return p.mask_kind == MaskKind::kNone && !p.variant.changes_scores() && i_hi < p.len_q && j_hi < p.len_kv &&
         p.variant.begin(i_hi) <= j_lo && p.variant.end(i_lo, p.len_kv) > j_hi;
}

// The forward's softmax units: base 2 for float accumulation (exp2, the
// scale times log2(e) folded into the scores), base e for double.
// from_nats: a score in these units; a finite score that would overflow
// (finfo.min padding in a float mask) is clamped to the largest finite value,
// so a row padded everywhere stays uniform instead of "masked out" (as the
// CPU kernels' mask_in_units).
template <typename A>
struct SoftmaxUnits {
  static constexpr A kPerNat = A(1);
  MHA_DEVICE static A from_nats(A x) { return x; }
  MHA_DEVICE static A scaled(A x, A scale) { return x * scale; }
  MHA_DEVICE static A exp(A x) { return fexp(x); }
  MHA_DEVICE static A log(A x) { return flog(x); }
};
template <>
struct SoftmaxUnits<float> {
  static constexpr float kPerNat = 1.4426950408889634f;  // log2(e)
  static constexpr float kMax = 3.40282347e+38f;
  MHA_DEVICE static float from_nats(float x) {
    const float u = fmul_rn(x, kPerNat);  // never fused into a later subtraction: scaled's bits
    return (u < -kMax && x >= -kMax) ? -kMax : ((u > kMax && x <= kMax) ? kMax : u);
  }
  MHA_DEVICE static float exp(float x) { return fexp2(x); }
  MHA_DEVICE static float log(float x) { return flog2(x); }
  // from_nats(x * scale) where that product does not overflow: the same
  // bits (two roundings, neither multiply fused), without the clamp
  MHA_DEVICE static float scaled(float x, float scale) { return fmul_rn(fmul_rn(x, scale), kPerNat); }
};

// Whether a warp's tile of raw dot products s (the C fragments of S = Q K^T)
// may take the plain softmax: float16 / bfloat16, an interior tile (no mask,
// softcap, ALiBi or bounds inside it), scale > 0, and every s finite and
// finite once scaled (one NaN-propagating max of |s| a score and a vote).
// Then each score in the softmax's units is SoftmaxUnits::scaled(s, scale),
// the bits the exact path's from_nats(s * scale) gives, so a row's tiles and
// its backward agree whichever path each took; the forward's probabilities
// are exp2(u - m) and the backward's exp2(min(u - shift, 0) - log_norm),
// with no clamp, NaN test or branch per score. interior and scale are the
// same on every lane, so every lane votes. (float and double keep the exact
// path: the plain one cost them registers.)
template <typename T, int N, typename A>
MHA_DEVICE bool plain_scores(const A (&s)[N][4], bool interior, A scale) {
  if constexpr (sizeof(T) == 2) {
    if (!interior || !(scale > A(0))) return false;
    A amax = A(0);
MHA_UNROLL
    for (int t = 0; t < N; ++t)
MHA_UNROLL
      for (int e = 0; e < 4; ++e) amax = nan_max(amax, fabsf(s[t][e]));
    // both roundings are monotonic: no |s| of the tile scales past amax's
    return vote_all(SoftmaxUnits<A>::scaled(amax, scale) <= SoftmaxUnits<A>::kMax);  // false for NaN
  }
  return false;
}

// The forward's plain softmax with the scale folded into one FMA a score
// (float16 / bfloat16, an interior tile as plain_scores asks, scale > 0):
// each probability is exp2(fma(s, c, -m)), with c = scale log2(e) rounded
// once (scaled(1, scale)) and m the row's running max in those units, where
// the exact path takes two multiplies and a subtraction. Allowed when the
// lane's max of each of its two rows' raw dot products (max.NaN: a NaN score
// fails), times c, lies within +-kFmaScoreMax on every lane (a vote: the
// warp stays on one path), or is -inf where the caller allows it (empty_ok:
// an edge tile's row that sees none of its keys, which the caller set to
// -inf, and that has a finite running max m, so that its scores give
// exp2(-inf) = 0, or lies past L, whose output is never written); row_max
// then holds those two maxima times c. So
// a row's max key is exp2 of the FMA's one rounding of fl(s c) - s c, within
// 2^-15 of 2^0 (the exact path: exactly 2^0), and the backward, which
// recomputes the scores as scaled(s, scale), is within 2^-14 of these in
// the exponent at the keys that count; a score of -inf, or one far below
// the max, gives 0 as there. Larger maxima, and +-inf, take the exact path.
constexpr float kFmaScoreMax = 512.0f;
template <typename T, int N, typename A>
MHA_DEVICE bool fma_scores(const A (&s)[N][4], bool interior, A c, A (&row_max)[2], bool empty_ok0 = false,
                           bool empty_ok1 = false) {
  if constexpr (sizeof(T) == 2) {
    if (!interior || !(c > A(0))) return false;
    // two chains a row (even and odd t), half as long as one
    A m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
MHA_UNROLL
    for (int t = 0; t < N; ++t)
MHA_UNROLL
      for (int e = 0; e < 4; ++e) m[e / 2][t % 2] = nan_max(m[e / 2][t % 2], s[t][e]);
    row_max[0] = fmul_rn(nan_max(m[0][0], m[0][1]), c);
    row_max[1] = fmul_rn(nan_max(m[1][0], m[1][1]), c);
    auto within = [](A x, bool empty_ok) { return fabsf(x) <= kFmaScoreMax || (empty_ok && x == A(-INFINITY)); };
    return vote_all(within(row_max[0], empty_ok0) && within(row_max[1], empty_ok1));  // false for NaN
  }
  return false;
}

// d(score) / d(scale * dot product): the softcap's 1 - tanh^2, else 1.
template <typename A>
MHA_DEVICE A score_slope(const AttentionFwdParams& p, A s) {
  if (!(p.variant.softcap > 0.0)) return A(1);
  const A t = ftanh(s * static_cast<A>(p.scale) / static_cast<A>(p.variant.softcap));
  return A(1) - t * t;
}

// dropout.h's stream: the (seed, offset) a kernel resolved at its start
// (from values or device memory, see DropoutParams), and whether element
// (b, h, i, j) is kept.
struct DropoutKey {
  uint64_t seed = 0, offset = 0;
  DropoutFrame frame;
};
MHA_DEVICE DropoutKey dropout_key(const DropoutParams& d) {
  return d.enabled() ? DropoutKey{d.seed_value(), d.offset_value(), dropout_frame(d)} : DropoutKey{};
}
// the row's draws are those of its lse entry's index (or of its row in the
// frame), as on the CPU
MHA_DEVICE uint64_t dropout_row(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h, int64_t i) {
  return p.dropout_row(key.frame, b, h, i);
}
// the draws of the call's column j: those of column j + col0 of the frame
MHA_DEVICE Philox4 dropout_draws(const DropoutKey& key, uint64_t row, int64_t j) {
  return philox4x32_10(key.seed, row, key.offset + static_cast<uint64_t>((j + key.frame.col0) >> 2));
}
// word w & 3 of a draw, by selects: indexing the array with a run-time value
// would put the four words on the stack
MHA_DEVICE uint32_t philox_word(const Philox4& r, int64_t w) {
  const int64_t i = w & 3;
  return i == 0 ? r.w[0] : i == 1 ? r.w[1] : i == 2 ? r.w[2] : r.w[3];
}
MHA_DEVICE bool dropout_keep(const DropoutParams& d, const DropoutKey& key, uint64_t row, int64_t j) {
  return philox_word(dropout_draws(key, row, j), j + key.frame.col0) >= d.drop_threshold;
}

// The keep bits of one 16 x 8 C fragment, bit e for element e (rows g, g,
// g + 8, g + 8; columns 2c, 2c + 1, 2c, 2c + 1; lane 4g + c), drawn by the
// lanes together: where the frame keeps Philox blocks on 4-column boundaries
// of the fragment, each lane draws one block and passes words to the lanes
// that need them, one Philox call per 4 elements (otherwise each element's
// own block, as on the CPU). Every lane of the warp must call it.
//
// Fragment rows are query rows i_lo = base + g (and + 8), columns keys j8 ..
// j8 + 7 (forward, dQ kernel): lanes c and c ^ 1 cover 4 keys, one block per
// row; lane c even draws row g's, odd row g + 8's, and each passes the
// other the two words it needs.
MHA_DEVICE unsigned dropout_bits_query_rows(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h,
                                            int64_t i_lo, int64_t j8, int lane) {
  const uint32_t thr = p.dropout.drop_threshold;
  const int c = lane % 4;
  unsigned bits = 0;
  if ((key.frame.col0 & 3) == 0 && (j8 & 3) == 0) {
    const bool odd = c & 1;
    const Philox4 w = dropout_draws(key, dropout_row(p, key, b, h, odd ? i_lo + 8 : i_lo), j8 + 4 * (c / 2));
    const uint32_t got0 = shfl_xor(odd ? w.w[0] : w.w[2], 1), got1 = shfl_xor(odd ? w.w[1] : w.w[3], 1);
    const uint32_t k0 = odd ? got0 : w.w[0], k1 = odd ? got1 : w.w[1];  // row g, columns 2c, 2c + 1
    const uint32_t k2 = odd ? w.w[2] : got0, k3 = odd ? w.w[3] : got1;  // row g + 8
    bits = unsigned(k0 >= thr) | unsigned(k1 >= thr) << 1 | unsigned(k2 >= thr) << 2 | unsigned(k3 >= thr) << 3;
  } else {
    for (int e = 0; e < 4; ++e)
      bits |= unsigned(dropout_keep(p.dropout, key, dropout_row(p, key, b, h, i_lo + 8 * (e / 2)), j8 + 2 * c + e % 2))
              << e;
  }
  return bits;
}

// Fragment rows are keys j_lo = base + g (and + 8), columns query rows i8 ..
// i8 + 7 (the key-block kernel's S^T): lanes g = 4q + r, r = 0 .. 3, of a
// column pair need the same four blocks (queries 2c + (r & 1), keys of g +
// 8 (r >> 1)), word r of each; lane r draws block r and a 4 x 4 transpose
// across the four lanes (lane ^ 8, then lane ^ 4) hands each its words.
MHA_DEVICE unsigned dropout_bits_key_rows(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h,
                                          int64_t j_lo, int64_t i8, int lane) {
  const uint32_t thr = p.dropout.drop_threshold;
  const int c = lane % 4, r = (lane / 4) % 4, hi = r >> 1, lo = r & 1;
  unsigned bits = 0;
  if ((key.frame.col0 & 3) == 0 && ((j_lo - r) & 3) == 0) {
    const Philox4 w = dropout_draws(key, dropout_row(p, key, b, h, i8 + 2 * c + lo), j_lo - r + 8 * hi);
    // to lane r ^ 2 the words it keeps (2 hi', 2 hi' + 1); from it, block r ^ 2's words 2 hi, 2 hi + 1
    const uint32_t a0 = hi ? w.w[2] : w.w[0], a1 = hi ? w.w[3] : w.w[1];
    const uint32_t x0 = shfl_xor(hi ? w.w[0] : w.w[2], 8), x1 = shfl_xor(hi ? w.w[1] : w.w[3], 8);
    // to lane r ^ 1 the words it needs (index 1 - lo of the pairs); word r of blocks r .. r ^ 3
    const uint32_t own_a = lo ? a1 : a0, own_b = lo ? x1 : x0;
    const uint32_t got_a = shfl_xor(lo ? a0 : a1, 4), got_b = shfl_xor(lo ? x0 : x1, 4);
    for (int e = 0; e < 4; ++e) {
      const int d = e ^ r;  // block e is block r ^ d
      const uint32_t word = d == 0 ? own_a : d == 1 ? got_a : d == 2 ? own_b : got_b;
      bits |= unsigned(word >= thr) << e;
    }
  } else {
    for (int e = 0; e < 4; ++e)
      bits |= unsigned(dropout_keep(p.dropout, key, dropout_row(p, key, b, h, i8 + 2 * c + e % 2), j_lo + 8 * (e / 2)))
              << e;
  }
  return bits;
}

// The keep bits of kTiles fragments side by side, 8 columns apart from
// column col0 (row_lo: the fragment row of lane's g), 4 each as above, drawn
// in a loop that is not unrolled (the draws one after another, not all live
// at once); 0 without dropout. kKeyRows: the fragments' rows are keys.
template <int kTiles, bool kKeyRows>
MHA_DEVICE uint32_t dropout_tile_bits(const AttentionFwdParams& p, const DropoutKey& key, int64_t b, int64_t h,
                                      int64_t row_lo, int64_t col0, int lane) {
  static_assert(4 * kTiles <= 32);
  if (!p.dropout.enabled()) return 0;
  uint32_t keep = 0;
MHA_NO_UNROLL
  for (int t = 0; t < kTiles; ++t)
    keep |= (kKeyRows ? dropout_bits_key_rows(p, key, b, h, row_lo, col0 + 8 * t, lane)
                      : dropout_bits_query_rows(p, key, b, h, row_lo, col0 + 8 * t, lane))
            << (4 * t);
  return keep;
}

}  // namespace mha_ext::device
