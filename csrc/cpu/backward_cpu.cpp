// CPU attention kernels, FlashAttention-2 style: the backward.
//
// Backward: work items are (batch, query head), or two heads run side by side
// with a shared mask larger than L2. Key/value tiles are the outer loop (K,
// K^T, V^T packed once per tile and head), query blocks the inner one; each
// step recomputes P = exp(S - lse), accumulates dV and dK of the tile and dQ of
// the block (dQ for the whole head in an O(L) float buffer). No two items
// write the same memory and every sum runs in a fixed order, so results do not
// depend on the number of threads.
//
// Matrix products on tiles go to cpu::gemm (gemm_cpu.h): register-blocked,
// deterministic, with the instruction set chosen at run time; half and
// bfloat16 tiles are widened to float first.
#include "kernel_common_cpu.h"

namespace mha_ext {

namespace {

// The bfloat16 backward's operands on pair products (Isa::kAvx512Bf16 and
// above, one per thread): Q and dO of a head as rows (A) and as pair rows
// (B), a block of O's rows (for D), the key tile's K and V as transposed
// pairs (B of S and dP) and K as pair rows (B of dQ), the block's P^T, dS and
// dS^T in bfloat16 (A), and float dK / dV of the tile; all zero-padded to
// multiples of 32.
struct PairBwdBuffers {
  int64_t e_pad = 0, ev_pad = 0;
  Buffer<uint16_t> q_rows, q_pairs, do_rows, do_pairs, o_rows, k_tp, v_tp, k_pairs, a_bf;
  Buffer<float> tr, dk_tile, dv_tile;

  PairBwdBuffers(int64_t L, int64_t E, int64_t Ev) : e_pad(round32(E)), ev_pad(round32(Ev)) {
    const int64_t lp = round32(L);
    q_rows.resize(lp * e_pad);
    q_pairs.resize(lp * e_pad);
    do_rows.resize(lp * ev_pad);
    do_pairs.resize(lp * ev_pad);
    o_rows.resize(kBlockM * ev_pad);
    k_tp.resize(e_pad * kBlockN);
    v_tp.resize(ev_pad * kBlockN);
    k_pairs.resize(kBlockN * e_pad);
    a_bf.resize(kBlockM * kBlockN);
    tr.resize(kBlockM * kBlockN);
    dk_tile.resize(kBlockN * e_pad);
    dv_tile.resize(kBlockN * ev_pad);
  }

  // rows and pair rows of a head's (L x D) strided matrix
  static void pack_head(const c10::BFloat16* src, int64_t rs, int64_t cs, int64_t L, int64_t D, int64_t d_pad,
                        uint16_t* rows, uint16_t* pairs) {
    const int64_t lp = round32(L);
    pack_a_bf16(src, rs, cs, L, D, lp, d_pad, rows);
    cpu::pack_row_pairs_bf16(rows, d_pad, L, D, lp, d_pad, 2 * d_pad, pairs);
  }

