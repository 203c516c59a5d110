// CPU attention kernels, FlashAttention-2 style: the forward.
//
// Forward: work items are (batch, query head, chunk of kChunkM query rows),
// spread over threads with at::parallel_for. A chunk streams key/value tiles of
// kBlockN rows (from K^T packed once per head and thread, or per item when a
// shared mask orders the items heads-inner); each of its kBlockM-row
// query blocks multiplies into a kBlockM x kBlockN score tile, runs the online
// softmax (running row max and sum) and accumulates its output rows. Extra
// memory: per-thread tiles and packed key head (O(S)) plus the O(L)
// logsumexp per head.
//
// Matrix products on tiles go to cpu::gemm (gemm_cpu.h): register-blocked,
// deterministic, with the instruction set chosen at run time; half and
// bfloat16 tiles are widened to float first.
#include "kernel_common_cpu.h"

#include <vector>

namespace mha_ext {

void dropout_keep_row_cpu(const DropoutParams& d, uint64_t row, int64_t j0, int64_t n, uint8_t* keep) {
  j0 += dropout_frame(d).col0;
  int64_t t = 0;
  const int64_t head = std::min<int64_t>(n, (4 - (j0 & 3)) & 3);  // up to a multiple of 4
  if (head > 0) dropout_keep_row(d.seed, d.offset, row, j0, head, d.drop_threshold, keep);
  t = head;
  const int64_t blocks = (n - t) / 64;
  if (blocks > 0)
    cpu::philox_keep64(d.seed, row, d.offset + static_cast<uint64_t>((j0 + t) >> 2), d.drop_threshold, blocks, keep + t);
  t += 64 * blocks;
  if (t < n) dropout_keep_row(d.seed, d.offset, row, j0 + t, n - t, d.drop_threshold, keep + t);
}

template <typename scalar_t>
void attention_fwd_kernel(const AttentionFwdParams& p) {
  if (use_decode_kernel(p, std::is_same_v<scalar_t, c10::BFloat16>)) return attention_decode_kernel<scalar_t>(p);
  TORCH_CHECK(p.block_table == nullptr, "internal: a paged KV cache reaches the dense CPU kernel");
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = RowOps<acc_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t H = p.heads_q, L = p.len_q, E = p.head_dim, Ev = p.head_dim_v;
  const int64_t G = p.group_size();
  const int64_t n_chunks = (L + kChunkM - 1) / kChunkM;
  const acc_t unit = Ops::kUnitsPerNat;
  const acc_t scale = static_cast<acc_t>(p.scale) * unit;  // scores in the kernel's units
  const acc_t rescale = static_cast<acc_t>(p.dropout.rescale);
  acc_t* lse = static_cast<acc_t*>(p.lse);

  // bfloat16 on pair products (Isa::kAvx512Bf16: vdpbf16ps; Isa::kAmx: the
  // tile unit): Q, K, V and P stay bfloat16 and multiply in pairs with float
  // sums (cpu::gemm_bf16_pairs), padded to multiples of 32; S and O are float.
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const bool pairs = kBf16 && cpu::active_isa() >= cpu::Isa::kAvx512Bf16;
  const int64_t e_pad = round32(E), ev_pad = round32(Ev);
  const int64_t ldo = pairs ? ev_pad : Ev;  // o_acc row stride
  // Pair products give unscaled scores: without a float mask (added to
  // scaled scores) and with scale > 0 (so the row max scales with it), the
  // scale moves into the exponential's argument instead of a pass of its own.
  const bool fold_scale = pairs && p.mask_kind != MaskKind::kFloat && !p.variant.changes_scores() && scale > acc_t(0);
  // and without dropout, the exponential writes P in bfloat16 straight away
  const bool fuse_p = pairs && !p.dropout.enabled();

  // Work item: (batch, head, chunk of kChunkM query rows); in a varlen batch
  // L is the longest sequence's and the chunks past a sequence's end are empty. K^T of the whole
  // key head (on pair products: K and V in their pair layouts) is packed when
  // a thread's item moves to another key head; consecutive items are chunks of
  // one head, so a head is packed about once per thread rather than once per
  // chunk (O(S) memory per thread; with a mask shared by the heads the order
  // is different, see heads_inner). Each kBlockM-row query block of a chunk
  // then reads its key/value tile from there.
  const int64_t s32 = round32(p.len_kv);
  // K's pair rows, 32 bf16 longer than the head: at exactly 2 s32 a
  // long head put the 16 rows of a tile load 8 KiB apart, all in one L1 set
  // (the tile loads of S = Q K^T were two thirds of the forward's product time)
  const int64_t ld_kbf = 2 * s32 + 32;
  const int64_t ldkt = transposed_ld(p.len_kv);  // K^T row stride
  // With a shared mask that outgrows L2, items go chunk-major, heads inner: a
  // chunk's mask rows (256 x S) are still in L2 for the next head, at the
  // price of packing K^T whenever the key head changes (every item unless GQA
  // groups the heads). In-process A/B, 1 thread, forward with
  // a (1, L, L) float mask, 12 heads x 64: L = 1024 53.2 vs 59.3 ms, L = 2048
  // 221 vs 228; at L = 512 (a 1 MiB mask) 18.4 vs 18.3 with 20 heads.
  const bool heads_inner = shared_mask_outgrows_l2<scalar_t>(p);
  const bool bool_mask = p.mask_kind == MaskKind::kBool;
  // A single query row (decoding: one row against the whole cache) without GQA
  // take their scores as dot products with K's rows, read in place, instead
  // of packing K^T of the whole head for them: packing costs as much as the
  // product there. With GQA the packed K^T serves the group's query heads and
  // still pays. Measured (float32, query length 1, 2 threads, torch time /
  // ours, before -> after): 4 x 12 heads x 64, S = 4096: 1.03 -> 1.33-1.54,
  // S = 32768: 0.93 -> 1.29-1.66; with GQA (8 on 2 heads x 64) it lost
  // (1.07 -> 0.87-0.91 at S = 4096).
  const bool row_dots = !pairs && L <= kRowDotRows && G == 1;
  at::parallel_for(0, p.batch * H * n_chunks, 1, [&](int64_t begin, int64_t end) {
    const cpu::ReleaseTiles release{pairs && cpu::active_isa() == cpu::Isa::kAmx};  // (the tile unit's state, given back at the task's end)
    Buffer<acc_t> q_buf(pairs ? 0 : kChunkM * E), kt_head(pairs || row_dots ? 0 : E * ldkt),
        v_buf(pairs ? 0 : kBlockN * Ev), k_rows(row_dots ? kBlockN * E : 0);
    Buffer<acc_t> s_buf(kBlockM * kBlockN), o_acc(kChunkM * ldo), row_max(kChunkM),
        row_sum(kChunkM);
    Buffer<uint16_t> q_bf(pairs ? kChunkM * e_pad : 0), k_bf(pairs ? e_pad / 2 * ld_kbf : 0),
        v_bf(pairs ? s32 * ev_pad : 0), v_edge(pairs ? kBlockN * ev_pad : 0), p_bf(pairs ? kBlockM * kBlockN : 0);
    std::vector<uint8_t> keep(kBlockN);
    int64_t packed_head = -1;
    for (int64_t w = begin; w < end; ++w) {
      int64_t chunk = w % n_chunks, bh = w / n_chunks;  // w = (b, h, chunk)
      if (heads_inner) {  // w = (b, chunk, h)
        const int64_t bc = w / H;
        chunk = bc % n_chunks;
        bh = (bc / n_chunks) * H + w % H;
      }
      const int64_t h = bh % H, b = bh / H, hk = h / G;
      const AttentionFwdParams sp = sequence_params<scalar_t, acc_t>(p, b);  // p itself unless varlen
      const int64_t S_kv = sp.len_kv, c0 = chunk * kChunkM, cm = std::min(kChunkM, sp.len_q - c0);
      if (cm <= 0) continue;
      const scalar_t* q = static_cast<const scalar_t*>(sp.q);
      const scalar_t* k = static_cast<const scalar_t*>(sp.k);
      const scalar_t* v = static_cast<const scalar_t*>(sp.v);
      scalar_t* out = static_cast<scalar_t*>(sp.out);
      if (b * p.heads_kv + hk != packed_head) {
        packed_head = b * p.heads_kv + hk;
        const scalar_t* k_head = k + b * p.k_stride.b + hk * p.k_stride.h;
        if constexpr (kBf16) {
          if (pairs) {
            pack_kt_pairs(k_head, p.k_stride.row, p.k_stride.col, S_kv, E, s32, e_pad, ld_kbf, k_bf.data());
            pack_v_pairs(v + b * p.v_stride.b + hk * p.v_stride.h, p.v_stride.row, p.v_stride.col, S_kv, Ev, s32,
                         ev_pad, v_bf.data());
          }
        }
        if (!pairs && !row_dots)
          load_tile_transposed(k_head, p.k_stride.row, p.k_stride.col, S_kv, E, kt_head.data(), ldkt);
      }
      int64_t ldq = 0, ldv = 0;
      const scalar_t* q_chunk = q + b * p.q_stride.b + h * p.q_stride.h + c0 * p.q_stride.row;
      const acc_t* qc = nullptr;
      if constexpr (kBf16) {
        if (pairs) pack_a_bf16(q_chunk, p.q_stride.row, p.q_stride.col, cm, E, round32(cm), e_pad, q_bf.data());
      }
      if (!pairs) qc = load_tile(q_chunk, p.q_stride.row, p.q_stride.col, cm, E, q_buf.data(), &ldq);
      std::fill(o_acc.begin(), o_acc.begin() + round32(cm) * ldo, acc_t(0));
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), acc_t(0));

      // key tiles some row of the chunk may see (a window skips the others;
      // tiles start on multiples of kBlockN, where the packed layouts expect them)
      const int64_t chunk_kv_end = visible_kv_end(sp, c0, cm);
      for (int64_t j0 = visible_kv_begin(sp, c0) / kBlockN * kBlockN; j0 < chunk_kv_end; j0 += kBlockN) {
        const int64_t n = std::min(kBlockN, chunk_kv_end - j0);
        // (and the tiles a bool mask hides from all the chunk's rows: bool_mask_hides_tile)
        if (bool_mask && bool_mask_hides_tile(sp, b, h, 1, c0, cm, j0, n)) continue;
        const scalar_t* v_tile = v + b * p.v_stride.b + hk * p.v_stride.h + j0 * p.v_stride.row;
        const acc_t* k_t = kt_head.data() + j0;  // K^T of the tile, (E x n), row stride ldkt
        const uint16_t* k_bf_tile = k_bf.data() + 2 * j0;  // pairs: pair rows, ld_kbf apart
        const uint16_t* v_bf_tile = v_bf.data() + j0 * ev_pad;  // pairs: pair rows from key j0
        const acc_t* vt = pairs ? nullptr : load_tile(v_tile, p.v_stride.row, p.v_stride.col, n, Ev, v_buf.data(), &ldv);
        int64_t ldk = 0;  // row_dots: K's rows of the tile, (n x E), in place where they can be
        const acc_t* kr = row_dots ? load_tile(k + b * p.k_stride.b + hk * p.k_stride.h + j0 * p.k_stride.row,
                                               p.k_stride.row, p.k_stride.col, n, E, k_rows.data(), &ldk)
                                   : nullptr;
        for (int64_t r0 = 0; r0 < cm; r0 += kBlockM) {
          const int64_t i0 = c0 + r0, m = std::min(kBlockM, cm - r0);
          const int64_t nq = std::min(n, visible_kv_end(sp, i0, m) - j0);  // causal: fewer columns
          if (nq <= 0 || visible_kv_begin(sp, i0) >= j0 + n) continue;     // the block sees none of the tile
          if (bool_mask && bool_mask_hides_tile(sp, b, h, 1, i0, m, j0, nq)) continue;  // nor does the mask show it
          acc_t* s = s_buf.data();
          acc_t* o_blk = o_acc.data() + r0 * ldo;
          const int64_t lds = pairs ? round32(nq) : nq;  // S row stride
          if (pairs) {  // S = Q K^T in pairs, then the scale (unless it rides in the exponential)
            if constexpr (std::is_same_v<acc_t, float>) {
              cpu::gemm_bf16_pairs(round32(m), lds, e_pad, q_bf.data() + r0 * e_pad, e_pad, k_bf_tile, ld_kbf, s,
                                 lds, false);
              if (!fold_scale)
                for (int64_t r = 0; r < m; ++r) Ops::scale(s + r * lds, nq, scale);
            }
          } else if (row_dots) {  // (E = 0: scores 0, as the product gives, not inf * 0)
            for (int64_t r = 0; r < m; ++r)
              for (int64_t c = 0; c < nq; ++c)
                s[r * nq + c] = E > 0 ? scale * Ops::dot(qc + (r0 + r) * ldq, kr + c * ldk, E) : acc_t(0);
          } else {
            cpu::gemm(m, nq, E, scale, qc + r0 * ldq, ldq, 1, k_t, ldkt, acc_t(0), s, nq);  // S2 = log2(e) scale Q K^T
          }
          for (int64_t r = 0; r < m; ++r) {
            acc_t* srow = s + r * lds;
            const int64_t i = i0 + r;
            acc_t& rmax = row_max[r0 + r];
            transform_row<scalar_t>(sp, b, h, i, j0, nq, unit, srow);
            acc_t tile_max = Ops::max(srow, nq) * (fold_scale ? scale : acc_t(1));
            if (tile_max == kNegInf && has_nan(srow, nq)) tile_max = std::numeric_limits<acc_t>::quiet_NaN();
            const acc_t new_max = nan_max(rmax, tile_max);
            if (new_max == kNegInf) {  // every key so far is masked: P = 0
              std::fill(srow, srow + nq, acc_t(0));
              if (fuse_p) std::fill(p_bf.begin() + r * lds, p_bf.begin() + (r + 1) * lds, uint16_t(0));
              continue;
            }
            const acc_t alpha = rmax == kNegInf ? acc_t(0) : Ops::expb(rmax - new_max);
            const acc_t mul = fold_scale ? scale : acc_t(1);
            acc_t sum;
            if constexpr (kBf16) {
              sum = fuse_p ? cpu::exp2_sub_sum_bf16(srow, nq, mul, new_max, p_bf.data() + r * lds, lds)
                           : Ops::exp_sub_sum(srow, nq, mul, new_max);
            } else {
              sum = Ops::exp_sub_sum(srow, nq, mul, new_max);
            }
            row_sum[r0 + r] = row_sum[r0 + r] * alpha + sum;
            rmax = new_max;
            if (alpha != acc_t(1)) Ops::scale(o_blk + r * ldo, Ev, alpha);
            if (p.dropout.enabled()) {
              dropout_keep_row_cpu(p.dropout, dropout_row_id(sp, b, h, i), j0, nq, keep.data());
              Ops::apply_keep(srow, keep.data(), nq, rescale);
            }
          }
          if (pairs) {  // O += P V in pairs, P rounded to bfloat16
            if constexpr (kBf16) {
              if (!fuse_p) {
                cpu::pack_bf16_rows(s, lds, m, nq, round32(m), lds, p_bf.data());
              } else if (m < round32(m)) {
                std::fill(p_bf.begin() + m * lds, p_bf.begin() + round32(m) * lds, uint16_t(0));
              }
              const uint16_t* vb = v_bf_tile;
              if (lds > nq && j0 + nq < S_kv) {  // ragged edge with keys after it: the rows past nq must be
                                                 // zero, not those keys (0 * NaN = NaN); past S_kv v_bf is zero
                pack_v_pairs(v_tile, p.v_stride.row, p.v_stride.col, nq, Ev, lds, ev_pad, v_edge.data());
                vb = v_edge.data();
              }
              cpu::gemm_bf16_pairs(round32(m), ev_pad, lds, p_bf.data(), lds, vb, 2 * ev_pad, o_blk, ldo, true);
            }
          } else {
            cpu::gemm(m, Ev, nq, acc_t(1), s, nq, 1, vt, ldv, acc_t(1), o_blk, Ev);  // O += P V
          }
        }
      }

      for (int64_t r = 0; r < cm; ++r) {
        const int64_t i = c0 + r;
        const acc_t l = row_sum[r];
        const acc_t inv = l > acc_t(0) ? acc_t(1) / l : acc_t(0);
        scalar_t* orow = out + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
        const acc_t* arow = o_acc.data() + r * ldo;
        for (int64_t e = 0; e < Ev; ++e) orow[e * p.out_stride.col] = static_cast<scalar_t>(arow[e] * inv);
        // l is 0 only when every key of the row is masked: lse = -inf there.
        // A NaN anywhere in the row's scores makes l, and so lse, NaN.
        lse[sp.lse_index(b, h, i)] = l > acc_t(0) ? (row_max[r] + Ops::logb(l)) / unit : (l == l ? kNegInf : l);
      }
    }
  });
}

template void attention_fwd_kernel<double>(const AttentionFwdParams& p);
template void attention_fwd_kernel<float>(const AttentionFwdParams& p);
template void attention_fwd_kernel<c10::Half>(const AttentionFwdParams& p);
template void attention_fwd_kernel<c10::BFloat16>(const AttentionFwdParams& p);

}  // namespace mha_ext
