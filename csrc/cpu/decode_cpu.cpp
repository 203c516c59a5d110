// CPU attention kernels: the decode kernel, which attention_fwd_kernel
// (forward_cpu.cpp) runs for calls of few query rows per key/value head.
#include "kernel_common_cpu.h"

#include <atomic>
#include <cstdlib>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace mha_ext {

// Decode: few query rows per key/value head (a KV cache step, G L <= kDecodeRows
// rows for the G query heads of a GQA group, or up to kDecodeRowsLong against
// many keys), dense, without dropout. Memory bound: the work is reading K and
// V, so each is read once for all R = G L rows of its group, in place
// (float32 with unit column stride) or widened per tile, never packed as K^T.
// Work items are (batch, key/value head, key split): S = Q K^T as a dot
// product per (row, key) (cpu::dot_rows: each key row read once for the rows,
// whole and in address order), the online softmax per row (transform_row as
// in the dense kernel), O += P V (cpu::acc_rows: value rows the same way).
// When batch x key/value heads gives fewer than kDecodeItems items the keys
// split into runs of whole tiles (flash-decoding); each split leaves its
// rows' max, sum and unnormalised O, merged in split order. The split count
// depends on the shape alone, so results do not depend on the thread count.
constexpr int64_t kDecodeRows = 16;
// And up to kDecodeRowsLong rows where the keys number kDecodeKeysPerRow
// times the rows or more (a KV-cache step of several tokens, a speculative
// step, a GQA group of 8 or 16): there the dense kernel reads each K/V tile
// once per query head of the group and, in bfloat16 on the pair products,
// pads each head's few rows to 32. Against the dense kernel, interleaved
// (AMD EPYC of family 25 model 17, 2 threads; 32 / 8 x 128 heads with 8 and 16
// query rows against 512-32k keys, 64 / 8 and 14 / 2 heads with 8 rows,
// 12 x 64 heads with 32 rows against 4k keys): float32 0.97-2.78x, bfloat16
// 1.07-4.95x, float16 1.06-2.89x; where the keys are few (L = S = 16-64,
// 64 rows against 256 keys) 0.61-1.24x, mostly below 1, so those stay dense.
// The keys counted are those the rows may see (a window's span, not the whole
// cache). bfloat16 on AMX keeps 16: the tile routines take 16 rows, and larger
// groups there were not measured against the dense kernel's tiles.
constexpr int64_t kDecodeRowsLong = 64;
constexpr int64_t kDecodeKeysPerRow = 8;
// (the AMX tile routines take at most 16 rows)
constexpr int64_t kAmxRowsMax = 16;
constexpr int64_t kDecodeItems = 64;  // enough work items for 64 threads
constexpr int64_t kGroupBytes = 32 * 1024;
// bfloat16 rows a key/value head from which the AMX tile routines take the
// products: against the AVX512-BF16 ones, interleaved (Intel Xeon with AMX,
// 2 threads, head dims 64 and 128, adjacent rows): 4 rows (one query of a
// GQA group of four, or four query rows of a head) 0.98-1.33x (2k and 8k keys;
// the 0.98 with four query rows of 12 x 12 x 64 heads from memory);
// 8 rows 1.19-1.45x, 12 rows 1.74x, 16 rows 1.44-1.95x before the value tiles
// were read in place (amx_cpu.cpp), which took 16 rows 1.17-1.25x further;
// one row 0.70-0.77x (other row counts, strided or paged rows not timed)
constexpr int64_t kAmxDecodeRows = 4;
// K and V bytes of a call above which they are taken to come from memory
// (they would not stay in a 32 MiB last-level cache from one call to the
// next): the row routines add their far fetch (rows_avx512.h) to rows of more
// than 64 columns
constexpr int64_t kFromMemoryBytes = 32 * 1024 * 1024;
// Rows of at most 64 columns take the far fetch from 4 MiB of K/V on (more
// than the cores' L2 holds): in a model's decode step every other layer's K/V
// and weights pass between two calls of a layer, so its K/V come from memory
// well under 32 MiB. A loop over 12 and 32 layers' caches against the 32 MiB
// gate, interleaved (Intel Xeon of model 167, 2 threads; 6-24 MiB a layer,
// 12 x 12 x 64, 32 x 8 x 64, 16 x 4 x 64 and 14 x 2 x 64 heads, one query; the
// AMX, AVX-512 and AVX2 paths): 1.00-1.17x; one layer's K/V called back to
// back, in the caches, 0.97-1.01x. Wider rows gained nothing there (32 x 8 x 128 heads of
// float32 from memory 1.00x) and lost up to 0.85x in the caches, so they keep
// the 32 MiB gate (docs/performance.md, "The far fetch for narrow rows").
// Except 16-bit rows of up to 128 columns, adjacent, with two query rows or
// more a key/value head, which also take it from 4 MiB on, fetching their
// own bytes a page ahead with it (PageFetch::first_pass): against the 32
// MiB gate and the block's spread lines, interleaved (AMD EPYC of family 25
// model 17, 2 threads, bit-identical): 2-8 bfloat16 rows of 32 x 8 x 128
// (16 x 8, 24 x 8) heads over 6 layers' caches of 8k keys 1.14-1.49x, 12
// layers' of 2k-4k 1.11-1.43x, 4 of 32k 1.19x, float16 1.03-1.18x; the AVX2
// path 1.31-1.46x; single calls past 32 MiB (the far fetch before too)
// 0.89-1.23x in six runs, median 1.03; one call back to back in the caches
// 0.92-0.96x. A (B, S, H, D) cache's rows lost so (0.79-0.93x) and keep the
// 32 MiB gate (docs/performance.md, "Decoding on an AMD EPYC of family 25
// model 17"). (128 columns: kPerRowBytes of rows_avx512.h in 16-bit elements,
// the rows that fetch their own bytes.)
constexpr int64_t kFarNarrowBytes = 4 * 1024 * 1024;