  // C (+)= A^T B where A is a float (m x nq) block: transposed into bfloat16 first
  void gemm_at(const float* a, int64_t lda, int64_t m, int64_t nq, const uint16_t* b_pairs, int64_t n_out,
               float* c, int64_t ldc) {
    cpu::transpose(a, lda, m, nq, tr.data(), m);  // (nq x m), row stride m
    cpu::pack_bf16_rows(tr.data(), m, nq, m, round32(nq), round32(m), a_bf.data());
    cpu::gemm_bf16_pairs(round32(nq), n_out, round32(m), a_bf.data(), round32(m), b_pairs, 2 * n_out, c, ldc, true);
  }
};

}  // namespace

template <typename scalar_t>
void attention_bwd_kernel(const AttentionBwdParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = RowOps<acc_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  // L_max: the query length (in a varlen batch the longest); per item L and S
  // are those of its sequence (sequence_params)
  const int64_t H = p.heads_q, L_max = p.len_q, E = p.head_dim, Ev = p.head_dim_v;
  const int64_t G = p.group_size();
  const acc_t unit = Ops::kUnitsPerNat;
  const acc_t scale = static_cast<acc_t>(p.scale);  // of dS
  const acc_t s_scale = scale * unit;               // of S, in the kernel's units
  const acc_t rescale = static_cast<acc_t>(p.dropout.rescale);
  const acc_t* lse = static_cast<const acc_t*>(p.lse);
  acc_t* dmask_all = static_cast<acc_t*>(p.grad_mask);
  // bfloat16 on AVX512-BF16 or AMX: the five products in bfloat16 pairs
  // (cpu::gemm_bf16_pairs, PairBwdBuffers)
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const bool pairs = kBf16 && cpu::active_isa() >= cpu::Isa::kAvx512Bf16;
  const int64_t ldq_acc = pairs ? round32(E) : E;  // dQ accumulator row stride
  // S's scale inside the exponential on pair products, as in the forward
  const bool fold_scale =
      pairs && p.mask_kind != MaskKind::kFloat && !p.variant.changes_scores() && s_scale > acc_t(0);
  const bool softcap = p.variant.softcap > 0.0;

  // Work item: (batch, query head). Key/value tiles are the outer loop, so K,
  // K^T and V^T are packed once per tile (and head); dK and dV of the tile accumulate over
  // the query blocks, dQ of the whole head in an O(L) float buffer.
  //
  // With a shared mask that outgrows L2, an item takes two heads of a batch
  // and runs them side by side, block by block, so the second reads each mask
  // tile from L2. In-process A/B, 1 thread, forward+backward with a (1, L, L)
  // float mask: 12x2048x64 586 vs 629 ms, 16x2048x64 746 vs 802, 12x1024x64
  // 145 vs 149; at L = 512 pairs were slower (65.8 vs 62.7, 20 heads).
  const int64_t kGroup = 2;
  const bool grouped = shared_mask_outgrows_l2<scalar_t>(p) && H % kGroup == 0 &&
                       p.batch * (H / kGroup) >= at::get_num_threads();
  const int64_t group = grouped ? kGroup : 1;

  // One query head's state within an item.
  struct Head {
    int64_t h = 0, hk = 0;
    acc_t* dk = nullptr;  // dK and dV of the head's keys, rows ld_dk / ld_dv apart
    acc_t* dv = nullptr;
    int64_t ld_dk = 0, ld_dv = 0;
    const acc_t* qh = nullptr;   // Q of the head, (L x E), row stride ldq
    const acc_t* doh = nullptr;  // dO of the head, (L x Ev), row stride lddo
    const acc_t* lse_h = nullptr;
    const acc_t* kt = nullptr;   // K of the tile, (n x E), row stride ldk
    int64_t ldq = 0, lddo = 0, ldk = 0;
    Buffer<acc_t> q_buf, do_buf;  // whole-head copies, only when the input needs packing
    Buffer<acc_t> row_d, dq_acc, k_buf, kt_buf, vt_buf;
    // P = expb(S * mul - row_sub) * row_inv: row_sub = lse in the kernel's
    // units and row_inv = 1, or the row's exact max and 1 / sum where
    // lse_needs_exact_stats (exact_row_stats below)
    Buffer<acc_t> row_sub, row_inv;
    std::vector<uint8_t> exact;  // per row: row_sub / row_inv are exact statistics
    std::unique_ptr<PairBwdBuffers> ab;
  };

  // Query blocks [first_row, rows_end) may see the key tile [j0, j0 + n) (a
  // causal alignment or window skips the others); blocks start on multiples of kBlockM.
  // The lambdas take the item's sequence params sp (sequence_params).
  auto first_row = [&](const AttentionBwdParams& sp, int64_t j0) -> int64_t {
    return sp.variant.rows_begin(j0) / kBlockM * kBlockM;
  };
  auto rows_end = [&](const AttentionBwdParams& sp, int64_t j0, int64_t n) -> int64_t {
    return sp.variant.rows_end(j0 + n - 1, sp.len_q);
  };

  // Packs the key/value tile (j0, n rows) of the head's key head for the
  // products: K rows and K^T, V^T (on pair products their pair layouts).
  auto pack_tile = [&](const AttentionBwdParams& sp, Head& hd, int64_t b, int64_t j0, int64_t n) {
    const int64_t ldt = transposed_ld(n), n32 = round32(n);
    const scalar_t* k_tile =
        static_cast<const scalar_t*>(sp.k) + b * p.k_stride.b + hd.hk * p.k_stride.h + j0 * p.k_stride.row;
    const scalar_t* v_tile =
        static_cast<const scalar_t*>(sp.v) + b * p.v_stride.b + hd.hk * p.v_stride.h + j0 * p.v_stride.row;
    if (!pairs) {
      hd.kt = load_tile(k_tile, p.k_stride.row, p.k_stride.col, n, E, hd.k_buf.data(), &hd.ldk);
      load_tile_transposed(k_tile, p.k_stride.row, p.k_stride.col, n, E, hd.kt_buf.data(), ldt);
      load_tile_transposed(v_tile, p.v_stride.row, p.v_stride.col, n, Ev, hd.vt_buf.data(), ldt);
    }
    if constexpr (kBf16) {
      if (pairs) {
        PairBwdBuffers* ab = hd.ab.get();
        pack_kt_pairs(k_tile, p.k_stride.row, p.k_stride.col, n, E, n32, ab->e_pad, 2 * n32, ab->k_tp.data());
        pack_kt_pairs(v_tile, p.v_stride.row, p.v_stride.col, n, Ev, n32, ab->ev_pad, 2 * n32, ab->v_tp.data());
        pack_v_pairs(k_tile, p.k_stride.row, p.k_stride.col, n, E, n32, ab->e_pad, ab->k_pairs.data());
        std::fill(ab->dk_tile.begin(), ab->dk_tile.begin() + n32 * ab->e_pad, 0.f);
        std::fill(ab->dv_tile.begin(), ab->dv_tile.begin() + n32 * ab->ev_pad, 0.f);
      }
    }
  };

  // S of query rows i0 .. i0 + m against the packed tile (n keys, nq of them
  // visible) into pt, row stride round32(nq) on pair products, else nq; in the kernel's
  // units, except on pair products with fold_scale (the scale rides in the exponential).
  auto scores = [&](const Head& hd, int64_t i0, int64_t m, int64_t n, int64_t nq, acc_t* pt) {
    if (pairs) {
      if constexpr (std::is_same_v<acc_t, float>) {
        const PairBwdBuffers* ab = hd.ab.get();
        const int64_t lds = round32(nq);
        cpu::gemm_bf16_pairs(round32(m), lds, ab->e_pad, ab->q_rows.data() + i0 * ab->e_pad, ab->e_pad,
                           ab->k_tp.data(), 2 * round32(n), pt, lds, false);  // S = Q K^T
        if (!fold_scale)
          for (int64_t r = 0; r < m; ++r) Ops::scale(pt + r * lds, nq, s_scale);
      }
    } else {
      cpu::gemm(m, nq, E, s_scale, hd.qh + i0 * hd.ldq, hd.ldq, 1, hd.kt_buf.data(), transposed_ld(n), acc_t(0), pt,
                nq);  // S2 = log2(e) scale Q K^T
    }
  };

  // row_sub / row_inv of a head (see Head). Rows whose lse is too coarse
  // (lse_needs_exact_stats: finfo.min padding rows, huge logits) get their
  // exact max and sum from a pass over the keys with the same tiles and
  // products as the main loop, so the scores are the same to the bit and
  // S - max <= 0 there. Costs nothing when no row needs it.
  auto exact_row_stats = [&](const AttentionBwdParams& sp, Head& hd, int64_t b) {
    const int64_t L = sp.len_q, S = sp.len_kv;
    bool any = false;
    for (int64_t i = 0; i < L; ++i) {
      const acc_t x = hd.lse_h[i];
      hd.exact[i] = lse_needs_exact_stats(x) ? 1 : 0;
      any = any || hd.exact[i];
      hd.row_sub[i] = hd.exact[i] ? kNegInf : x * unit;
      hd.row_inv[i] = hd.exact[i] ? acc_t(0) : acc_t(1);  // the running sum until the end
    }
    if (!any) return;
    Buffer<acc_t> s_buf(kBlockM * kBlockN);
    const acc_t mul = fold_scale ? s_scale : acc_t(1);
    for (int64_t j0 = 0; j0 < S; j0 += kBlockN) {
      const int64_t n = std::min(kBlockN, S - j0);
      bool packed = false;
      for (int64_t i0 = first_row(sp, j0); i0 < rows_end(sp, j0, n); i0 += kBlockM) {
        const int64_t m = std::min(kBlockM, L - i0);
        const int64_t nq = std::min(n, visible_kv_end(sp, i0, m) - j0);
        if (nq <= 0 || std::find(hd.exact.begin() + i0, hd.exact.begin() + i0 + m, 1) == hd.exact.begin() + i0 + m)
          continue;
        if (!packed) pack_tile(sp, hd, b, j0, n), packed = true;
        const int64_t lds = pairs ? round32(nq) : nq;
        scores(hd, i0, m, n, nq, s_buf.data());
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          if (!hd.exact[i]) continue;
          acc_t* srow = s_buf.data() + r * lds;
          transform_row<scalar_t>(sp, b, hd.h, i, j0, nq, unit, srow);
          const acc_t new_max = std::max(hd.row_sub[i], Ops::max(srow, nq) * mul);
          if (new_max == kNegInf) continue;
          const acc_t alpha = hd.row_sub[i] == kNegInf ? acc_t(0) : Ops::expb(hd.row_sub[i] - new_max);
          hd.row_inv[i] = hd.row_inv[i] * alpha + Ops::exp_sub_sum(srow, nq, mul, new_max);
          hd.row_sub[i] = new_max;
        }
      }
    }
    for (int64_t i = 0; i < L; ++i)
      if (hd.exact[i]) hd.row_inv[i] = hd.row_inv[i] > acc_t(0) ? acc_t(1) / hd.row_inv[i] : acc_t(0);
  };

