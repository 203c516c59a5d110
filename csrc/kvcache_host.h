// Host-side preparation of the KV-cache op, shared by every backend: checks,
// the in-place write of the new keys and values into the caches, outputs and
// the params. The kernels are the dense ones; each batch attends to its own
// key count (seqlens_k, through sequence_params) of its cache rows.
//
// Layouts (FlashAttention's flash_attn_with_kvcache):
//   query   (B, Lq, Hq, E)          out (B, Lq, Hq, Ev), logsumexp (B, Hq, Lq)
//   k_cache (B, S_max, Hkv, E)      v_cache (B, S_max, Hkv, Ev), preallocated
//   k_new   (B, L_new, Hkv, E)      v_new (B, L_new, Hkv, Ev), optional
//   cache_seqlens int32 (B): keys already in batch b's cache
// The new keys go to rows cache_seqlens[b] .. + L_new; batch b attends to its
// first cache_seqlens[b] + L_new keys, aligned at the bottom-right corner.
// Paged (a block_table (B, max_blocks) int32): k_cache / v_cache are a pool
// (num_blocks, block_size, Hkv, E / Ev) and batch b's row j is row
// j % block_size of block block_table[b, j / block_size] (vLLM's and
// FlashAttention's paged layout; block_size a multiple of 256).
#pragma once

#include "host_common.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/div.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/index_put.h>
#include <ATen/ops/remainder.h>
#include <c10/core/GradMode.h>

#include <cstring>
#include <utility>

namespace mha_ext {

// (B, X, H, D) as the kernels' (b, h, row, col) view
inline Strides4 bshd_strides(const at::Tensor& t) {
  return Strides4{t.stride(0), t.stride(2), t.stride(1), t.stride(3)};
}

// The new rows of `src` (B, L_new, Hkv, D) written into `cache` at rows
// seqlens[b] .. (paged: row j of batch b in block table[b, j / block_size]),
// on the CPU: a copy of D elements per (batch, row, head), where index_put_
// dispatched a dozen ops per call (seqlens and the table are on the host,
// already checked).
inline void write_rows_cpu(at::Tensor& cache, const at::Tensor& src, const int32_t* seqlens, const int32_t* table,
                           int64_t table_width, int64_t block_size) {
  const int64_t B = src.size(0), L = src.size(1), H = src.size(2), D = src.size(3), elem = src.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.const_data_ptr());
  const bool whole = cache.stride(3) == 1 && src.stride(3) == 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t) {
      const int64_t row = seqlens[b] + t;
      const int64_t blk = table != nullptr ? table[b * table_width + row / block_size] : b;
      const int64_t r = table != nullptr ? row % block_size : row;
      for (int64_t h = 0; h < H; ++h) {
        char* d = dst + (blk * cache.stride(0) + r * cache.stride(1) + h * cache.stride(2)) * elem;
        const char* f = from + (b * src.stride(0) + t * src.stride(1) + h * src.stride(2)) * elem;
        if (whole) {
          std::memcpy(d, f, static_cast<size_t>(D * elem));
        } else {
          for (int64_t e = 0; e < D; ++e)
            std::memcpy(d + e * cache.stride(3) * elem, f + e * src.stride(3) * elem, static_cast<size_t>(elem));
        }
      }
    }
}

struct KVCacheCall {
  KVCacheShape s;
  at::Tensor out, lse;
  AttentionFwdParams p;
  std::vector<at::Tensor> keep_alive;
  bool has_rows = false;  // B * Hq * Lq > 0: p is filled
};