// The decode kernel's per-thread buffers (rows of Q, scores, O and its
// statistics, strided K / V rows), kept by each thread from call to call and
// grown as calls need (every element is written before it is read): allocated
// and zeroed on every call, they took 1.1-1.2x the time of a call of 12 heads
// and 16-256 keys in bfloat16 (interleaved, Intel Xeon, 2 threads).
template <typename acc_t>
struct DecodeScratch {
  Buffer<acc_t> qr, s, o, m, l, acc, k, v;
  Buffer<uint16_t> q_pairs, q_bits;
  void reserve(int64_t n_qr, int64_t n_s, int64_t n_pairs, int64_t n_o, int64_t n_ml, int64_t n_acc,
               int64_t n_bits, int64_t n_k, int64_t n_v) {
    grow(qr, n_qr), grow(s, n_s), grow(q_pairs, n_pairs), grow(o, n_o), grow(m, n_ml), grow(l, n_ml);
    grow(acc, n_acc), grow(q_bits, n_bits), grow(k, n_k), grow(v, n_v);
  }
  template <typename T>
  static void grow(Buffer<T>& b, int64_t n) {
    if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  }
};

// A varlen batch takes it only where the dense kernel pads each sequence's
// rows to 32 (bfloat16 on the pair products of AVX512-BF16; AMX not
// measured, so it stays dense there). Against the dense kernel,
// interleaved (AMD EPYC of family 25 model 17, 2 threads, causal; 256
// sequences of 16 rows or of 1-16, 512 of 8, 1024 of 2 with 8-12 heads of 64;
// 128 of 4 with 32 / 8 heads of 128; 64 of 16 with 4 heads of 128): bfloat16
// there 1.04-5.08x; float32 0.63-1.31x and float16 0.81-1.16x, so those stay
// dense (rows past a sequence's own length are computed on zero Q there).
//
// MHA_EXT_CPU_DECODE=off (read at each call; default auto) gives every call
// to the dense kernel (a paged KV cache is then gathered first), so that the
// two run side by side on the same calls (bench/bench_decode.py --dense).
bool use_decode_kernel(const AttentionFwdParams& p, bool bf16) {
  if (const char* v = std::getenv("MHA_EXT_CPU_DECODE")) {
    const std::string mode = v;
    TORCH_CHECK(mode == "auto" || mode == "off", "MHA_EXT_CPU_DECODE must be \"auto\" or \"off\", got \"", mode,
                "\"");
    if (mode == "off") return false;
  }
  const cpu::Isa isa = cpu::active_isa();
  if (p.dropout.enabled() || (p.cu_seqlens_q != nullptr && !(bf16 && isa == cpu::Isa::kAvx512Bf16))) return false;
  const int64_t R = p.len_q * p.group_size();
  if (R <= kDecodeRows) return true;
  if (R > kDecodeRowsLong || (bf16 && isa == cpu::Isa::kAmx)) return false;
  // the keys some row may see (a window bounds them)
  const int64_t keys = visible_kv_end(p, 0, p.len_q) - std::max<int64_t>(visible_kv_begin(p, 0), 0);
  return keys >= kDecodeKeysPerRow * R;
}

