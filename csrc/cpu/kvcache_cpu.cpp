// CPU host function of the KV-cache op: check, write the new keys into the
// caches in place, fill params, call the dense forward kernels (for a few new
// rows, the decode kernel), which read batch b's first seqlens_k[b] keys. A
// paged cache is read in place by the decode kernel; for longer query chunks
// the blocks a batch uses are first gathered into one (B, S, Hkv, D) copy, a
// pass over S keys against L x S of attention.
#include "../kvcache_host.h"
#include "kernels_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <tuple>

namespace mha_ext {
namespace {

// Batch b's blocks of a paged cache (B, max_blocks) -> (B, n_blocks x
// block_size, Hkv, D), n_blocks covering the longest key count; blocks past a
// batch's own keys (never read) come from block 0.
at::Tensor gather_blocks(const at::Tensor& pool, const at::Tensor& table, const at::Tensor& cache_seqlens,
                         int64_t len_new, int64_t len_kv, int64_t block_size) {
  const int64_t n_blocks = (len_kv + block_size - 1) / block_size, batch = table.size(0);
  const at::Tensor used = cache_seqlens.to(at::kLong).add(len_new + block_size - 1).div(block_size, "floor");
  const at::Tensor cols = at::arange(n_blocks, used.options()).view({1, n_blocks});
  const at::Tensor idx = at::where(cols.lt(used.view({batch, 1})), table.narrow(1, 0, n_blocks).to(at::kLong), 0);
  return pool.index_select(0, idx.reshape({-1})).view({batch, n_blocks * block_size, pool.size(2), pool.size(3)});
}

std::tuple<at::Tensor, at::Tensor> kvcache_attention_cpu(
    const at::Tensor& query,          // (B, Lq, Hq, E), any strides
    at::Tensor& k_cache,              // (B, S_max, Hkv, E) or paged (num_blocks, block_size, Hkv, E), written in place
    at::Tensor& v_cache,              // (B, S_max, Hkv, Ev) or paged (num_blocks, block_size, Hkv, Ev), likewise
    const at::Tensor& cache_seqlens,  // (B) int32
    const std::optional<at::Tensor>& k_new,  // (B, L_new, Hkv, E)
    const std::optional<at::Tensor>& v_new,  // (B, L_new, Hkv, Ev)
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes,  // (Hq) or (B, Hq)
    const std::optional<at::Tensor>& block_table) {  // (B, max_blocks) int32: paged caches
  const VariantArgs va{is_causal, window_left, window_right, true, softcap, alibi_slopes};
  KVCacheCall c = prepare_kvcache(query, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, va, block_table,
                                  true);
  if (!c.has_rows) return {c.out, c.lse};
  AttentionFwdParams& p = c.p;
  if (p.block_table != nullptr && !use_decode_kernel(p, query.scalar_type() == at::kBFloat16)) {
    const KVCacheShape& s = c.s;
    const at::Tensor k = gather_blocks(k_cache, *block_table, cache_seqlens, s.len_new, s.len_kv, s.block_size);
    const at::Tensor v = gather_blocks(v_cache, *block_table, cache_seqlens, s.len_new, s.len_kv, s.block_size);
    p.k = k.const_data_ptr();
    p.v = v.const_data_ptr();
    p.k_stride = bshd_strides(k);
    p.v_stride = bshd_strides(v);
    p.block_table = nullptr;
    c.keep_alive.push_back(k);
    c.keep_alive.push_back(v);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "kvcache_attention_cpu",
                                  [&] { attention_fwd_kernel<scalar_t>(p); });
  return {c.out, c.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) { m.impl("kvcache_attention", &kvcache_attention_cpu); }

}  // namespace mha_ext
