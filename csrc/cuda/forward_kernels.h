// The CUDA forward: attention_fwd_kernel (general and plain) and the merge of
// its key splits (attention_combine_kernel). Layout and design:
// attention_kernels.h.
#pragma once

#include "score_policy.h"
#include "warp_tiles.h"

namespace mha_ext::device {

using namespace mha_ext::simt;

// ---------------------------------------------------------------------------
// Forward. Shared: Q (kM x kLd), kFwdKVStages x (K and V (kBlockN x kLd)),
// and for float / double P (kM x kLdP). 16-bit types: the Q, K and V
// operands come from shared memory by ldmatrix (V transposed), P stays in
// registers (the C fragments of S = Q K^T, exponentiated, are the A
// fragments of O += P V), and a warp may take two row tiles of 16 rows
// (kPlain below), which share each K and V fragment it loads. float on the
// tensor cores (TF32 / 3xTF32): Q and K by ldmatrix, at head dim 64 P in
// registers as well (pv_tf32), V by plain loads.
//
// kPlain: the kernel of calls without a mask tensor, dropout, softcap or
// ALiBi (launch.h's fwd_plain; causal alignment, windows, key splits, varlen and
// KV caches stay), 16-bit types up to head dim 128, where the launch picks
// it. Its warps take 32 rows (TileConfig::kFwdRowTiles): the registers the
// general kernel spends on the mask, the score variants and the dropout
// draws (ptxas: about 186 to run the general one at head dim 128 without
// spills, 143 without those) hold the second row tile's O and S instead.
template <typename T, int kHeadDim, bool kPlain>
MHA_KERNEL attention_fwd_kernel(const AttentionFwdParams params) {
  using A = typename AccOf<T>::type;
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kN = Cfg::kFwdBlockN, kLd = Cfg::kLd, kLdP = kN + Cfg::kPad;
  // a warp's row tiles of 16 rows
  constexpr int kRT = kPlain ? Cfg::kFwdRowTiles : 1;
  static_assert(!kPlain || kRT == 2, "the plain kernel is built where warps take 32 rows");
  constexpr int kNT = kN / 8, kOT = kHeadDim / 8, kStages = Cfg::kFwdKVStages;
  constexpr bool kPInRegisters = Cfg::kFwdPInRegisters;
  using Units = SoftmaxUnits<A>;
  // the block's query rows
  const int kM = 16 * kRT * static_cast<int>(block_dim().x / kWarpSize);
  T* q_s = dynamic_shared<T>();
  T* kv_s = q_s + kM * kLd;  // stage st: K at kv_s + 2 st kN kLd, V after it
  T* p_s = kv_s + 2 * kStages * kN * kLd;

  const int tid = static_cast<int>(thread_idx().x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  // grid: query blocks on x, so the blocks of one head run side by side and
  // share its K/V tiles in L2; (batch, head) on y and z (launch.h)
  const int64_t bh = static_cast<int64_t>(block_idx().z) * grid_dim().y + block_idx().y;
  if (bh >= params.batch * params.heads_q) return;  // the last z slice's spare blocks
  const int64_t b = bh / params.heads_q, h = bh % params.heads_q, hk = h / params.group_size();
  const AttentionFwdParams p = sequence_params<T, A>(params, b);  // params itself unless varlen
  // x: the query block, then the key split (kv_splits runs of the grid's query
  // blocks); the last query block first: under a causal mask it has the most
  // key tiles, and the blocks that start last are then the short ones
  const unsigned q_blocks = static_cast<unsigned>((params.len_q + kM - 1) / kM);
  const unsigned split = block_idx().x / q_blocks;
  const int64_t i0 = static_cast<int64_t>(q_blocks - 1 - block_idx().x % q_blocks) * kM;
  const int64_t L = p.len_q, S = p.len_kv;
  if (i0 >= L) return;  // a block past a shorter sequence's rows (varlen)
  const A rescale = static_cast<A>(p.dropout.rescale);
  const A scale = static_cast<A>(p.scale);
  // the scale in the softmax's units, rounded once (fma_scores)
  const A scale_units = Units::scaled(A(1), scale);
  const DropoutKey key = dropout_key(p.dropout);
  // float on the tensor cores keeps P in registers too (pv_tf32) at head dim
  // 64 (at 128 and 256 the unrolled P V spilled: 16 and 52 bytes on sm_80);
  // otherwise, and on the CUDA cores (and double), P goes through p_s
  const bool p_in_registers = std::is_same_v<T, float> && kHeadDim <= 64 && p.fp32_math != Fp32Math::kCudaCores;
  // the warp's first query row (row tile rt: 16 rows from iw_base + 16 rt)
  // and its Q rows in shared memory
  const int64_t iw_base = i0 + static_cast<int64_t>(warp) * 16 * kRT;
  // operands by plain loads (MHA_EXT_CUDA_OPERANDS=scalar) in the general
  // kernel only: the launch gives such calls to it, and the plain kernel
  // leaves the path out (at head dim 128 it cost 140 more bytes of spills)
  const bool scalar = !kPlain && p.scalar_operands;
  const T* q_w = q_s + warp * 16 * kRT * kLd;

  // Q by cp.async, its own group ahead of the first K/V tile's: the first
  // wait of stream_tiles takes both. (By plain loads, each waited on before
  // its store to shared, 128 a thread at head dim 128, Q cost a latency per
  // element: at L = 512 the H200 profile's warps waited on loads half the time.)
  auto copy_tile = [](T* dst, int k_rows, const T* src, int64_t rs, int64_t cs, int64_t rows, int64_t cols) {
    load_tile_async<T, kPlain>(dst, kLd, k_rows, kHeadDim, src, rs, cs, rows, cols);
  };
  copy_tile(q_s, kM, as<T>(p.q) + b * p.q_stride.b + h * p.q_stride.h + i0 * p.q_stride.row, p.q_stride.row,
            p.q_stride.col, L - i0, p.head_dim);
  cp_async_commit();

  A o[kRT][kOT][4], m_run[kRT][2], l_run[kRT][2];
MHA_UNROLL
  for (int rt = 0; rt < kRT; ++rt) {
    zero(o[rt]);
    m_run[rt][0] = m_run[rt][1] = A(-INFINITY);
    l_run[rt][0] = l_run[rt][1] = A(0);
  }
  // the key tiles some row of the block may see (causal alignment, window)
  int64_t vis_end = p.variant.end((i0 + kM < L ? i0 + kM : L) - 1, S);
  int64_t vis_first = p.variant.begin(i0) / kN * kN;
  // and from the first to the last key a bool mask shows some row of the block
  if (!kPlain && p.mask_row_keys != nullptr)
    narrow_to_mask_range(p.mask_row_keys, p.mask_stride, false, p.heads_q, L, kM, b, h, i0, kN, vis_first, vis_end,
                         nullptr);
  // with key splits, this split's run of those tiles (empty past the last)
  const int64_t run = p.kv_splits > 1 && vis_end > vis_first
                          ? ((vis_end - vis_first + kN - 1) / kN + p.kv_splits - 1) / p.kv_splits * kN : 0;
  const int64_t j_first = vis_first + split * run;
  const int64_t kv_end = p.kv_splits > 1 ? (j_first + run < vis_end ? j_first + run : vis_end) : vis_end;
  // Issues the loads of the tile at key j into stage st, as one cp.async
  // group; its rows from kv_offset of its first (a tile of a paged KV cache
  // lies in one block; the plain kernel takes no paged caches: their block
  // lookups cost it registers it has not got).
  const T* k_head = as<T>(p.k) + (kPlain ? b * p.k_stride.b + hk * p.k_stride.h : 0);
  const T* v_head = as<T>(p.v) + (kPlain ? b * p.v_stride.b + hk * p.v_stride.h : 0);
  // The plain kernel's K and V tiles at head dim 64 (load_whole_tile_async):
  // what makes a tile whole but its rows, checked once
  constexpr bool kWholeCopies = kPlain && sizeof(T) == 2 && kHeadDim <= 64;
  auto whole_ok = [&](const T* head, int64_t rs, int64_t cs, int64_t cols) {
    if constexpr (kWholeCopies) {
      return cs == 1 && (rs * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(head) % 16 == 0 && cols == kHeadDim &&
             whole_tile_rounds_even<T, kN, kHeadDim>();
    }
    return false;
  };
  const bool k_whole = whole_ok(k_head, p.k_stride.row, p.k_stride.col, p.head_dim);
  const bool v_whole = whole_ok(v_head, p.v_stride.row, p.v_stride.col, p.head_dim_v);
  // one K or V tile of rows from src into dst (whole: whole_ok of its tensor)
  auto copy_kv = [&](T* dst, const T* src, const Strides4& st, int64_t rows, int64_t cols, bool whole) {
    if constexpr (kWholeCopies) {
      if (whole && rows >= kN) {
        load_whole_tile_async<T, kN, kHeadDim>(dst, kLd, src, st.row);
      } else {
        load_tile_async<T>(dst, kLd, kN, kHeadDim, src, st.row, st.col, rows, cols);
      }
    } else {
      copy_tile(dst, kN, src, st.row, st.col, rows, cols);
    }
  };
  auto issue = [&](int64_t j, int st) {
    T* k_dst = kv_s + 2 * st * kN * kLd;
    const int64_t k_off = kPlain ? j * p.k_stride.row : p.kv_offset(p.k_stride, b, hk, j);
    const int64_t v_off = kPlain ? j * p.v_stride.row : p.kv_offset(p.v_stride, b, hk, j);
    copy_kv(k_dst, k_head + k_off, p.k_stride, S - j, p.head_dim, k_whole);
    copy_kv(k_dst + kN * kLd, v_head + v_off, p.v_stride, S - j, p.head_dim_v, v_whole);
    cp_async_commit();
  };
  stream_tiles<kStages>(j_first, kv_end, kN, issue, [&](int64_t j0, int stage) {
    const T* k_s = kv_s + 2 * stage * kN * kLd;
    const T* v_s = k_s + kN * kLd;

    // The plain kernel's row tiles that hold rows below L and see some key
    // of this tile (the causal / window band: begin and end grow with the
    // row). A warp with none skips the tile, as a tile of -inf scores would
    // leave it (for finite V); a row tile that is not live takes P = 0. Its
    // products still run, except S = Q K^T of a warp's last row tile (a
    // decode step's one row, a GQA group packed into fewer than 32 rows, the
    // last rows of a query): skipping O += P V too took the plain kernel at
    // head dim 128 from 140 to 160 bytes of spills on sm_90. (The general
    // kernel's one row tile takes every tile: skipping cost it registers.)
    bool live[kRT];
    if constexpr (kPlain) {
      bool any = false;
MHA_UNROLL
      for (int rt = 0; rt < kRT; ++rt) {
        const int64_t r0 = iw_base + 16 * rt, r1 = r0 + 15 < L ? r0 + 15 : L - 1;
        live[rt] = r0 < L && j0 < p.variant.end(r1, S) && j0 + kN > p.variant.begin(r0);
        any = any || live[rt];
      }
      if (!any) return;
    } else {
      live[0] = true;
    }

    A s[kRT][kNT][4];
MHA_UNROLL
    for (int rt = 0; rt < kRT; ++rt) zero(s[rt]);
    // S = Q K^T (16-bit operands by ldmatrix: Q rows as A, K rows as B)
    if constexpr (sizeof(T) == 2) {
      if (kRT == 1 || live[kRT - 1]) {
        warp_mma16<T, kRT, kNT, kPlain>(s, Tile2<T>{q_w, kLd, 1}, Tile2<T>{k_s, 1, kLd}, kHeadDim, lane, scalar);
      } else {  // the warp's last row tile sees nothing here (a decode step's one row): its products skipped
        warp_mma16<T, 1, kNT, kPlain>(reinterpret_cast<A(&)[1][kNT][4]>(s[0]), Tile2<T>{q_w, kLd, 1}, Tile2<T>{k_s, 1, kLd},
                              kHeadDim, lane, scalar);
      }
    } else {
      warp_mma<T>(s[0], Tile2<T>{q_w, kLd, 1}, Tile2<T>{k_s, 1, kLd}, kHeadDim, lane, p.scalar_operands,
                  p.fp32_math);
    }

MHA_UNROLL
    for (int rt = 0; rt < kRT; ++rt) {
      A(&sr)[kNT][4] = s[rt];
      if (!live[rt]) {  // P = 0: the row's max and sum stay, and O for finite V
        zero(sr);
        continue;
      }
      A(&m_r)[2] = m_run[rt];
      const int64_t iw0 = iw_base + 16 * rt;
      // Scores in the softmax's units. An interior tile (interior_tile: every
      // row of the row tile sees it whole) takes the one-FMA softmax where
      // fma_scores allows (the row max taken on the dot products), else the
      // exact path; the plain kernel's edge and diagonal tiles take the band's
      // bounds and then the same two paths, the general kernel's masked_score
      // per element.
      A tile_max[2] = {-INFINITY, -INFINITY};
      // (rows past L count as inside: their Q rows are zero and their output
      // is never written, so a decode step's one row, or a GQA group packed
      // into fewer than 16 rows, still takes the interior path)
      const bool interior = interior_tile(p, iw0, iw0 + 15 < L ? iw0 + 15 : L - 1, j0, j0 + kN - 1);
      // (fast: the maxima in the softmax's units; the scores stay raw, for
      // the FMA below or, where fma_scores declines, the exact paths)
      bool fast = fma_scores<T>(sr, interior, scale_units, tile_max);
      if (!fast) tile_max[0] = tile_max[1] = A(-INFINITY);
      // the exact path for every score of the tile, and the row maxima
      auto exact_scores = [&]() {
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            sr[t][e] = Units::from_nats(sr[t][e] * scale);
            tile_max[e / 2] = nan_max(tile_max[e / 2], sr[t][e]);
          }
      };
      if (!fast && interior && !kPlain) {
        exact_scores();
      } else if (!fast && kPlain) {
        // the plain kernel's calls have no score transform but the band: the
        // columns [lo, hi) of this tile that each of the lane's two rows sees
        // (none past L; the band ends at S), compared in 32 bits (interior
        // tiles too: all of it). For 16-bit types and scale > 0 the tile then
        // takes the interior tiles' FMA softmax, with the keys outside the
        // band -inf as dot products: about 8 instructions a score where the
        // exact path takes about 20 (the general kernel keeps the exact path:
        // the same at head dim 64 cost it 4 registers, 12 -> 8 warps a
        // multiprocessor on sm_90).
        int lo[2], hi[2];
        bool empty_ok[2];  // (fma_scores)
MHA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int64_t i = iw0 + MmaLayout::c_row(lane, 2 * r);
          empty_ok[r] = i >= L || m_r[r] > A(-INFINITY);
          const int64_t jb = p.variant.begin(i) - j0, je = p.variant.end(i, S) - j0;
          lo[r] = i < L ? static_cast<int>(jb < 0 ? 0 : jb > kN ? kN : jb) : kN;
          hi[r] = i < L ? static_cast<int>(je < 0 ? 0 : je > kN ? kN : je) : 0;
        }
        auto in_band = [&](int t, int e) {
          const int c = 8 * t + MmaLayout::c_col(lane, e);
          return c >= lo[e / 2] && c < hi[e / 2];
        };
        if (sizeof(T) == 2 && scale_units > A(0)) {
          // the same FMA as an interior tile's: the keys outside the band -inf
          // as dot products
MHA_UNROLL
          for (int t = 0; t < kNT; ++t)
MHA_UNROLL
            for (int e = 0; e < 4; ++e) sr[t][e] = in_band(t, e) ? sr[t][e] : A(-INFINITY);
          fast = fma_scores<T>(sr, true, scale_units, tile_max, empty_ok[0], empty_ok[1]);
          if (!fast) {  // the exact path (scale > 0 keeps the -inf; lo and hi not held past the vote: registers)
            tile_max[0] = tile_max[1] = A(-INFINITY);
            exact_scores();
          }
        } else {
MHA_UNROLL
          for (int t = 0; t < kNT; ++t)
MHA_UNROLL
            for (int e = 0; e < 4; ++e) {
              sr[t][e] = in_band(t, e) ? Units::from_nats(sr[t][e] * scale) : A(-INFINITY);
              tile_max[e / 2] = nan_max(tile_max[e / 2], sr[t][e]);
            }
        }
      } else if (!fast) {
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int64_t i = iw0 + MmaLayout::c_row(lane, e);
            const int64_t j = j0 + 8 * t + MmaLayout::c_col(lane, e);
            sr[t][e] = (i < L && j < S) ? Units::from_nats(masked_score<T>(p, b, h, i, j, sr[t][e])) : A(-INFINITY);
            tile_max[e / 2] = nan_max(tile_max[e / 2], sr[t][e]);
          }
      }
      A alpha[2];
MHA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const A new_max = nan_max(m_r[r], row_max4(tile_max[r]));
        // alpha rescales what was accumulated under the old max (nothing yet if it was -inf)
        alpha[r] = m_r[r] == A(-INFINITY) ? A(0) : Units::exp(m_r[r] - new_max);
        m_r[r] = new_max;
      }
      A part[2] = {A(0), A(0)};
      const uint32_t keep = kPlain ? 0u : dropout_tile_bits<kNT, false>(p, key, b, h, iw0 + MmaLayout::c_row(lane, 0), j0, lane);
      // the probabilities of keys 8 t + c_col(lane, e) and the next, rows r = e / 2
      auto take = [&](int t, int e, A p0, A p1) {
        const int r = e / 2;
        part[r] += p0 + p1;
        if (!kPlain && p.dropout.enabled()) {
          p0 = (keep >> (4 * t + e)) & 1u ? p0 * rescale : A(0);
          p1 = (keep >> (4 * t + e + 1)) & 1u ? p1 * rescale : A(0);
        }
        if (kPInRegisters || p_in_registers) {
          sr[t][e] = p0;
          sr[t][e + 1] = p1;
        } else {
          T* dst = p_s + (iw0 - i0 + MmaLayout::c_row(lane, e)) * kLdP + 8 * t + MmaLayout::c_col(lane, e);
          dst[0] = to_elem<T>(p0);
          dst[1] = to_elem<T>(p1);
        }
      };
      if (fast) {  // m_r is finite here (or NaN from an earlier tile, which the row keeps; -inf past L, whose P may be NaN: never written)
        if constexpr (sizeof(T) == 2) {
          // one FMA a score (fma_scores: the row max's key within 2^-15 of 2^0)
MHA_UNROLL
          for (int t = 0; t < kNT; ++t)
MHA_UNROLL
            for (int e = 0; e < 4; e += 2) {
              const A m = m_r[e / 2];
              take(t, e, softmax_exp2<T>(ffma(sr[t][e], scale_units, -m)),
                   softmax_exp2<T>(ffma(sr[t][e + 1], scale_units, -m)));
            }
        }
      } else {
MHA_UNROLL
        for (int t = 0; t < kNT; ++t)
MHA_UNROLL
          for (int e = 0; e < 4; e += 2) {
            const int r = e / 2;
            take(t, e, m_r[r] == A(-INFINITY) ? A(0) : Units::exp(sr[t][e] - m_r[r]),
                 m_r[r] == A(-INFINITY) ? A(0) : Units::exp(sr[t][e + 1] - m_r[r]));
          }
      }
MHA_UNROLL
      for (int r = 0; r < 2; ++r) l_run[rt][r] = l_run[rt][r] * alpha[r] + part[r];
MHA_UNROLL
      for (int t = 0; t < kOT; ++t)
MHA_UNROLL
        for (int e = 0; e < 4; ++e) o[rt][t][e] *= alpha[e / 2];
    }

    if constexpr (kPInRegisters) {  // O += P V: P's A fragments from the C fragments of 16 keys, V by ldmatrix.trans
MHA_UNROLL
      for (int kk = 0; kk < kN / 16; ++kk) {
        // (a_frag_from_c's packing, written out: the call cost this kernel 3
        // registers at head dim 64, 12 -> 8 warps per SM on sm_90; docs/cuda.md)
        uint32_t pa[kRT][4];
MHA_UNROLL
        for (int rt = 0; rt < kRT; ++rt) {
          const A(&c0)[4] = s[rt][2 * kk];
          const A(&c1)[4] = s[rt][2 * kk + 1];
          pa[rt][0] = pack2(to_elem<T>(c0[0]), to_elem<T>(c0[1]));
          pa[rt][1] = pack2(to_elem<T>(c0[2]), to_elem<T>(c0[3]));
          pa[rt][2] = pack2(to_elem<T>(c1[0]), to_elem<T>(c1[1]));
          pa[rt][3] = pack2(to_elem<T>(c1[2]), to_elem<T>(c1[3]));
        }
MHA_UNROLL
        for (int ot = 0; ot < kOT; ot += 2) {
          uint32_t vf[4];
          if (kScalarOperandsBuilt && scalar) {
            uint32_t s0[2], s1[2];
            b_frag_scalar(s0, Tile2<T>{v_s, kLd, 1}, 16 * kk, ot, lane);
            b_frag_scalar(s1, Tile2<T>{v_s, kLd, 1}, 16 * kk, ot + 1, lane);
            vf[0] = s0[0], vf[1] = s0[1], vf[2] = s1[0], vf[3] = s1[1];
          } else {
            ldmatrix_x4_trans(vf, v_s + (16 * kk + 8 * ((lane / 8) % 2) + lane % 8) * kLd + 8 * (ot + lane / 16));
          }
          const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
MHA_UNROLL
          for (int rt = 0; rt < kRT; ++rt) {
            mma_m16n8k16<T>(o[rt][ot], pa[rt], b0);
            mma_m16n8k16<T>(o[rt][ot + 1], pa[rt], b1);
          }
        }
      }
    } else if (p_in_registers) {  // (one row tile from here on)
      if constexpr (std::is_same_v<T, float>) {
        if (p.fp32_math == Fp32Math::kTf32x3) {
          pv_tf32<true>(o[0], s[0], v_s, kLd, lane);
        } else {
          pv_tf32<false>(o[0], s[0], v_s, kLd, lane);
        }
      }
    } else {
      sync_warp();  // the warp's P rows are written
      warp_mma<T>(o[0], Tile2<T>{p_s + (iw_base - i0) * kLdP, kLdP, 1}, Tile2<T>{v_s, kLd, 1}, kN, lane,
                  p.scalar_operands, p.fp32_math);
    }
  });
  cp_async_wait<0>();  // Q's group where the block had no key tile to wait on

