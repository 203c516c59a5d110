// The CUDA backward: D = rowsum(dO * O) with the rows' softmax statistics
// (attention_bwd_dot_kernel), the key-block kernel (dK, dV, atomic dQ) and
// the deterministic dQ kernel. Layout and design: attention_kernels.h.
#pragma once

#include "score_policy.h"
#include "warp_tiles.h"

namespace mha_ext::device {

using namespace mha_ext::simt;

// ---------------------------------------------------------------------------
// Backward, shared by the key-block kernel and the dQ kernel: the probability
// (after dropout) and dS of element (i, j) from its raw score s and dP, with
// the row's shift and log_norm (AttentionBwdParams::row_shift: lse and 0, or
// the row's exact max and log(sum), in the forward's softmax units: base 2 in
// float, as the forward's exponentials); the min keeps P <= 1 where the row
// statistics and this score were summed in different orders.
// The mask gradient (dS itself) goes to grad_mask when that is not null.
// In an interior tile (interior_tile) the score is only scaled. keep: the
// element's dropout bit (read when dropout is on).
template <typename T, typename A>
MHA_DEVICE void prob_and_grad(const AttentionBwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j, A s, A dp,
                              A shift, A log_norm, A d, bool interior, bool keep, A* grad_mask, A& prob, A& ds) {
  prob = A(0);
  ds = A(0);
  using Units = SoftmaxUnits<A>;  // the forward's units (exp2 in float), shift and log_norm in them too
  if (shift == A(-INFINITY) || (!interior && (i >= p.len_q || j >= p.len_kv))) return;  // fully masked row: no gradient
  const A x = Units::from_nats(interior ? s * static_cast<A>(p.scale) : masked_score<T>(p, b, h, i, j, s)) - shift;
  A pr = Units::exp((x < A(0) ? x : A(0)) - log_norm);
  if (p.dropout.enabled()) {
    // O = sum_j P_j z_j V_j / (1 - p): dP_j picks up z_j / (1 - p), and dV takes the dropped P.
    const A rescale = static_cast<A>(p.dropout.rescale);
    dp = keep ? dp * rescale : A(0);
    ds = pr * (dp - d);
    pr = keep ? pr * rescale : A(0);
  } else {
    ds = pr * (dp - d);
  }
  prob = pr;
  if (grad_mask != nullptr) grad_mask[((b * p.heads_q + h) * p.len_q + i) * p.len_kv + j] = ds;
  ds *= score_slope(p, s);  // what dQ and dK take
}

// Score of query row i against key j of head (b, h), a dot product on the
// CUDA cores (the exact row statistics below).
// prob_and_grad on a tile plain_scores allowed, with no dropout and no mask
// gradient to write: the probability exp2(min(scaled(s) - shift, 0) -
// log_norm) and dS = P (dP - D); nothing for a fully masked row.
template <typename T, typename A>
MHA_DEVICE void plain_prob_and_grad(A s, A dp, A shift, A log_norm, A d, A scale, A& prob, A& ds) {
  const A x = SoftmaxUnits<A>::scaled(s, scale) - shift;
  const bool row = shift != A(-INFINITY);
  prob = row ? softmax_exp2<T>((x < A(0) ? x : A(0)) - log_norm) : A(0);
  ds = row ? prob * (dp - d) : A(0);
}

template <typename T, typename A>
MHA_DEVICE A row_score(const AttentionFwdParams& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  const T* q = as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h + i * p.q_stride.row;
  const T* k = as<T>(p.k) + b * p.k_stride.b + (h / p.group_size()) * p.k_stride.h + j * p.k_stride.row;
  A s = A(0);
  for (int64_t e = 0; e < p.head_dim; ++e)
    s += static_cast<A>(to_float(q[e * p.q_stride.col])) * static_cast<A>(to_float(k[e * p.k_stride.col]));
  return masked_score<T>(p, b, h, i, j, s);
}

// row_dot[(b, h, i)] = sum_e dO[i, e] * O[i, e], and the row's row_shift /
// row_log_norm: lse and 0, or where lse_needs_exact_stats the row's max and
// log(sum) from a pass over its keys, a key per lane (padding rows and huge
// logits only). Grid (B * Hq, ceil(L / kDotRows)), each warp kDotRows / warps
// rows, one at a time.
constexpr int kDotRows = 16;
template <typename T>
MHA_KERNEL attention_bwd_dot_kernel(const AttentionBwdParams params) {
  using A = typename AccOf<T>::type;
  using Units = SoftmaxUnits<A>;
  const int lane = static_cast<int>(thread_idx().x) % kWarpSize, warp = static_cast<int>(thread_idx().x) / kWarpSize;
  const int warps = static_cast<int>(block_dim().x) / kWarpSize;
  const int64_t bh = block_idx().x, b = bh / params.heads_q, h = bh % params.heads_q;
  const AttentionBwdParams p = sequence_params<T, A>(params, b);
  for (int r = warp; r < kDotRows; r += warps) {
    const int64_t i = static_cast<int64_t>(block_idx().y) * kDotRows + r;
    const T* go = as<T>(p.grad_out) + b * p.grad_out_stride.b + h * p.grad_out_stride.h + i * p.grad_out_stride.row;
    const T* o = as<T>(p.out) + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
    A sum = A(0);
    if (i < p.len_q)
      for (int64_t e = lane; e < p.head_dim_v; e += kWarpSize)
        sum += static_cast<A>(to_float(go[e * p.grad_out_stride.col])) * static_cast<A>(to_float(o[e * p.out_stride.col]));
    for (int m = 16; m > 0; m /= 2) sum += shfl_xor(sum, m);
    if (i >= p.len_q) continue;  // the same for the whole warp
    const A lse = static_cast<const A*>(p.lse)[p.lse_index(b, h, i)];
    A shift = lse * Units::kPerNat, log_norm = A(0);  // |lse| < 256 here unless exact: no overflow
    if (lse_needs_exact_stats(lse)) {
      A mx = A(-INFINITY), l = A(0);
      for (int64_t j = lane; j < p.len_kv; j += kWarpSize)
        mx = nan_max(mx, Units::from_nats(row_score<T, A>(p, b, h, i, j)));
      for (int m = 16; m > 0; m /= 2) mx = nan_max(mx, shfl_xor(mx, m));
      if (mx != A(-INFINITY))
        for (int64_t j = lane; j < p.len_kv; j += kWarpSize)
          l += Units::exp(Units::from_nats(row_score<T, A>(p, b, h, i, j)) - mx);
      for (int m = 16; m > 0; m /= 2) l += shfl_xor(l, m);
      shift = mx;
      log_norm = l > A(0) ? Units::log(l) : A(0);
    }
    if (lane == 0) {
      static_cast<A*>(p.row_dot)[p.lse_index(b, h, i)] = sum;
      static_cast<A*>(p.row_shift)[p.lse_index(b, h, i)] = shift;
      static_cast<A*>(p.row_log_norm)[p.lse_index(b, h, i)] = log_norm;
    }
  }
}

// A backward tile (kBwdBlock rows, row stride kLd) into shared memory by
// cp.async, as one block of the launch's size (launch.h) copies it.
template <typename T, int kHeadDim>
MHA_DEVICE void bwd_copy_tile(T* dst, const T* src, int64_t rs, int64_t cs, int64_t rows, int64_t cols) {
  using Cfg = TileConfig<T, kHeadDim>;
  load_tile_async_fixed<T, Cfg::kBwdBlock, kHeadDim, 32 * Cfg::kBwdWarps>(dst, Cfg::kLd, src, rs, cs, rows, cols);
}

// Key-block kernel. Shared: K, V (kB x kLd), P^T and dS^T (kB x kLdP each), then
// kStages stages of a query tile: Q, dO (kB x kLd) and its rows' shift,
// log_norm and D (kB each, accumulation type), the next tile's loads (16-byte
// cp.async where rows allow) in flight while this one computes. Warp w owns
// key rows 16 (w % kRowWarps) .. of the block; the kSplit warps sharing them
// each compute S^T and dP^T for their share of the tile's query columns and
// hold dK, dV and compute dQ for the head-dim columns [c_base, c_base + kCols).
template <typename T, int kHeadDim>
MHA_KERNEL attention_bwd_kernel(const AttentionBwdParams params) {
  using A = typename AccOf<T>::type;
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kB = Cfg::kBwdBlock, kLd = Cfg::kLd, kLdP = Cfg::kBwdLdP, kStages = Cfg::kBwdStages;
  constexpr int kRowWarps = Cfg::kBwdRowWarps, kSplit = Cfg::kBwdColSplit, kCols = kHeadDim / kSplit;
  // dQ in chunks of 64 columns (16-bit types: a dS fragment feeds 8 mma) or 32
  constexpr int kCT = kCols / 8, kChunk = sizeof(T) == 2 && kCT >= 8 ? 8 : 4;
  // query columns of S^T / dP^T per warp: kNTw n-tiles (some warps have none when kSplit > kB / 8)
  constexpr int kNTw = kB / 8 / kSplit > 0 ? kB / 8 / kSplit : 1;
  // 16-bit types where a warp has its 16 keys alone (every query column of
  // the tile): P^T and dS^T stay in registers as the A operands of dV and dK
  // (warp_mma_c), as the forward keeps P; dS^T still goes to shared
  // memory when this kernel computes dQ
  constexpr bool kRegs = sizeof(T) == 2 && kSplit == 1;
  static_assert(!kRegs || kNTw * 8 == kB, "P^T in registers needs every query column of the tile");
  static_assert(sizeof(A) == Cfg::kAcc);
  T* k_s = dynamic_shared<T>();
  T* v_s = k_s + kB * kLd;
  T* p_s = v_s + kB * kLd;  // P^T
  T* ds_s = p_s + kB * kLdP;  // dS^T
  unsigned char* stages = reinterpret_cast<unsigned char*>(ds_s + kB * kLdP);
  auto q_tile = [&](int st) { return reinterpret_cast<T*>(stages + st * Cfg::kBwdStageBytes); };
  auto row_stats = [&](int st) { return reinterpret_cast<A*>(q_tile(st) + 2 * kB * kLd); };  // shift, log_norm, D

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int row0 = (warp % kRowWarps) * 16, split = warp / kRowWarps, c_base = split * kCols, n0 = 8 * kNTw * split;
  const int64_t bh = block_idx().x, b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionBwdParams p = sequence_params<T, A>(params, b);  // params itself unless varlen
  const A scale = static_cast<A>(p.scale);
  const bool scalar = p.scalar_operands;  // operands by plain loads (launch.h)
  const DropoutKey key = dropout_key(p.dropout);
  const int64_t j0 = static_cast<int64_t>(block_idx().y) * kB;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = p.head_dim_v;
  const int head_dim = static_cast<int>(E);  // at most kHeadDim
  if (j0 >= S) return;  // a block past a shorter sequence's keys (varlen)

  // K and V join the first query tile's cp.async group
  bwd_copy_tile<T, kHeadDim>(k_s, as<T>(p.k) + b * p.k_stride.b + hk * p.k_stride.h + j0 * p.k_stride.row,
                             p.k_stride.row, p.k_stride.col, S - j0, E);
  bwd_copy_tile<T, kHeadDim>(v_s, as<T>(p.v) + b * p.v_stride.b + hk * p.v_stride.h + j0 * p.v_stride.row,
                             p.v_stride.row, p.v_stride.col, S - j0, Ev);
  const T* q_g = as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h;
  const T* do_g = as<T>(p.grad_out) + b * p.grad_out_stride.b + h * p.grad_out_stride.h;
  const A* shift_g = static_cast<const A*>(p.row_shift) + p.lse_index(b, h, 0);
  const A* norm_g = static_cast<const A*>(p.row_log_norm) + p.lse_index(b, h, 0);
  const A* d_g = static_cast<const A*>(p.row_dot) + p.lse_index(b, h, 0);
  // dQ accumulator of the head (grad_q's strides), or null
  A* dq_g = p.grad_q_accum == nullptr
                ? nullptr
                : static_cast<A*>(p.grad_q_accum) + b * p.grad_q_stride.b + h * p.grad_q_stride.h;
  // Issues the loads of the query tile at row i0 into stage st, as one
  // cp.async group (its row statistics by plain stores).
  auto issue = [&](int64_t i0, int st) {
    T* q_s = q_tile(st);
    bwd_copy_tile<T, kHeadDim>(q_s, q_g + i0 * p.q_stride.row, p.q_stride.row, p.q_stride.col, L - i0, E);
    bwd_copy_tile<T, kHeadDim>(q_s + kB * kLd, do_g + i0 * p.grad_out_stride.row, p.grad_out_stride.row,
                               p.grad_out_stride.col, L - i0, Ev);
    A* rows = row_stats(st);
    for (int r = tid; r < kB; r += static_cast<int>(block_dim().x)) {
      const bool in = i0 + r < L;
      rows[r] = in ? shift_g[i0 + r] : A(-INFINITY);
      rows[kB + r] = in ? norm_g[i0 + r] : A(0);
      rows[2 * kB + r] = in ? d_g[i0 + r] : A(0);
    }
    cp_async_commit();
  };

  A dk[kCT][4], dv[kCT][4];
  zero(dk);
  zero(dv);

  // the query tiles with a row that may see one of this block's keys
  int64_t i_first = p.variant.rows_begin(j0);
  int64_t rows_end = p.variant.rows_end((j0 + kB < S ? j0 + kB : S) - 1, L);
  // and from the first to the last row a bool mask shows some of the block's keys
  if (p.mask_key_rows != nullptr)
    narrow_to_mask_range(p.mask_key_rows, p.mask_stride, true, p.heads_q, S, kB, b, h, j0, 1, i_first, rows_end,
                         reinterpret_cast<int64_t*>(p_s));  // (P^T: not written yet)
  stream_tiles<kStages>(i_first, rows_end, kB, issue, [&](int64_t i0, int stage) {
    const T* q_s = q_tile(stage);
    const T* do_s = q_s + kB * kLd;
    const A* shift_s = row_stats(stage);
    const A* norm_s = shift_s + kB;
    const A* d_s = shift_s + 2 * kB;

    // S^T and dP^T of the warp's 16 keys against its query columns n0 ..;
    // P^T to p_s, dS^T to ds_s (kRegs: kept in st and dst; dS^T to ds_s for dQ)
    const bool has_cols = n0 < kB;
    A dst[kNTw][4];
    A st[kNTw][4];
    if (has_cols) {
      zero(st);
      zero(dst);
      warp_mma_pair<T>(st, Tile2<T>{k_s + row0 * kLd, kLd, 1}, Tile2<T>{q_s + n0 * kLd, 1, kLd}, dst,
                       Tile2<T>{v_s + row0 * kLd, kLd, 1}, Tile2<T>{do_s + n0 * kLd, 1, kLd}, kHeadDim, lane, scalar,
                       p.fp32_math);
      const bool interior = interior_tile(p, i0 + n0, i0 + n0 + 8 * kNTw - 1, j0 + row0, j0 + row0 + 15);
      const bool plain =
          plain_scores<T>(st, interior && p.grad_mask == nullptr && !p.dropout.enabled(), scale);
      const uint32_t keep =
          dropout_tile_bits<kNTw, true>(p, key, b, h, j0 + row0 + MmaLayout::c_row(lane, 0), i0 + n0, lane);
      // P^T into st (each score is read once), dS^T into dst; the branch
      // outside the unrolled loops, so the plain tile's code is straight
      if (plain) {
MHA_UNROLL
        for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int ci = n0 + 8 * t + MmaLayout::c_col(lane, e);
            plain_prob_and_grad<T>(st[t][e], dst[t][e], shift_s[ci], norm_s[ci], d_s[ci], scale, st[t][e], dst[t][e]);
          }
      } else {
MHA_UNROLL
        for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int rj = row0 + MmaLayout::c_row(lane, e), ci = n0 + 8 * t + MmaLayout::c_col(lane, e);
            prob_and_grad<T>(p, b, h, i0 + ci, j0 + rj, st[t][e], dst[t][e], shift_s[ci], norm_s[ci], d_s[ci],
                             interior, (keep >> (4 * t + e)) & 1u, static_cast<A*>(p.grad_mask), st[t][e], dst[t][e]);
          }
      }
      if constexpr (!kRegs) store_c_fragments<T>(st, p_s + row0 * kLdP + n0, kLdP, lane);
      if (!kRegs || dq_g != nullptr) store_c_fragments<T>(dst, ds_s + row0 * kLdP + n0, kLdP, lane);
    }
    // The warps sharing rows exchange P^T and dS^T, and dQ reads every warp's
    // dS^T: a block barrier, or a warp barrier where a warp has its rows
    // alone and computes no dQ, none where those stay in its registers too.
    // (The next tile's stores wait for this tile's readers at stream_tiles'
    // barrier.)
    if (kSplit > 1 || dq_g != nullptr) {
      sync_threads();
    } else if constexpr (!kRegs) {
      sync_warp();
    }
    // dV += P^T dO and dK += dS^T Q: in one k loop where a warp's share of
    // the head dim is at most 64 columns (with 128, head dim 256, the second
    // product's fragments spilled on sm_80); where kRegs, one product after
    // the other with A from the registers (warp_mma_c: the same bits and k
    // order as from p_s, ds_s; in one loop, the head-dim-64 kernel spilled
    // 12 / 16 bytes on sm_80 / sm_90, 4 / 0 so)
    const Tile2<T> pt{p_s + row0 * kLdP, kLdP, 1}, dst_t{ds_s + row0 * kLdP, kLdP, 1};
    if constexpr (kRegs) {
      warp_mma_c<T>(dv, st, Tile2<T>{do_s + c_base, kLd, 1}, kB, lane, scalar);
      warp_mma_c<T>(dk, dst, Tile2<T>{q_s + c_base, kLd, 1}, kB, lane, scalar);
    } else if constexpr (kCT <= 8) {
      warp_mma_pair<T>(dv, pt, Tile2<T>{do_s + c_base, kLd, 1}, dk, dst_t, Tile2<T>{q_s + c_base, kLd, 1}, kB, lane,
                       scalar, p.fp32_math);
    } else {
      warp_mma<T>(dv, pt, Tile2<T>{do_s + c_base, kLd, 1}, kB, lane, scalar, p.fp32_math);
      warp_mma<T>(dk, dst_t, Tile2<T>{q_s + c_base, kLd, 1}, kB, lane, scalar, p.fp32_math);
    }

    if (dq_g != nullptr) {
      // dQ rows row0 .. of the tile, columns c_base .., += dS K in chunks of kChunk n-tiles
      for (int c0 = c_base; c0 < c_base + kCols; c0 += 8 * kChunk) {
        A dqa[kChunk][4];
        zero(dqa);
        warp_mma<T>(dqa, Tile2<T>{ds_s + row0, 1, kLdP}, Tile2<T>{k_s + c0, kLd, 1}, kB, lane, scalar, p.fp32_math);
        // a lane's two rows (c_row: elements 0-1, then 2-3), each from one
        // address with constant offsets where the chunk's columns are all
        // in the head dim (a per-element check and address cost about 12
        // instructions per reduction on sm_90)
        const int col = c0 + MmaLayout::c_col(lane, 0);
        auto add_rows = [&](bool check_cols) {
MHA_UNROLL
          for (int half = 0; half < 2; ++half) {
            const int64_t i = i0 + row0 + MmaLayout::c_row(lane, 2 * half);
            if (i >= L) continue;
            A* dq_row = dq_g + i * p.grad_q_stride.row + col;
MHA_UNROLL
            for (int t = 0; t < kChunk; ++t)
MHA_UNROLL
              for (int e = 0; e < 2; ++e)
                if (!check_cols || col + 8 * t + e < head_dim)
                  atomic_add_global(dq_row + 8 * t + e, dqa[t][2 * half + e] * scale);
          }
        };
        if (c0 + 8 * kChunk <= head_dim) {
          add_rows(false);
        } else {
          add_rows(true);
        }
      }
    }
  });
  if (rows_end <= i_first) {  // no query tile: K and V's copies, never in a group, waited on before the block ends
    cp_async_commit();
    cp_async_wait<0>();
  }

  // per query head; the host sums GQA groups
  A* dk_g = static_cast<A*>(p.grad_k) + b * p.grad_k_stride.b + h * p.grad_k_stride.h;
  A* dv_g = static_cast<A*>(p.grad_v) + b * p.grad_v_stride.b + h * p.grad_v_stride.h;
