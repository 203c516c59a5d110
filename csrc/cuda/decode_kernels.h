// The CUDA decode forward (attention_decode_kernel): a few query rows against
// many keys, each key tile shared by all the block's warps. Layout and
// design: attention_kernels.h; the launch's choice: launch.h's fwd_decode.
#pragma once

#include "score_policy.h"
#include "warp_tiles.h"

namespace mha_ext::device {

using namespace mha_ext::simt;

// At most 16 query rows a block (a decode step's one row, a GQA group packed
// by pack_gqa_rows, the few rows of a speculative or chunked KV-cache step),
// 16-bit types, every call but dropout (masks, softcap and ALiBi by
// masked_score; paged KV caches). The plain (or general) kernel gives such rows to
// one warp, which does every product of a key tile while the block's other
// warp only copies: at batch 8 the H200 read K/V at 1.1-1.3 TB/s where
// flash read 2.6 (bench/results/2026-11-27). Here warp w of the block's
// kFwdBlockN / 16 takes keys 16 w .. 16 w + 15 of each tile: S = Q K^T for
// those 16 keys (Q's A fragments loaded once, in registers), their P one A
// fragment, O += P V over the same 16 V rows, with its own running max, sum
// and O. After the last tile the warps' results are merged in warp order in
// shared memory as the key splits' combine kernel merges splits (with M the
// largest of the maxima m_w and e_w = exp(m_w - M): O = sum e_w O_w / sum e_w
// l_w, lse = M + log(sum e_w l_w)), so a row's bits depend on its own
// scores alone, whichever rows share its block. Key splits write the
// merged rows' partial results for the combine kernel, as the other kernels do.
// Shared: Q (16 x kLd), kFwdKVStages x (K and V (kFwdBlockN x kLd)); after
// the tiles, the warps' O (float, 16 x kHeadDim each), maxima, sums and
// weights in the stages' place.
// Registers: a warp per 16 keys of a tile (4 at head dims 64 and 128, 2 at
// 256, where 16-bit tiles hold 32 keys), 4 blocks a multiprocessor at head
// dim 64 and 3 at 128 and 256 (launch.h's fwd_resident_blocks counts them by
// shared memory: ptxas left alone took 171 at 128 on sm_90, 2 blocks; held
// to 168 it takes 156 without spills).
template <typename T, int kHeadDim>
MHA_KERNEL MHA_LAUNCH_BOUNDS((2 * TileConfig<T, kHeadDim>::kFwdBlockN), kHeadDim <= 64 ? 4 : 3)
    attention_decode_kernel(const AttentionFwdParams params) {
  using A = float;
  using Cfg = TileConfig<T, kHeadDim>;
  static_assert(sizeof(T) == 2, "the decode kernel runs 16-bit types on the tensor cores");
  constexpr int kN = Cfg::kFwdBlockN, kLd = Cfg::kLd, kStages = Cfg::kFwdKVStages;
  constexpr int kWarps = kN / 16, kOT = kHeadDim / 8, kKT = kHeadDim / 16, kM = 16;
  static_assert(kWarps * 16 * kHeadDim * 4 + 3 * kWarps * kM * 4 + 2 * kM * 4 <= 2 * kStages * kN * kLd * 2,
                "the merge's scratch fits in the K/V stages");
  using Units = SoftmaxUnits<A>;
  T* q_s = dynamic_shared<T>();
  T* kv_s = q_s + kM * kLd;  // stage st: K at kv_s + 2 st kN kLd, V after it

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int64_t bh = static_cast<int64_t>(block_idx().z) * grid_dim().y + block_idx().y;
  if (bh >= params.batch * params.heads_q) return;  // the last z slice's spare blocks
  const int64_t b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionFwdParams p = sequence_params<T, A>(params, b);  // a KV cache: batch b's key count
  const unsigned q_blocks = static_cast<unsigned>((params.len_q + kM - 1) / kM);
  const unsigned split = block_idx().x / q_blocks;
  const int64_t i0 = static_cast<int64_t>(block_idx().x % q_blocks) * kM;
  const int64_t L = p.len_q, S = p.len_kv;
  if (i0 >= L) return;
  const A scale = static_cast<A>(p.scale);
  // scores beyond the scaled dot product and the band: masked_score's path
  const bool general = p.mask_kind != MaskKind::kNone || p.variant.changes_scores();
  const int64_t i_last = i0 + kM - 1 < L ? i0 + kM - 1 : L - 1;
  // the key tiles some row of the block may see (with a bool mask, from the
  // first to the last key it shows: bool_mask_keys_range); with key splits
  // this split's run of them (below)
  int64_t vis_first = p.variant.begin(i0) / kN * kN;
  int64_t vis_end = p.variant.end(i_last, S);
  if (p.mask_kind == MaskKind::kBool)
    bool_mask_keys_range(p, b, h, i0, i_last, vis_first, vis_end, kN, reinterpret_cast<int*>(kv_s), vis_first,
                         vis_end);

  auto copy_tile = [](T* dst, int k_rows, const T* src, int64_t rs, int64_t cs, int64_t rows, int64_t cols) {
    load_tile_async<T>(dst, kLd, k_rows, kHeadDim, src, rs, cs, rows, cols);
  };
  copy_tile(q_s, kM, as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h + i0 * p.q_stride.row, p.q_stride.row,
            p.q_stride.col, L - i0, p.head_dim);
  cp_async_commit();

  A o[kOT][4], m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {A(0), A(0)};
  zero(o);
  // Q's A fragments, in registers from the first tile on up to head dim 128
  // (at 256 they and O would take 192 registers: loaded each tile there)
  constexpr bool kQInRegisters = kHeadDim <= 128;
  uint32_t qa[kQInRegisters ? kKT : 1][4];
  const int64_t run = p.kv_splits > 1 && vis_end > vis_first
                          ? ((vis_end - vis_first + kN - 1) / kN + p.kv_splits - 1) / p.kv_splits * kN : 0;
  const int64_t j_first = vis_first + split * run;
  const int64_t kv_end = p.kv_splits > 1 ? (j_first + run < vis_end ? j_first + run : vis_end) : vis_end;
  auto issue = [&](int64_t j, int st) {  // the tile at key j (of one block of a paged cache) into stage st
    T* k_dst = kv_s + 2 * st * kN * kLd;
    copy_tile(k_dst, kN, as<T>(p.k) + p.kv_offset(p.k_stride, b, hk, j), p.k_stride.row, p.k_stride.col, S - j,
              p.head_dim);
    copy_tile(k_dst + kN * kLd, kN, as<T>(p.v) + p.kv_offset(p.v_stride, b, hk, j), p.v_stride.row, p.v_stride.col,
              S - j, p.head_dim_v);
    cp_async_commit();
  };
  stream_tiles<kStages>(j_first, kv_end, kN, issue, [&](int64_t j0, int stage) {
    const int r8 = lane % 8, m_lo = (lane / 8) % 2, m_hi = lane / 16;
    if (kQInRegisters && j0 == j_first) {  // Q landed with the first tile's wait
MHA_UNROLL
      for (int kk = 0; kk < (kQInRegisters ? kKT : 0); ++kk)
        ldmatrix_x4(qa[kk], q_s + (r8 + 8 * m_lo) * kLd + 16 * kk + 8 * m_hi);
    }
    const T* k_s = kv_s + 2 * stage * kN * kLd + 16 * warp * kLd;  // this warp's 16 keys
    const T* v_s = kv_s + (2 * stage + 1) * kN * kLd + 16 * warp * kLd;
    const int64_t jw = j0 + 16 * warp;
    A s[2][4];
    zero(s);
    if constexpr (kQInRegisters) {
MHA_UNROLL
      for (int kk = 0; kk < kKT; ++kk)
        mma16_b_step<T, 1, 2>(reinterpret_cast<A(&)[1][2][4]>(s), reinterpret_cast<const uint32_t(&)[1][4]>(qa[kk]),
                              Tile2<T>{k_s, 1, kLd}, 16 * kk, lane, false);
    } else {
      warp_mma16<T, 1, 2>(reinterpret_cast<A(&)[1][2][4]>(s), Tile2<T>{q_s, kLd, 1}, Tile2<T>{k_s, 1, kLd}, kHeadDim,
                          lane, false);
    }
    // the scores in the softmax's units: an interior run of keys (rows past L
    // count as inside: their Q rows are zero, their output never written)
    // takes the plain path where plain_scores allows; a mask or a score
    // variant masked_score's per score; otherwise each of the lane's two
    // rows keeps the columns [lo, hi) of the 16 it sees
    A tile_max[2] = {-INFINITY, -INFINITY};
    const bool fast = plain_scores<T>(s, interior_tile(p, i0, i_last, jw, jw + 15), scale);
    if (fast) {
MHA_UNROLL
      for (int t = 0; t < 2; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) tile_max[e / 2] = fmaxf(tile_max[e / 2], s[t][e]);
      tile_max[0] = Units::scaled(tile_max[0], scale);  // scale > 0: the scaled max is the max scaled
      tile_max[1] = Units::scaled(tile_max[1], scale);
    } else if (general) {  // a mask tensor, softcap or ALiBi: the one score transform, per score
MHA_UNROLL
      for (int t = 0; t < 2; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int64_t i = i0 + MmaLayout::c_row(lane, e), j = jw + 8 * t + MmaLayout::c_col(lane, e);
          s[t][e] = i < L && j < S ? Units::from_nats(masked_score<T>(p, b, h, i, j, s[t][e])) : A(-INFINITY);
          tile_max[e / 2] = nan_max(tile_max[e / 2], s[t][e]);
        }
    } else {
      int lo[2], hi[2];
MHA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t i = i0 + MmaLayout::c_row(lane, 2 * r);
        const int64_t jb = p.variant.begin(i) - jw, je = p.variant.end(i, S) - jw;
        lo[r] = i < L ? static_cast<int>(jb < 0 ? 0 : jb > 16 ? 16 : jb) : 16;
        hi[r] = i < L ? static_cast<int>(je < 0 ? 0 : je > 16 ? 16 : je) : 0;
      }
MHA_UNROLL
      for (int t = 0; t < 2; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int c = 8 * t + MmaLayout::c_col(lane, e);
          s[t][e] = c >= lo[e / 2] && c < hi[e / 2] ? Units::from_nats(s[t][e] * scale) : A(-INFINITY);
          tile_max[e / 2] = nan_max(tile_max[e / 2], s[t][e]);
        }
    }
    A alpha[2], part[2] = {A(0), A(0)};
MHA_UNROLL
    for (int r = 0; r < 2; ++r) {
      const A new_max = nan_max(m_run[r], row_max4(tile_max[r]));
      alpha[r] = m_run[r] == A(-INFINITY) ? A(0) : Units::exp(m_run[r] - new_max);
      m_run[r] = new_max;
    }
MHA_UNROLL
    for (int t = 0; t < 2; ++t)
MHA_UNROLL
      for (int e = 0; e < 4; ++e) {
        const A m = m_run[e / 2];
        // the plain path rounds the scaled score before the subtraction, as the plain kernel does
        s[t][e] = fast ? softmax_exp2<T>(Units::scaled(s[t][e], scale) - m)
                       : (m == A(-INFINITY) ? A(0) : Units::exp(s[t][e] - m));
        part[e / 2] += s[t][e];
      }
MHA_UNROLL
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + part[r];
MHA_UNROLL
    for (int t = 0; t < kOT; ++t)
MHA_UNROLL
      for (int e = 0; e < 4; ++e) o[t][e] *= alpha[e / 2];
    // O += P V: P's A fragment from the C fragments of the 16 keys, V by ldmatrix.trans
    uint32_t pa[4];
    a_frag_from_c<T>(pa, s, 0);
MHA_UNROLL
    for (int ot = 0; ot < kOT; ot += 2) {
      uint32_t vf[4];
      ldmatrix_x4_trans(vf, v_s + (8 * ((lane / 8) % 2) + lane % 8) * kLd + 8 * (ot + lane / 16));
      const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
      mma_m16n8k16<T>(o[ot], pa, b0);
      mma_m16n8k16<T>(o[ot + 1], pa, b1);
    }
  });
  cp_async_wait<0>();  // Q's group where the block had no key tile to wait on