template <typename scalar_t>
void attention_decode_kernel(const AttentionFwdParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  using Ops = RowOps<acc_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t Hkv = p.heads_kv, G = p.group_size(), L = p.len_q, R = G * L;
  const int64_t E = p.head_dim, Ev = p.head_dim_v;
  const acc_t unit = Ops::kUnitsPerNat;
  const acc_t scale = static_cast<acc_t>(p.scale) * unit;
  // bfloat16 / float16: K and V are widened in registers (without AVX-512,
  // V in kVRows-row pieces, 32 KiB at 128 columns, never as whole tiles that
  // would pass through L2 twice: a third of a bfloat16 decode's time went there)
  constexpr bool kHalfBits = std::is_same_v<acc_t, float> && sizeof(scalar_t) == 2;
  constexpr int64_t kVRows = 64;
  // the key tiles some row may see, and the splits: runs of whole tiles (from
  // the longest key count of a KV cache; a split past a shorter one is empty)
  int64_t kv_begin = visible_kv_begin(p, 0) / kBlockN * kBlockN;
  // (with a bool mask, up to the last tile it shows some row of the call: a
  // static KV cache's masked rows past its length are neither read nor split
  // over; the tiles it hides from all of an item's rows are skipped below)
  int64_t kv_end = visible_kv_end(p, 0, L);
  if (p.mask_kind == MaskKind::kBool && p.seqlens_k == nullptr) {
    int64_t shown = kv_begin;
    for (int64_t b = 0; b < (p.mask_stride.b == 0 ? 1 : p.batch); ++b)
      for (int64_t hk = 0; hk < (p.mask_stride.h == 0 ? 1 : Hkv); ++hk)
        shown = std::max(shown, bool_mask_keys_end(p, b, hk * G, G, 0, L, shown, kv_end));
    kv_end = std::min(kv_end, shown);
  }
  // (with a KV cache one more: a batch's visible keys may start at another
  // offset within a tile when a window or the bottom-right corner moves them)
  int64_t tiles = (kv_end > kv_begin ? (kv_end - kv_begin + kBlockN - 1) / kBlockN : 0) +
                  (p.seqlens_k != nullptr && p.variant.limits_keys() ? 1 : 0);
  if (p.cu_seqlens_q != nullptr) {
    // varlen (sequences of at most L rows): the splits cover the sequence
    // with the most tiles from its own first visible one (its rows from L_b
    // on are not rows of it: their Q is zero and nothing of them is written)
    tiles = 0, kv_begin = 0, kv_end = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const AttentionFwdParams sp = sequence_params<scalar_t, acc_t>(p, b);
      const int64_t lo = visible_kv_begin(sp, 0) / kBlockN * kBlockN, hi = visible_kv_end(sp, 0, L);
      if (sp.len_q > 0 && hi > lo) tiles = std::max(tiles, (hi - lo + kBlockN - 1) / kBlockN);
      kv_end = std::max(kv_end, hi);
    }
  }
  const int64_t heads = p.batch * Hkv;
  // A KV cache laid out (B, S, Hkv, D), paged pools alike, holds the heads
  // inside each key row: one head's rows are Hkv D elements apart (512 B of
  // every 4 KiB at 8 heads of 128 float32), and read head after head the
  // memory delivered them at 0.55x the rate of adjacent rows (a plain 2-thread
  // sum here, 40.7 against 73.4 GB/s; 53-58 with all heads of 16-256 keys in
  // turn). So in such a cache each split is one tile and the items go
  // split-major: the heads of a tile run one after the other, over the same
  // pages. First done only past 32 MiB of visible K/V (taken to come from
  // memory; 1.05-1.30x there); at any size it ran one and four queries of
  // 12 x 12 x 64, 32 x 8 x 64, 32 x 8 x 128 and 14 x 2 x 64 heads (1-16 MiB of
  // K/V, float32 and bfloat16) 0.98-1.73x as fast as head after head, in the
  // caches and in a loop over 24 layers' caches alike (interleaved, Intel Xeon
  // of model 167; docs/performance.md, "Heads inside the key rows at any
  // size"). bfloat16 and float16 with more than 8 rows a head too, once
  // bound by arithmetic and left out: since the 16-row routines fetch strided
  // rows spread over their steps, split-major ran bfloat16 with 12 and 16 rows
  // 1.10-1.30x and float16 with 16 rows 1.15-1.20x (docs/performance.md,
  // "Decoding on a newer CPU"; on AMX the bfloat16 rows of 8 or more take the
  // tile routines, which fetch no strided rows).
  const bool heads_in_rows = Hkv > 1 && p.k_stride.h < p.k_stride.row && p.v_stride.h < p.v_stride.row;
  const int64_t want = heads_in_rows ? std::max<int64_t>(tiles, 1)
                                     : std::min(std::max<int64_t>((kDecodeItems + heads - 1) / heads, 1),
                                                std::max<int64_t>(tiles, 1));
  const int64_t split_tiles = std::max<int64_t>((tiles + want - 1) / want, 1);
  const int64_t n_splits = std::max<int64_t>((tiles + split_tiles - 1) / split_tiles, 1);
  // One split a head (batch x key/value heads fill the threads): each item
  // writes its rows' output itself, from a per-thread O; else the splits'
  // partial results go through part_* to a merge pass.
  const bool direct = n_splits == 1;
  const int64_t n_part = direct ? 0 : heads * n_splits;
  // (the calling thread's own, kept as the items' buffers are: every split
  // writes its slot before the merge reads it; 1.02-1.06x at 16 rows a head
  // and 2k keys, where they were 512 KiB allocated and zeroed a call; kept
  // only up to 4 MiB, so that one call with many splits leaves no large
  // buffer behind on the thread)
  thread_local DecodeScratch<acc_t> kept_parts;
  DecodeScratch<acc_t> call_parts;
  const bool keep = n_part * R * Ev * static_cast<int64_t>(sizeof(acc_t)) <= 4 * 1024 * 1024;
  DecodeScratch<acc_t>& parts = keep ? kept_parts : call_parts;
  parts.reserve(0, 0, 0, n_part * R * Ev, n_part * R, 0, 0, 0, 0);
  Buffer<acc_t>&part_o = parts.o, &part_m = parts.m, &part_l = parts.l;
  acc_t* lse = static_cast<acc_t*>(p.lse);
  // Row r of key/value head bk (of batch b) from its splits' (max, sum,
  // unnormalised O), split sp's at m_s[sp R + r], l_s[sp R + r], o_s[(sp R + r) Ev],
  // merged in split order: O = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s.
  auto finish_row = [&](int64_t bk, int64_t r, const acc_t* m_s, const acc_t* l_s, const acc_t* o_s, int64_t splits,
                        acc_t* acc) {
    const int64_t b = bk / Hkv, h = bk % Hkv * G + r / L, i = r % L;
    const AttentionFwdParams sp = sequence_params<scalar_t, acc_t>(p, b);  // (varlen: its rows, its lse)
    if (i >= sp.len_q) return;  // past a shorter sequence's rows
    acc_t mx = kNegInf;
    for (int64_t sp = 0; sp < splits; ++sp) mx = nan_max(mx, m_s[sp * R + r]);
    acc_t total = 0;
    const acc_t* sum = acc;
    if (splits == 1 && std::isfinite(mx)) {  // its sum and O as they are: the merge would weigh them by exp(0) = 1
      total = l_s[r];
      sum = o_s + r * Ev;
    } else {
      std::fill(acc, acc + Ev, acc_t(0));
      for (int64_t sp = 0; sp < splits; ++sp) {
        const acc_t ms = m_s[sp * R + r];
        if (ms == kNegInf) continue;  // a split whose keys the row may not see
        const acc_t wt = Ops::expb(ms - mx);
        total += l_s[sp * R + r] * wt;
        const acc_t* os = o_s + (sp * R + r) * Ev;
        for (int64_t e = 0; e < Ev; ++e) acc[e] += os[e] * wt;
      }
    }
    const acc_t inv = total > acc_t(0) ? acc_t(1) / total : acc_t(0);
    scalar_t* orow = static_cast<scalar_t*>(sp.out) + b * p.out_stride.b + h * p.out_stride.h + i * p.out_stride.row;
    if (p.out_stride.col == 1) {  // unit stride: a loop the compiler vectorises
      for (int64_t e = 0; e < Ev; ++e) orow[e] = static_cast<scalar_t>(sum[e] * inv);
    } else {
      for (int64_t e = 0; e < Ev; ++e) orow[e * p.out_stride.col] = static_cast<scalar_t>(sum[e] * inv);
    }
    // -inf for a row that may see no key; NaN stays NaN (as the dense kernel)
    lse[sp.lse_index(b, h, i)] = total > acc_t(0) ? (mx + Ops::logb(total)) / unit : (total == total ? kNegInf : total);
  };
  // Items of a few KiB of K/V go to a thread in groups of kGroupBytes: a
  // parallel region costs about as much as reading 16 KiB (1 us here), and
  // is all of a small call's difference between 1 and 2 threads otherwise.
  const int64_t item_keys = std::min(split_tiles * kBlockN, std::max<int64_t>(kv_end - kv_begin, 1));
  const int64_t item_bytes = std::max<int64_t>(item_keys * (E + Ev) * static_cast<int64_t>(sizeof(scalar_t)), 1);
  const int64_t grain = std::max<int64_t>(1, kGroupBytes / item_bytes);
  // the far fetch where the call reads K/V from memory (past kFromMemoryBytes,
  // or kFarNarrowBytes for rows of at most 64 columns and adjacent 16-bit
  // rows of up to 128 with several rows a head; each batch's own key
  // count where a KV cache gives them) in adjacent rows outside a paged pool
  // (24 KiB on from a block's rows lies in whatever block is next)
  int64_t read_bytes =
      heads * std::max<int64_t>(kv_end - kv_begin, 0) * (E + Ev) * static_cast<int64_t>(sizeof(scalar_t));
  if (p.seqlens_k != nullptr) {
    int64_t keys = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      const AttentionFwdParams sp = sequence_params<scalar_t, acc_t>(p, b);
      keys += std::max<int64_t>(visible_kv_end(sp, 0, L) - visible_kv_begin(sp, 0), 0);
    }
    read_bytes = keys * Hkv * (E + Ev) * static_cast<int64_t>(sizeof(scalar_t));
  }
  const bool adjacent_rows = p.k_stride.col == 1 && p.k_stride.row == E && p.v_stride.col == 1 && p.v_stride.row == Ev;
  const bool far_early =
      std::max(E, Ev) <= 64 || (sizeof(scalar_t) == 2 && R >= 2 && std::max(E, Ev) <= 128 && adjacent_rows);
  const int64_t far_from = far_early ? kFarNarrowBytes : kFromMemoryBytes;
  const bool far_fetch = p.block_table == nullptr && read_bytes > far_from;
  // A KV cache's batches may hold very different key counts, and then
  // at::parallel_for's fixed ranges of items give one thread the long ones.
  // Where they would leave a thread over a quarter more keys than an even
  // share, the threads claim groups of items from a shared counter as they
  // go instead (docs/performance.md, "Caches of different lengths"). Elsewhere the fixed ranges stay:
  // a thread keeps the same items from one decode step to the next, and
  // their keys in its caches (claimed items moved between the cores and a
  // generation loop ran up to a third slower), and small calls skip the
  // counter (3%). An item's result never depends on the thread that runs it.
  const int64_t items = heads * n_splits;
  // item w: (key/value head bk = b Hkv + hk, split), head-major or split-major
  auto item_of = [&](int64_t w) {
    return heads_in_rows ? std::make_pair(w % heads, w / heads) : std::make_pair(w / n_splits, w % n_splits);
  };
  // the keys [j_lo, j_hi) split `split` of a sequence reads (sp: its params)
  auto split_keys = [&](const AttentionFwdParams& sp, int64_t split) {
    const int64_t j_lo = visible_kv_begin(sp, 0) / kBlockN * kBlockN + split * split_tiles * kBlockN;
    return std::make_pair(j_lo, std::min({visible_kv_end(sp, 0, L), kv_end, j_lo + split_tiles * kBlockN}));
  };
  bool claim = false;
  if (p.seqlens_k != nullptr) {  // the keys each thread's fixed range would read
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (items + grain - 1) / grain));
    const int64_t chunk = (items + threads - 1) / threads;
    std::vector<int64_t> keys(threads, 0), split_len(p.batch * n_splits);
    for (int64_t b = 0; b < p.batch; ++b) {
      const AttentionFwdParams sp = sequence_params<scalar_t, acc_t>(p, b);
      for (int64_t split = 0; split < n_splits; ++split) {
        const auto [j_lo, j_hi] = split_keys(sp, split);
        split_len[b * n_splits + split] = std::max<int64_t>(j_hi - j_lo, 0);
      }
    }
    for (int64_t w = 0; w < items; ++w) {
      const auto [bk, split] = item_of(w);
      keys[w / chunk] += split_len[bk / Hkv * n_splits + split];
    }
    const int64_t total = std::accumulate(keys.begin(), keys.end(), int64_t(0));
    claim = *std::max_element(keys.begin(), keys.end()) * 4 * threads > total * 5;
  }
  // bfloat16 on AMX with kAmxDecodeRows rows a head or more: S = Q K^T and
  // O += P V on the tile unit, K and V read in place (cpu::amx_dot_rows_bf16
  // / amx_acc_rows_bf16; S for 16 rows; O in the latter's column order until
  // the item's end)
  const bool amx_rows = std::is_same_v<scalar_t, c10::BFloat16> && cpu::active_isa() == cpu::Isa::kAmx &&
                        R >= kAmxDecodeRows && R <= kAmxRowsMax && E % 32 == 0 && E <= 256 && Ev % 32 == 0 &&
                        Ev <= 256 && p.k_stride.col == 1 && p.v_stride.col == 1;
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, claim ? at::get_num_threads() : items, claim ? 1 : grain, [&](int64_t begin, int64_t end) {
    const cpu::ReleaseTiles release{amx_rows};  // (the tile unit's state, given back at the task's end)
    thread_local DecodeScratch<acc_t> sc;  // (each thread's own; they never run two items at once)
    sc.reserve(R * E, (amx_rows ? kAmxRowsMax : R) * kBlockN, amx_rows ? E * 16 : 0, direct ? R * Ev : 0,
               direct ? R : 0, direct ? Ev : 0, std::is_same_v<scalar_t, c10::BFloat16> ? R * E : 0,
               p.k_stride.col != 1 ? kBlockN * E : 0,
               tile_needs_pack<scalar_t, acc_t>(p.v_stride.col) ? kVRows * Ev : 0);
    auto &qr = sc.qr, &s_buf = sc.s, &own_o = sc.o, &own_m = sc.m, &own_l = sc.l, &acc = sc.acc, &k_buf = sc.k,
         &v_buf = sc.v;
    auto &q_pairs = sc.q_pairs, &q_bits = sc.q_bits;
    for (int64_t w = claim ? 0 : begin, w_end = claim ? 0 : end;; ++w) {
      if (w >= w_end) {  // this thread's range is done: claim the next group, if any
        if (!claim || (w = claimed.fetch_add(grain)) >= items) break;
        w_end = std::min(w + grain, items);
      }
      const auto [bk, split] = item_of(w);
      const int64_t b = bk / Hkv, hk = bk % Hkv, slot = bk * n_splits + split;  // slot: its place in part_*
      // p itself without a KV cache or varlen (varlen: the sequence's rows,
      // keys and values; batch strides 0)
      const AttentionFwdParams sp = sequence_params<scalar_t, acc_t>(p, b);
      const scalar_t* q = static_cast<const scalar_t*>(sp.q);
      const scalar_t* k = static_cast<const scalar_t*>(sp.k);
      const scalar_t* v = static_cast<const scalar_t*>(sp.v);
      for (int64_t r = 0; r < R; ++r) {  // row r = g L + i: query row i of head hk G + g, scaled
        if (r % L >= sp.len_q) {  // past a shorter sequence's rows (varlen): zero, never written
          std::fill(qr.data() + r * E, qr.data() + (r + 1) * E, acc_t(0));
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
            std::fill(q_bits.data() + r * E, q_bits.data() + (r + 1) * E, uint16_t(0));
          continue;
        }
        const scalar_t* src = q + b * p.q_stride.b + (hk * G + r / L) * p.q_stride.h + (r % L) * p.q_stride.row;
        if (p.q_stride.col == 1) {  // unit stride: a loop the compiler vectorises
          for (int64_t e = 0; e < E; ++e) qr[r * E + e] = static_cast<acc_t>(src[e]) * scale;
        } else {
          for (int64_t e = 0; e < E; ++e) qr[r * E + e] = static_cast<acc_t>(src[e * p.q_stride.col]) * scale;
        }
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)  // the unscaled bits, for cpu::dot_rows_bf16
          for (int64_t e = 0; e < E; ++e) q_bits[r * E + e] = src[e * p.q_stride.col].x;
      }
      if (amx_rows) cpu::amx_pack_query_pairs(q_bits.data(), R, E, q_pairs.data());
      acc_t* o = direct ? own_o.data() : part_o.data() + slot * R * Ev;
      acc_t* m = direct ? own_m.data() : part_m.data() + slot * R;
      acc_t* l = direct ? own_l.data() : part_l.data() + slot * R;
      std::fill(o, o + R * Ev, acc_t(0));
      std::fill(m, m + R, kNegInf);
      std::fill(l, l + R, acc_t(0));
      const auto [j_lo, j_hi] = split_keys(sp, split);
      for (int64_t j0 = j_lo; j0 < j_hi; j0 += kBlockN) {
        const int64_t n = std::min(kBlockN, j_hi - j0);
        // a tile a bool mask hides from all the item's rows adds nothing: K and V not read
        if (p.mask_kind == MaskKind::kBool && bool_mask_hides_tile(p, b, hk * G, G, 0, L, j0, n)) continue;
        int64_t ldk = 0, ldv = 0;
        // (in a paged cache a tile lies in one block: its rows are evenly strided from kv_offset)
        const scalar_t* v_tile = v + p.kv_offset(p.v_stride, b, hk, j0);
        const scalar_t* k_tile = k + p.kv_offset(p.k_stride, b, hk, j0);
        // the split's next tile, which the row routines fetch ahead (in a
        // paged pool the rows after a tile lie in whatever block is next)
        const int64_t rows_after = p.block_table == nullptr ? j_hi - j0 - n : 0;
        acc_t* s = s_buf.data();
        bool scored = false;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // bfloat16 pairs on AMX or AVX512-BF16, then the scale
          if ((amx_rows && cpu::amx_dot_rows_bf16(q_pairs.data(), R, E, reinterpret_cast<const uint16_t*>(k_tile),
                                                  p.k_stride.row, n, s, n, p.block_table == nullptr)) ||
              (p.k_stride.col == 1 &&
              cpu::dot_rows_bf16(q_bits.data(), R, E, reinterpret_cast<const uint16_t*>(k_tile), p.k_stride.row, n, s,
                                 n, far_fetch, rows_after))) {
            for (int64_t r = 0; r < R; ++r) Ops::scale(s + r * n, n, scale);
            scored = true;
          }
        }
        if (scored) {
        } else if constexpr (kHalfBits) {  // S = Q K^T, a dot product per (row, key), K widened in registers
          if (p.k_stride.col == 1) {
            cpu::dot_rows_16(qr.data(), R, E, reinterpret_cast<const uint16_t*>(k_tile), p.k_stride.row, n, s, n,
                             std::is_same_v<scalar_t, c10::BFloat16>, far_fetch);
          } else {
            const acc_t* kr = load_tile(k_tile, p.k_stride.row, p.k_stride.col, n, E, k_buf.data(), &ldk);
            cpu::dot_rows(qr.data(), R, E, kr, ldk, n, s, n, false);
          }
        } else if constexpr (std::is_same_v<acc_t, float>) {
          const acc_t* kr = load_tile(k_tile, p.k_stride.row, p.k_stride.col, n, E, k_buf.data(), &ldk);
          // (the far fetch and the next tile's rows where the rows are read in place, not from a packed copy)
          const bool in_place = p.k_stride.col == 1;
          cpu::dot_rows(qr.data(), R, E, kr, ldk, n, s, n, far_fetch && in_place, in_place ? rows_after : 0);
        } else {
          const acc_t* kr = load_tile(k_tile, p.k_stride.row, p.k_stride.col, n, E, k_buf.data(), &ldk);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < n; ++c) s[r * n + c] = E > 0 ? Ops::dot(qr.data() + r * E, kr + c * ldk, E) : 0.0;
        }
        for (int64_t r = 0; r < R; ++r) {
          acc_t* srow = s + r * n;
          transform_row<scalar_t>(sp, b, hk * G + r / L, r % L, j0, n, unit, srow);
          acc_t tile_max = Ops::max(srow, n);
          if (tile_max == kNegInf && has_nan(srow, n)) tile_max = std::numeric_limits<acc_t>::quiet_NaN();
          const acc_t new_max = nan_max(m[r], tile_max);
          if (new_max == kNegInf) {  // every key so far is hidden: P = 0
            std::fill(srow, srow + n, acc_t(0));
            continue;
          }
          const acc_t alpha = m[r] == kNegInf ? acc_t(0) : Ops::expb(m[r] - new_max);
          l[r] = l[r] * alpha + Ops::exp_sub_sum(srow, n, acc_t(1), new_max);
          m[r] = new_max;
          if (alpha != acc_t(1)) Ops::scale(o + r * Ev, Ev, alpha);
        }
        // O += P V: value rows read whole, in place, float32 as they are and
        // bfloat16 / float16 widened in registers (cpu::acc_rows); where that
        // routine is not in use, V widened kVRows rows at a time (an L1-sized
        // buffer) where it is not read in place, and cpu::gemm
        if (p.v_stride.col == 1) {
          bool done = false;
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
            done = amx_rows && cpu::amx_acc_rows_bf16(s, R, n, n, reinterpret_cast<const uint16_t*>(v_tile),
                                                      p.v_stride.row, Ev, o, Ev, p.block_table == nullptr);
          if (done) continue;
          if constexpr (kHalfBits)
            done = cpu::acc_rows_16(s, R, n, n, reinterpret_cast<const uint16_t*>(v_tile), p.v_stride.row, Ev, o, Ev,
                                    std::is_same_v<scalar_t, c10::BFloat16>, far_fetch, rows_after);
          else if constexpr (std::is_same_v<scalar_t, float>)
            done = cpu::acc_rows(s, R, n, n, v_tile, p.v_stride.row, Ev, o, Ev, far_fetch, rows_after);
          if (done) continue;
        }
        const int64_t step = tile_needs_pack<scalar_t, acc_t>(p.v_stride.col) ? kVRows : n;
        for (int64_t c0 = 0; c0 < n; c0 += step) {
          const int64_t nc = std::min(step, n - c0);
          const acc_t* vr =
              load_tile(v_tile + c0 * p.v_stride.row, p.v_stride.row, p.v_stride.col, nc, Ev, v_buf.data(), &ldv);
          cpu::gemm(R, Ev, nc, acc_t(1), s + c0, n, 1, vr, ldv, acc_t(1), o, Ev);
        }
      }
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)  // O from the tile routine's column order
        if (amx_rows) cpu::amx_unsplit_rows(o, R, Ev, Ev);
      if (direct)
        for (int64_t r = 0; r < R; ++r) finish_row(bk, r, m, l, o, 1, acc.data());
    }
  });
  if (direct) return;
  at::parallel_for(0, heads * R, 16, [&](int64_t begin, int64_t end) {
    Buffer<acc_t> acc(Ev);
    for (int64_t x = begin; x < end; ++x) {
      const int64_t bk = x / R, r = x % R, w0 = bk * n_splits;
      finish_row(bk, r, part_m.data() + w0 * R, part_l.data() + w0 * R, part_o.data() + w0 * R * Ev, n_splits,
                 acc.data());
    }
  });
}

template void attention_decode_kernel<double>(const AttentionFwdParams& p);
template void attention_decode_kernel<float>(const AttentionFwdParams& p);
template void attention_decode_kernel<c10::Half>(const AttentionFwdParams& p);
template void attention_decode_kernel<c10::BFloat16>(const AttentionFwdParams& p);

}  // namespace mha_ext