MHA_UNROLL
  for (int t = 0; t < kCT; ++t)
MHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int64_t j = j0 + row0 + MmaLayout::c_row(lane, e);
      const int c = c_base + 8 * t + MmaLayout::c_col(lane, e);
      if (j < S && c < E) dk_g[j * p.grad_k_stride.row + c] = dk[t][e] * scale;
      if (j < S && c < Ev) dv_g[j * p.grad_v_stride.row + c] = dv[t][e];
    }
}

// Deterministic dQ: grid (B * Hq, query blocks of kB rows), key tiles
// streamed in kStages stages as the key-block kernel streams query tiles;
// warps split rows, key columns of S / dP, and head-dim columns of dQ as
// there. Shared: Q, dO (kB x kLd), dS (kB x kLdP), then per stage K, V.
template <typename T, int kHeadDim>
MHA_KERNEL attention_bwd_dq_kernel(const AttentionBwdParams params) {
  using A = typename AccOf<T>::type;
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kB = Cfg::kBwdBlock, kLd = Cfg::kLd, kLdP = Cfg::kBwdLdP, kStages = Cfg::kBwdStages;
  constexpr int kRowWarps = Cfg::kBwdRowWarps, kSplit = Cfg::kBwdColSplit, kCols = kHeadDim / kSplit;
  constexpr int kCT = kCols / 8, kNTw = kB / 8 / kSplit > 0 ? kB / 8 / kSplit : 1;
  // dS kept in registers as the A operand of dQ, as the key-block kernel keeps P^T
  constexpr bool kRegs = sizeof(T) == 2 && kSplit == 1;
  static_assert(!kRegs || kNTw * 8 == kB, "dS in registers needs every key column of the tile");
  T* q_s = dynamic_shared<T>();
  T* do_s = q_s + kB * kLd;
  T* t_s = do_s + kB * kLd;
  unsigned char* stages = reinterpret_cast<unsigned char*>(t_s + kB * kLdP);
  auto k_tile = [&](int st) { return reinterpret_cast<T*>(stages + st * Cfg::kBwdStageBytes); };

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int row0 = (warp % kRowWarps) * 16, split = warp / kRowWarps, c_base = split * kCols, n0 = 8 * kNTw * split;
  const int64_t bh = block_idx().x, b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionBwdParams p = sequence_params<T, A>(params, b);  // params itself unless varlen
  const A scale = static_cast<A>(p.scale);
  const bool scalar = p.scalar_operands;  // operands by plain loads (launch.h)
  // the last query block first (grid y, after every head of a block): under a
  // causal mask it has the most key tiles, so the blocks that start last are short
  const int64_t i0 = static_cast<int64_t>(grid_dim().y - 1 - block_idx().y) * kB;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = p.head_dim_v;
  if (i0 >= L) return;  // a block past a shorter sequence's rows (varlen)

  // Q and dO join the first key tile's cp.async group
  bwd_copy_tile<T, kHeadDim>(q_s, as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h + i0 * p.q_stride.row,
                             p.q_stride.row, p.q_stride.col, L - i0, E);
  bwd_copy_tile<T, kHeadDim>(
      do_s, as<T>(p.grad_out) + b * p.grad_out_stride.b + h * p.grad_out_stride.h + i0 * p.grad_out_stride.row,
      p.grad_out_stride.row, p.grad_out_stride.col, L - i0, Ev);
  const T* k_g = as<T>(p.k) + b * p.k_stride.b + hk * p.k_stride.h;
  const T* v_g = as<T>(p.v) + b * p.v_stride.b + hk * p.v_stride.h;
  auto issue = [&](int64_t j, int st) {
    T* k_s = k_tile(st);
    bwd_copy_tile<T, kHeadDim>(k_s, k_g + j * p.k_stride.row, p.k_stride.row, p.k_stride.col, S - j, E);
    bwd_copy_tile<T, kHeadDim>(k_s + kB * kLd, v_g + j * p.v_stride.row, p.v_stride.row, p.v_stride.col, S - j, Ev);
    cp_async_commit();
  };
  A shift[2], norm[2], dd[2];
MHA_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int64_t i = i0 + row0 + MmaLayout::c_row(lane, 2 * r);
    shift[r] = i < L ? static_cast<const A*>(p.row_shift)[p.lse_index(b, h, i)] : A(-INFINITY);
    norm[r] = i < L ? static_cast<const A*>(p.row_log_norm)[p.lse_index(b, h, i)] : A(0);
    dd[r] = i < L ? static_cast<const A*>(p.row_dot)[p.lse_index(b, h, i)] : A(0);
  }
  const DropoutKey key = dropout_key(p.dropout);

  A dq[kCT][4];
  zero(dq);
  int64_t j_first = p.variant.begin(i0) / kB * kB;
  int64_t kv_end = p.variant.end((i0 + kB < L ? i0 + kB : L) - 1, S);
  // and from the first to the last key a bool mask shows some row of the block
  if (p.mask_row_keys != nullptr)
    narrow_to_mask_range(p.mask_row_keys, p.mask_stride, false, p.heads_q, L, kB, b, h, i0, kB, j_first, kv_end,
                         reinterpret_cast<int64_t*>(k_tile(0)));  // (the K/V stages: no copy in flight yet)
  stream_tiles<kStages>(j_first, kv_end, kB, issue, [&](int64_t j0, int stage) {
    const T* k_s = k_tile(stage);
    const T* v_s = k_s + kB * kLd;
    A dp[kNTw][4];
    if (n0 < kB) {  // dS of the warp's rows and key columns n0 .., for every warp sharing the rows
      A s[kNTw][4];
      zero(s);
      zero(dp);
      warp_mma_pair<T>(s, Tile2<T>{q_s + row0 * kLd, kLd, 1}, Tile2<T>{k_s + n0 * kLd, 1, kLd}, dp,
                       Tile2<T>{do_s + row0 * kLd, kLd, 1}, Tile2<T>{v_s + n0 * kLd, 1, kLd}, kHeadDim, lane, scalar,
                       p.fp32_math);
      const bool interior = interior_tile(p, i0 + row0, i0 + row0 + 15, j0 + n0, j0 + n0 + 8 * kNTw - 1);
      const bool plain = plain_scores<T>(s, interior && !p.dropout.enabled(), scale);
      const uint32_t keep =
          dropout_tile_bits<kNTw, false>(p, key, b, h, i0 + row0 + MmaLayout::c_row(lane, 0), j0 + n0, lane);
      // dS into dp (the probability into s, unused here); the branch outside
      // the unrolled loops, as in the key-block kernel
      if (plain) {
MHA_UNROLL
        for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e)
            plain_prob_and_grad<T>(s[t][e], dp[t][e], shift[e / 2], norm[e / 2], dd[e / 2], scale, s[t][e], dp[t][e]);
      } else {
MHA_UNROLL
        for (int t = 0; t < kNTw; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int ri = row0 + MmaLayout::c_row(lane, e), cj = n0 + 8 * t + MmaLayout::c_col(lane, e);
            // the key-block kernel writes the mask gradient
            prob_and_grad<T>(p, b, h, i0 + ri, j0 + cj, s[t][e], dp[t][e], shift[e / 2], norm[e / 2], dd[e / 2],
                             interior, (keep >> (4 * t + e)) & 1u, static_cast<A*>(nullptr), s[t][e], dp[t][e]);
          }
      }
      if constexpr (!kRegs) store_c_fragments<T>(dp, t_s + row0 * kLdP + n0, kLdP, lane);
    }
    // dQ += dS K
    if constexpr (kRegs) {
      warp_mma_c<T>(dq, dp, Tile2<T>{k_s + c_base, kLd, 1}, kB, lane, scalar);
    } else {
      if constexpr (kSplit > 1) {
        sync_threads();
      } else {
        sync_warp();
      }
      warp_mma<T>(dq, Tile2<T>{t_s + row0 * kLdP, kLdP, 1}, Tile2<T>{k_s + c_base, kLd, 1}, kB, lane, scalar,
                  p.fp32_math);
    }
  });
  if (kv_end <= j_first) {  // no key tile: Q and dO's copies, never in a group, waited on before the block ends
    cp_async_commit();
    cp_async_wait<0>();
  }

  T* dq_g = static_cast<T*>(p.grad_q) + b * p.grad_q_stride.b + h * p.grad_q_stride.h;
MHA_UNROLL
  for (int t = 0; t < kCT; ++t)
MHA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const int64_t i = i0 + row0 + MmaLayout::c_row(lane, e);
      const int c = c_base + 8 * t + MmaLayout::c_col(lane, e);
      if (i < L && c < E) dq_g[i * p.grad_q_stride.row + c] = to_elem<T>(dq[t][e] * scale);
    }
}

}  // namespace mha_ext::device