inline KVCacheCall prepare_kvcache(const at::Tensor& query, at::Tensor& k_cache, at::Tensor& v_cache,
                                   const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                   const std::optional<at::Tensor>& v_new, std::optional<double> scale,
                                   const VariantArgs& va, const std::optional<at::Tensor>& block_table,
                                   bool copy_rows_on_host) {
  // Forward only: autograd would record nothing for this op (its fallback
  // gives the inputs no gradient), so a call that asks for gradients is
  // refused here rather than answered with none.
  if (c10::GradMode::is_enabled()) {
    const std::pair<const char*, const at::Tensor*> inputs[] = {
        {"query", &query}, {"k_cache", &k_cache}, {"v_cache", &v_cache},
        {"k_new", k_new ? &*k_new : nullptr}, {"v_new", v_new ? &*v_new : nullptr},
        {"alibi_slopes", va.alibi_slopes ? &*va.alibi_slopes : nullptr}};
    for (const auto& [name, t] : inputs)
      TORCH_CHECK(t == nullptr || !t->requires_grad(), "kvcache_attention is forward only (no backward): ", name,
                  " requires grad while grad mode is on; call it under torch.no_grad() or torch.inference_mode(), "
                  "or pass tensors that do not require grad");
  }
  KVCacheCall c;
  c.s = check_kvcache_inputs(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table);
  check_variant(c.s, query, va.window_left, va.window_right, va.softcap, va.alibi_slopes);
  const KVCacheShape& s = c.s;
  // the outputs first: a size the machine cannot hold raises before a cache is written
  c.out = empty_checked("the output", {s.batch, s.len_q, s.heads_q, s.head_dim_v}, query.options());
  c.lse = empty_checked("the logsumexp", {s.batch, s.heads_q, s.len_q},
                        query.options().dtype(acc_type_of(query.scalar_type())));
  // cache_seqlens read on the host where it lies there (the new rows' places, the key counts)
  const at::Tensor host_seqlens = cache_seqlens.device().is_cpu() ? cache_seqlens.contiguous() : at::Tensor();
  const bool write_new = k_new.has_value() && s.len_new > 0;
  // the new rows: by write_rows_cpu (the CPU backend), else by index_put_
  // (the CUDA backend, and its emulation on CPU tensors)
  if (write_new && copy_rows_on_host) {
    // what index_put_ checks and does besides the copy: no overlap of the
    // written cache with itself or with its new rows (before anything is
    // written), and each cache's version counter bumped (autograd's check of
    // saved tensors; an inference tensor outside inference mode raises)
    for (const auto& [cache, src] : {std::pair{&k_cache, &*k_new}, std::pair{&v_cache, &*v_new}}) {
      at::assert_no_internal_overlap(*cache);
      at::assert_no_overlap(*cache, *src);
    }
    k_cache.unsafeGetTensorImpl()->bump_version();
    v_cache.unsafeGetTensorImpl()->bump_version();
    const at::Tensor table = block_table.has_value() ? block_table->contiguous() : at::Tensor();
    const int32_t* t = table.defined() ? table.const_data_ptr<int32_t>() : nullptr;
    const int32_t* starts = host_seqlens.const_data_ptr<int32_t>();
    write_rows_cpu(k_cache, *k_new, starts, t, t ? table.size(1) : 0, s.block_size);
    write_rows_cpu(v_cache, *v_new, starts, t, t ? table.size(1) : 0, s.block_size);
  } else if (write_new) {  // rows cache_seqlens[b] + t, in place
    const at::Tensor start = cache_seqlens.to(at::kLong);
    // index_put_ rather than scatter_: torch's CPU scatter_ of bfloat16 took
    // 1.5 ms for one (4, 1, 8, 128) step (float32: 0.013), index_put_ 0.012
    at::Tensor rows = start.view({s.batch, 1}).add(at::arange(s.len_new, start.options()));
    at::Tensor batch = at::arange(s.batch, start.options()).view({s.batch, 1}).expand({s.batch, s.len_new});
    if (block_table.has_value()) {  // (block, row in block) of each new row
      batch = block_table->gather(1, rows.div(s.block_size, "floor")).to(at::kLong);
      rows = rows.remainder(s.block_size);
    }
    k_cache.index_put_({batch, rows}, *k_new);
    v_cache.index_put_({batch, rows}, *v_new);
  }
  c.has_rows = s.batch * s.heads_q * s.len_q > 0;
  if (!c.has_rows) return c;
  AttentionFwdParams& p = c.p;
  p.q = query.const_data_ptr();
  p.k = k_cache.const_data_ptr();
  p.v = v_cache.const_data_ptr();
  p.q_stride = bshd_strides(query);
  p.k_stride = bshd_strides(k_cache);
  p.v_stride = bshd_strides(v_cache);
  fill_scalars(p, s, query, 0.0, va, scale, std::nullopt, c.keep_alive);
  p.lse_stride_b = s.heads_q * s.len_q;  // lse (B, Hq, Lq), contiguous
  p.lse_stride_h = s.len_q;
  // keys of batch b: cache_seqlens[b] + L_new (on the CPU filled in place, no dispatched ops)
  at::Tensor keys;
  if (host_seqlens.defined()) {
    keys = at::empty({s.batch}, cache_seqlens.options());
    for (int64_t b = 0; b < s.batch; ++b)
      keys.data_ptr<int32_t>()[b] = host_seqlens.const_data_ptr<int32_t>()[b] + static_cast<int32_t>(s.len_new);
  } else {
    keys = cache_seqlens.add(s.len_new).contiguous();
  }
  p.seqlens_k = keys.const_data_ptr<int32_t>();
  p.out = c.out.data_ptr();
  p.out_stride = bshd_strides(c.out);
  p.lse = c.lse.data_ptr();
  c.keep_alive.push_back(keys);
  if (block_table.has_value()) {  // k / v batch strides step over blocks
    const at::Tensor table = block_table->contiguous();
    p.block_table = table.const_data_ptr<int32_t>();
    p.block_table_stride = table.size(1);
    p.kv_block_size = s.block_size;
    c.keep_alive.push_back(table);
  }
  return c;
}

}  // namespace mha_ext