  at::parallel_for(0, p.batch * (H / group), 1, [&](int64_t begin, int64_t end) {
    const cpu::ReleaseTiles release{pairs && cpu::active_isa() == cpu::Isa::kAmx};  // (the tile unit's state, given back at the task's end)
    std::vector<Head> heads(group);
    for (Head& hd : heads) {
      // (on pair products they read PairBwdBuffers; dO is still read as acc_t for D)
      if (!pairs && tile_needs_pack<scalar_t, acc_t>(p.q_stride.col)) hd.q_buf.resize(L_max * E);
      if (tile_needs_pack<scalar_t, acc_t>(p.grad_out_stride.col)) hd.do_buf.resize(L_max * Ev);
      hd.row_d.resize(L_max);
      hd.row_sub.resize(L_max);
      hd.row_inv.resize(L_max);
      hd.exact.resize(L_max);
      hd.dq_acc.resize((pairs ? round32(L_max) : L_max) * ldq_acc);
      if (pairs) hd.ab.reset(new PairBwdBuffers(L_max, E, Ev));
      hd.k_buf.resize(pairs ? 0 : kBlockN * E);
      hd.kt_buf.resize(pairs ? 0 : transposed_ld(kBlockN) * E);  // K^T, (E x n), row stride ldt
      hd.vt_buf.resize(pairs ? 0 : transposed_ld(kBlockN) * Ev);  // V^T, (Ev x n), row stride ldt
    }
    Buffer<acc_t> o_buf(kBlockM * Ev);
    Buffer<acc_t> p_buf(kBlockM * kBlockN), dp_buf(kBlockM * kBlockN), raw(softcap ? kBlockN : 0);
    std::vector<uint8_t> keep(kBlockN);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H / group);
      const AttentionBwdParams sp = sequence_params<scalar_t, acc_t>(p, b);  // p itself unless varlen
      const int64_t L = sp.len_q, S = sp.len_kv;
      const scalar_t* q = static_cast<const scalar_t*>(sp.q);
      const scalar_t* o = static_cast<const scalar_t*>(sp.out);
      const scalar_t* dout = static_cast<const scalar_t*>(sp.grad_out);
      for (int64_t g = 0; g < group; ++g) {  // the heads' setup: zeroed gradients, D, packed Q and dO
        Head& hd = heads[g];
        const int64_t h = (item % (H / group)) * group + g;
        hd.h = h;
        hd.hk = h / G;
        hd.dk = static_cast<acc_t*>(sp.grad_k) + b * p.grad_k_stride.b + h * p.grad_k_stride.h;
        hd.dv = static_cast<acc_t*>(sp.grad_v) + b * p.grad_v_stride.b + h * p.grad_v_stride.h;
        hd.ld_dk = p.grad_k_stride.row;
        hd.ld_dv = p.grad_v_stride.row;
        for (int64_t j = 0; j < S; ++j) {
          std::fill(hd.dk + j * hd.ld_dk, hd.dk + j * hd.ld_dk + E, acc_t(0));
          std::fill(hd.dv + j * hd.ld_dv, hd.dv + j * hd.ld_dv + Ev, acc_t(0));
        }
        std::fill(hd.dq_acc.begin(), hd.dq_acc.end(), acc_t(0));
        int64_t ldo = 0;
        hd.qh = pairs ? nullptr
                    : load_tile(q + b * p.q_stride.b + h * p.q_stride.h, p.q_stride.row, p.q_stride.col, L, E,
                                hd.q_buf.data(), &hd.ldq);
        hd.doh = load_tile(dout + b * p.grad_out_stride.b + h * p.grad_out_stride.h, p.grad_out_stride.row,
                           p.grad_out_stride.col, L, Ev, hd.do_buf.data(), &hd.lddo);
        if constexpr (kBf16) {
          if (pairs) {
            PairBwdBuffers::pack_head(q + b * p.q_stride.b + h * p.q_stride.h, p.q_stride.row, p.q_stride.col, L, E,
                                     hd.ab->e_pad, hd.ab->q_rows.data(), hd.ab->q_pairs.data());
            PairBwdBuffers::pack_head(dout + b * p.grad_out_stride.b + h * p.grad_out_stride.h,
                                     p.grad_out_stride.row, p.grad_out_stride.col, L, Ev, hd.ab->ev_pad,
                                     hd.ab->do_rows.data(), hd.ab->do_pairs.data());
          }
        }
        for (int64_t i0 = 0; i0 < L; i0 += kBlockM) {  // D = rowsum(dO * O)
          const int64_t m = std::min(kBlockM, L - i0);
          const scalar_t* o_blk = o + b * p.out_stride.b + h * p.out_stride.h + i0 * p.out_stride.row;
          if constexpr (kBf16) {
            if (pairs && cpu::active_isa() == cpu::Isa::kAvx512Bf16) {  // in dP's arithmetic (not on the tile unit)
              PairBwdBuffers* ab = hd.ab.get();
              pack_a_bf16(o_blk, p.out_stride.row, p.out_stride.col, m, Ev, m, ab->ev_pad, ab->o_rows.data());
              if (cpu::row_dots_bf16_pairs(ab->do_rows.data() + i0 * ab->ev_pad, ab->ev_pad, ab->o_rows.data(),
                                           ab->ev_pad, m, ab->ev_pad, hd.row_d.data() + i0))
                continue;
            }
          }
          const acc_t* ot = load_tile(o_blk, p.out_stride.row, p.out_stride.col, m, Ev, o_buf.data(), &ldo);
          if constexpr (std::is_same_v<acc_t, float>) {  // in dP's arithmetic (cpu::row_dots)
            cpu::row_dots(hd.doh + i0 * hd.lddo, hd.lddo, ot, ldo, m, Ev, hd.row_d.data() + i0);
          } else {  // (double: the portable GEMM's order, one sum in k order)
            for (int64_t r = 0; r < m; ++r)
              hd.row_d[i0 + r] = Ops::dot(hd.doh + (i0 + r) * hd.lddo, ot + r * ldo, Ev);
          }
        }
        hd.lse_h = lse + sp.lse_index(b, h, 0);
        exact_row_stats(sp, hd, b);  // after the packing: on pair products they read q_rows
      }

      for (int64_t j0 = 0; j0 < S; j0 += kBlockN) {
        const int64_t n = std::min(kBlockN, S - j0);
        const int64_t ldt = transposed_ld(n);
        const int64_t n32 = round32(n);
        for (Head& hd : heads) pack_tile(sp, hd, b, j0, n);
        for (int64_t i0 = first_row(sp, j0); i0 < rows_end(sp, j0, n); i0 += kBlockM) {
          const int64_t m = std::min(kBlockM, L - i0);
          const int64_t nq = std::min(n, visible_kv_end(sp, i0, m) - j0);
          if (nq <= 0) continue;
          // a block a bool mask hides from every row of the item's heads adds nothing (P = 0): V not
          // read, as the forward skips its tiles (bool_mask_hides_tile)
          if (p.mask_kind == MaskKind::kBool &&
              std::all_of(heads.begin(), heads.end(),
                          [&](const Head& hd) { return bool_mask_hides_tile(sp, b, hd.h, 1, i0, m, j0, nq); }))
            continue;
          const int64_t lds = pairs ? round32(nq) : nq;  // P and dP row stride
          for (Head& hd : heads) {
            const int64_t h = hd.h;
            [[maybe_unused]] PairBwdBuffers* ab = hd.ab.get();
            const acc_t* qt = pairs ? nullptr : hd.qh + i0 * hd.ldq;
            const acc_t* dot = hd.doh + i0 * hd.lddo;
            const acc_t* v_t = hd.vt_buf.data();
            acc_t* pt = p_buf.data();
            acc_t* dpt = dp_buf.data();
            scores(hd, i0, m, n, nq, pt);
            if (pairs) {
              if constexpr (std::is_same_v<acc_t, float>) {
                cpu::gemm_bf16_pairs(round32(m), lds, ab->ev_pad, ab->do_rows.data() + i0 * ab->ev_pad, ab->ev_pad,
                                   ab->v_tp.data(), 2 * n32, dpt, lds, false);  // dP = dO V^T
              }
            } else {
              cpu::gemm(m, nq, Ev, acc_t(1), dot, hd.lddo, 1, v_t, ldt, acc_t(0), dpt, nq);  // dP = dO V^T
            }
            for (int64_t r = 0; r < m; ++r) {
              const int64_t i = i0 + r;
              acc_t* prow = pt + r * lds;
              acc_t* dprow = dpt + r * lds;
              if (hd.lse_h[i] == kNegInf) {  // fully masked row: P = 0, no gradient
                std::fill(prow, prow + nq, acc_t(0));
                std::fill(dprow, dprow + nq, acc_t(0));
                continue;
              }
              if (softcap) std::copy(prow, prow + nq, raw.data());  // for the softcap's derivative
              transform_row<scalar_t>(sp, b, h, i, j0, nq, unit, prow);
              Ops::exp_sub_sum(prow, nq, fold_scale ? s_scale : acc_t(1), hd.row_sub[i]);
              if (hd.exact[i]) Ops::scale(prow, nq, hd.row_inv[i]);
              if (p.dropout.enabled()) {
                // O = sum_j P_j z_j V_j / (1 - p): the gradient wrt P_j is z_j dP_j / (1 - p),
                // and dV takes the dropped, rescaled P.
                dropout_keep_row_cpu(p.dropout, dropout_row_id(sp, b, h, i), j0, nq, keep.data());
                Ops::dropout_softmax_grad(prow, dprow, keep.data(), nq, rescale, hd.row_d[i]);
              } else {
                Ops::softmax_grad(prow, dprow, nq, hd.row_d[i]);
              }
              if (dmask_all != nullptr) {  // the mask is added after the softcap: its gradient is dS
                acc_t* gm = dmask_all + ((b * H + h) * L + i) * S + j0;
                std::copy(dprow, dprow + nq, gm);
              }
              if (softcap) softcap_grad_row(p, raw.data(), nq, unit, dprow);
            }
            if (pairs) {
              if constexpr (std::is_same_v<acc_t, float>) {
                ab->gemm_at(pt, lds, m, nq, ab->do_pairs.data() + i0 * ab->ev_pad, ab->ev_pad, ab->dv_tile.data(),
                            ab->ev_pad);  // dV += P~^T dO
                for (int64_t r = 0; r < m; ++r) Ops::scale(dpt + r * lds, nq, scale);  // scale dS for dQ and dK
                cpu::pack_bf16_rows(dpt, lds, m, nq, round32(m), lds, ab->a_bf.data());
                cpu::gemm_bf16_pairs(round32(m), ab->e_pad, lds, ab->a_bf.data(), lds, ab->k_pairs.data(),
                                   2 * ab->e_pad, hd.dq_acc.data() + i0 * ldq_acc, ldq_acc, true);  // dQ += scale dS K
                ab->gemm_at(dpt, lds, m, nq, ab->q_pairs.data() + i0 * ab->e_pad, ab->e_pad, ab->dk_tile.data(),
                            ab->e_pad);  // dK += scale dS^T Q
              }
            } else {
              cpu::gemm(nq, Ev, m, acc_t(1), pt, 1, nq, dot, hd.lddo, acc_t(1), hd.dv + j0 * hd.ld_dv,
                        hd.ld_dv);  // dV += P~^T dO
              cpu::gemm(m, E, nq, scale, dpt, nq, 1, hd.kt, hd.ldk, acc_t(1), hd.dq_acc.data() + i0 * E,
                        E);  // dQ += scale dS K
              cpu::gemm(nq, E, m, scale, dpt, 1, nq, qt, hd.ldq, acc_t(1), hd.dk + j0 * hd.ld_dk,
                        hd.ld_dk);  // dK += scale dS^T Q
            }
          }
        }
        if (pairs) {  // the tile's dK and dV, unpadded
          for (Head& hd : heads) {
            const PairBwdBuffers* ab = hd.ab.get();
            for (int64_t j = 0; j < n; ++j) {
              std::copy(ab->dk_tile.begin() + j * ab->e_pad, ab->dk_tile.begin() + j * ab->e_pad + E,
                        hd.dk + (j0 + j) * hd.ld_dk);
              std::copy(ab->dv_tile.begin() + j * ab->ev_pad, ab->dv_tile.begin() + j * ab->ev_pad + Ev,
                        hd.dv + (j0 + j) * hd.ld_dv);
            }
          }
        }
      }
      for (const Head& hd : heads) {
        scalar_t* dq_rows = static_cast<scalar_t*>(sp.grad_q) + b * p.grad_q_stride.b + hd.h * p.grad_q_stride.h;
        for (int64_t i = 0; i < L; ++i)
          for (int64_t e = 0; e < E; ++e)
            dq_rows[i * p.grad_q_stride.row + e] = static_cast<scalar_t>(hd.dq_acc[i * ldq_acc + e]);
      }
    }
  });
}

template void attention_bwd_kernel<double>(const AttentionBwdParams& p);
template void attention_bwd_kernel<float>(const AttentionBwdParams& p);
template void attention_bwd_kernel<c10::Half>(const AttentionBwdParams& p);
template void attention_bwd_kernel<c10::BFloat16>(const AttentionBwdParams& p);

}  // namespace mha_ext