  // The warps' merge. Scratch in the stages' place once every warp is done with them.
  sync_threads();
  A* o_s = reinterpret_cast<A*>(kv_s);           // (kWarps, 16, kHeadDim)
  A* m_s = o_s + kWarps * kM * kHeadDim;         // (kWarps, 16)
  A* l_s = m_s + kWarps * kM;                    // (kWarps, 16)
  A* w_s = l_s + kWarps * kM;                    // (kWarps, 16): e_w
  A* row_s = w_s + kWarps * kM;                  // (2, 16): M, sum e_w l_w
MHA_UNROLL
  for (int r = 0; r < 2; ++r) {
    const A l = row_sum4(l_run[r]);
    const int i = MmaLayout::c_row(lane, 2 * r);
    if (lane % 4 == 0) {
      m_s[warp * kM + i] = m_run[r];
      l_s[warp * kM + i] = l;
    }
  }
MHA_UNROLL
  for (int t = 0; t < kOT; ++t)
MHA_UNROLL
    for (int e = 0; e < 4; ++e)
      o_s[(warp * kM + MmaLayout::c_row(lane, e)) * kHeadDim + 8 * t + MmaLayout::c_col(lane, e)] = o[t][e];
  sync_threads();
  if (tid < kM) {
    A mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = nan_max(mx, m_s[w * kM + tid]);
    A total = A(0);
    for (int w = 0; w < kWarps; ++w) {
      const A m = m_s[w * kM + tid];
      // 0 for a warp that saw no key (its O, 0 or NaN from a NaN value row behind masked scores, still counts)
      const A e = m == A(-INFINITY) ? A(0) : Units::exp(m - mx);
      w_s[w * kM + tid] = e;
      total += e * l_s[w * kM + tid];
    }
    row_s[tid] = mx;
    row_s[kM + tid] = total;
  }
  sync_threads();
  const int64_t rows_here = L - i0 < kM ? L - i0 : kM;
  const int Ev = static_cast<int>(p.head_dim_v);
  T* out = static_cast<T*>(p.out) + b * p.out_stride.b + h * p.out_stride.h;
  const int64_t parts = p.kv_splits * p.batch * p.heads_q * L, srow0 = (split * p.batch * p.heads_q + bh) * L;
  for (int idx = tid; idx < rows_here * Ev; idx += static_cast<int>(block_dim().x)) {
    const int i = idx / Ev, c = idx % Ev;
    A acc = A(0);
MHA_UNROLL
    for (int w = 0; w < kWarps; ++w) acc += w_s[w * kM + i] * o_s[(w * kM + i) * kHeadDim + c];
    const A total = row_s[kM + i];
    const A x = acc * (total > A(0) ? A(1) / total : A(0));  // 0 for a fully masked row
    if (p.kv_splits > 1) {
      static_cast<A*>(p.part_out)[(srow0 + i0 + i) * Ev + c] = x;
    } else {
      out[(i0 + i) * p.out_stride.row + c * p.out_stride.col] = to_elem<T>(x);
    }
  }
  if (tid < rows_here) {
    const A mx = row_s[tid], total = row_s[kM + tid];
    if (p.kv_splits > 1) {  // the combine kernel's (max, sum) of this split's row
      A* pm = static_cast<A*>(p.part_ml) + srow0 + i0 + tid;
      pm[0] = mx;
      pm[parts] = total;
    } else {  // natural log; -inf for a fully masked row; NaN stays NaN
      static_cast<A*>(p.lse)[p.lse_index(b, h, i0 + tid)] =
          total > A(0) ? (mx + Units::log(total)) / Units::kPerNat : (total == total ? A(-INFINITY) : total);
    }
  }
}

}  // namespace mha_ext::device
