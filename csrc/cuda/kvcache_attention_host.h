// Host function of the KV-cache op on the CUDA backend (and, like
// attention_host.h, in the emulation test library): check, write the new
// keys into the caches in place, fill params, launch the dense forward
// kernel; the grid spans the longest key count, batch b reads its own
// (sequence_params). cache_seqlens (and a block_table) are copied to the
// host once per call to check their values (a sync on a GPU). A paged cache
// is read in place: each key tile lies in one block (kv_offset).
#pragma once

#include "../kvcache_host.h"
#include "attention_host.h"

namespace mha_ext {
namespace device_host {

inline std::tuple<at::Tensor, at::Tensor> kvcache_attention_device(
    const at::Tensor& query,          // (B, Lq, Hq, E), any strides
    at::Tensor& k_cache,              // (B, S_max, Hkv, E) or paged (num_blocks, block_size, Hkv, E), in place
    at::Tensor& v_cache,              // (B, S_max, Hkv, Ev) or paged (num_blocks, block_size, Hkv, Ev)
    const at::Tensor& cache_seqlens,  // (B) int32
    const std::optional<at::Tensor>& k_new,  // (B, L_new, Hkv, E)
    const std::optional<at::Tensor>& v_new,  // (B, L_new, Hkv, Ev)
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes,  // (Hq) or (B, Hq)
    const std::optional<at::Tensor>& block_table) {  // (B, max_blocks) int32: paged caches, read in place
  const VariantArgs va{is_causal, window_left, window_right, true, softcap, alibi_slopes};
#if defined(__CUDACC__)
  const c10::cuda::CUDAGuard guard(query.device());
#endif
  KVCacheCall c = prepare_kvcache(query, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, va, block_table,
                                  false);
  if (!c.has_rows) return {c.out, c.lse};
  check_device_limits(c.s);
  check_gpu(query, c.s);
  const simt::Stream stream = current_stream(query);
  dispatch_device_type(query.scalar_type(), "kvcache_attention", [&](auto elem) {
    using T = decltype(elem);
    launch_forward<T>(c.p, query, stream);
  });
  return {c.out, c.lse};
}

}  // namespace device_host
}  // namespace mha_ext
