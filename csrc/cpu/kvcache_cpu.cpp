// CPU host function of the KV-cache op: check, write the new keys into the
// caches in place, fill params, call the dense forward kernels (for a few new
// rows, the decode kernel), which read batch b's first seqlens_k[b] keys.
#include "../kvcache_host.h"
#include "kernels_cpu.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <tuple>

namespace mha_ext {
namespace {

std::tuple<at::Tensor, at::Tensor> kvcache_attention_cpu(
    const at::Tensor& query,          // (B, Lq, Hq, E), any strides
    at::Tensor& k_cache,              // (B, S_max, Hkv, E), written in place
    at::Tensor& v_cache,              // (B, S_max, Hkv, Ev), written in place
    const at::Tensor& cache_seqlens,  // (B) int32
    const std::optional<at::Tensor>& k_new,  // (B, L_new, Hkv, E)
    const std::optional<at::Tensor>& v_new,  // (B, L_new, Hkv, Ev)
    std::optional<double> scale, bool is_causal, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {  // (Hq) or (B, Hq)
  const VariantArgs va{is_causal, window_left, window_right, true, softcap, alibi_slopes};
  KVCacheCall c = prepare_kvcache(query, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, va);
  if (!c.has_rows) return {c.out, c.lse};
  const AttentionFwdParams& p = c.p;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "kvcache_attention_cpu",
                                  [&] { attention_fwd_kernel<scalar_t>(p); });
  return {c.out, c.lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) { m.impl("kvcache_attention", &kvcache_attention_cpu); }

}  // namespace mha_ext