MHA_UNROLL
  for (int rt = 0; rt < kRT; ++rt) {
    const int64_t row0 = iw_base + 16 * rt;
    A l[2], inv[2];
MHA_UNROLL
    for (int r = 0; r < 2; ++r) {
      l[r] = row_sum4(l_run[rt][r]);
      inv[r] = l[r] > A(0) ? A(1) / l[r] : A(0);  // 0 for a fully masked row (l = 0)
    }
    if (p.kv_splits > 1) {  // this split's rows for the combine kernel (dense rows: i indexes L)
      const int64_t rows = p.kv_splits * p.batch * p.heads_q * L, srow0 = (split * p.batch * p.heads_q + bh) * L;
      A* po = static_cast<A*>(p.part_out) + srow0 * p.head_dim_v;
      A* pm = static_cast<A*>(p.part_ml) + srow0;
      for_each_output(o[rt], inv, row0, L, p.head_dim_v, lane,
                      [&](int64_t i, int c, A x) { po[i * p.head_dim_v + c] = x; });
      if (lane % 4 == 0)
MHA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const int64_t i = row0 + MmaLayout::c_row(lane, 2 * r);
          if (i < L) {
            pm[i] = m_run[rt][r];
            pm[rows + i] = l[r];
          }
        }
      if (rt + 1 == kRT) return;  // (an early return: the general kernel's registers were lower with it)
      continue;
    }
    T* out = static_cast<T*>(p.out) + b * p.out_stride.b + h * p.out_stride.h;
    // 16-bit outputs with unit column stride and 4-byte aligned rows (what
    // the op allocates for an even Ev) go by column pairs
    bool pairs = false;
    if constexpr (sizeof(T) == 2) {
      pairs = p.out_stride.col == 1 && p.out_stride.row % 2 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0;
      if (pairs)
        store_output_pairs<T>(o[rt], inv, row0, L, static_cast<int>(p.head_dim_v), lane, out, p.out_stride.row);
    }
    if (!pairs)
      for_each_output(o[rt], inv, row0, L, p.head_dim_v, lane, [&](int64_t i, int c, A x) {
        out[i * p.out_stride.row + c * p.out_stride.col] = to_elem<T>(x);
      });
    if (lane % 4 == 0) {
      A* lse = static_cast<A*>(p.lse) + p.lse_index(b, h, 0);
MHA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t i = row0 + MmaLayout::c_row(lane, 2 * r);
        // natural log; -inf for a fully masked row; NaN stays NaN
        if (i < L)
          lse[i] = l[r] > A(0) ? (m_run[rt][r] + Units::log(l[r])) / Units::kPerNat
                               : (l[r] == l[r] ? A(-INFINITY) : l[r]);
      }
    }
  }
}

// The forward's key splits merged (AttentionFwdParams::kv_splits > 1), one
// warp a row (b, h, i), in split order: with M the largest of the splits'
// maxima m_s and w_s = l_s exp(m_s - M), O = sum_s w_s O_s / sum_s w_s and
// lse = M + log(sum_s w_s), as the unsplit kernel would have them (its
// fully masked and NaN rows included: a split that saw no key has m_s =
// -inf and weight 0; a NaN score anywhere in the row makes M NaN).
template <typename T>
MHA_KERNEL attention_combine_kernel(const AttentionFwdParams p) {
  using A = typename AccOf<T>::type;
  using Units = SoftmaxUnits<A>;
  const int lane = static_cast<int>(thread_idx().x) % kWarpSize;
  const int64_t L = p.len_q, rows = p.batch * p.heads_q * L, all = p.kv_splits * rows;
  const int64_t row = static_cast<int64_t>(block_idx().x) * (block_dim().x / kWarpSize) + thread_idx().x / kWarpSize;
  if (row >= rows) return;
  const int64_t bh = row / L, i = row % L, b = bh / p.heads_q, h = bh % p.heads_q;
  const A* pm = static_cast<const A*>(p.part_ml) + row;
  const A* po = static_cast<const A*>(p.part_out) + row * p.head_dim_v;
  A mx = -INFINITY;
  for (int64_t s = 0; s < p.kv_splits; ++s) mx = nan_max(mx, pm[s * rows]);
  // split s's weight; 0 for a split that saw no key, whose O (0, or NaN from
  // a NaN value row behind masked scores) still counts as the unsplit sum would
  auto weight = [&](int64_t s) {
    const A m = pm[s * rows];
    return m == A(-INFINITY) ? A(0) : pm[all + s * rows] * Units::exp(m - mx);
  };
  // Each weight computed once, by lane s % 32, and passed round by shuffles;
  // a lane holds its columns' sums (head dims up to 256, launch.h: 8 a lane),
  // each summed in split order as before.
  constexpr int kLaneCols = 256 / kWarpSize;
  A acc[kLaneCols];
MHA_UNROLL
  for (int k = 0; k < kLaneCols; ++k) acc[k] = A(0);
  A total = A(0);
  for (int64_t s0 = 0; s0 < p.kv_splits; s0 += kWarpSize) {
    const A mine = s0 + lane < p.kv_splits ? weight(s0 + lane) : A(0);
    const int n = static_cast<int>(p.kv_splits - s0 < kWarpSize ? p.kv_splits - s0 : kWarpSize);
    for (int t = 0; t < n; ++t) {  // the same n for the whole warp
      const A w = shfl(mine, t);
      total += w;
      const A* os = po + (s0 + t) * rows * p.head_dim_v;
MHA_UNROLL
      for (int k = 0; k < kLaneCols; ++k) {
        const int64_t c = lane + k * kWarpSize;
        if (c < p.head_dim_v) acc[k] += w * os[c];
      }
    }
  }
  const A inv = total > A(0) ? A(1) / total : A(0);
  T* out = static_cast<T*>(p.out) + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
MHA_UNROLL
  for (int k = 0; k < kLaneCols; ++k) {
    const int64_t c = lane + k * kWarpSize;
    if (c < p.head_dim_v) out[c * p.out_stride.col] = to_elem<T>(acc[k] * inv);
  }
  if (lane == 0)
    static_cast<A*>(p.lse)[p.lse_index(b, h, i)] =
        total > A(0) ? (mx + Units::log(total)) / Units::kPerNat : (total == total ? A(-INFINITY) : total);
}

}  // namespace mha_ext::device
