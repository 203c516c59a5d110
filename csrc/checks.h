// The one input checker of mha_ext: every backend, forward and backward, calls
// it. Its messages are mirrored word for word by the fake kernels' checks in
// mha_ext/checks.py (tests/test_errors.py holds both to the same text).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace mha_ext {

// Sizes of one attention call after validation. The leading batch dims of
// query (N...) are kept for the outputs and flattened to `batch` for kernels.
struct AttentionShape {
  std::vector<int64_t> batch_sizes;  // N...
  int64_t batch = 1, heads_q = 0, heads_kv = 0;
  int64_t len_q = 0, len_kv = 0, head_dim = 0, head_dim_v = 0;
};

// query (N..., Hq, L, E), key (N..., Hkv, S, E), value (N..., Hkv, S, Ev),
// attn_mask broadcastable to (N..., Hq, L, S), bool or query's dtype.
AttentionShape check_attention_inputs(const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value,
                                      const std::optional<at::Tensor>& attn_mask,
                                      double dropout_p, bool enable_gqa);

// Sizes of a varlen call: B = batch sequences packed along the rows, len_q /
// len_kv the longest of them (batch_sizes = (B)).
struct VarlenShape : AttentionShape {
  int64_t total_q = 0, total_kv = 0;
};

// query (total_q, Hq, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev)
// with Hq a multiple of Hkv; cu_seqlens_q / cu_seqlens_k int32 of shape
// (B + 1) on query's device whose values (read on the host: a copy from a
// GPU) start at 0, never decrease and end at total_q / total_k, with no
// sequence longer than max_seqlen_q / max_seqlen_k.
VarlenShape check_varlen_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p);

// Sizes of a KV-cache call: len_q = Lq, len_kv = the largest key count
// (cache_seqlens[b] + len_new), len_cache = S_max, batch_sizes = (B).
struct KVCacheShape : AttentionShape {
  int64_t len_cache = 0, len_new = 0;
  int64_t block_size = 0, num_blocks = 0;  // paged (a block_table): rows per block, blocks in the pool
};

// query (B, Lq, Hq, E), k_cache (B, S_max, Hkv, E), v_cache (B, S_max, Hkv,
// Ev), Hq a multiple of Hkv, cache_seqlens int32 (B) on query's device,
// k_new / v_new (B, L_new, Hkv, E / Ev) or neither; the values of
// cache_seqlens (read on the host) >= 0 and, with L_new new keys, at most
// S_max - L_new. Paged, with block_table int32 (B, max_blocks): k_cache
// (num_blocks, block_size, Hkv, E), v_cache likewise, block_size a multiple
// of 256, S_max = max_blocks * block_size, and the entries a batch uses
// (read on the host) in [0, num_blocks).
KVCacheShape check_kvcache_inputs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new,
                                  const std::optional<at::Tensor>& block_table);

// The variant arguments: windows >= -1 (-1: unbounded), softcap finite and
// >= 0 (0: none), alibi_slopes floating with shape (Hq) or (N..., Hq) on
// query's device.
void check_variant(const AttentionShape& s, const at::Tensor& query, int64_t window_left, int64_t window_right,
                   double softcap, const std::optional<at::Tensor>& alibi_slopes);

// dropout_p in [0, 1).
void check_dropout_p(double dropout_p);

// rng_state: int64 (seed, offset), on the CPU or on query's device (where a
// kernel reads it without a host sync, e.g. inside a CUDA graph). With
// frame_len_q >= 0 (the dense ops; the query length) it may also be
// (seed, offset, rows, row0, col0), a dropout frame (DropoutParams), whose
// values are checked when they are on the CPU.
void check_rng_state(const at::Tensor& rng_state, const at::Device& query_device, int64_t frame_len_q = -1);

// The CUDA kernels need compute capability 8.0 (sm_80: mma.sync with
// bfloat16, cp.async) or newer: a clear error naming the GPU and its
// capability otherwise (instead of "no kernel image" at the first launch).
void check_compute_capability(int major, int minor, const std::string& gpu);

// Checks that `name` has exactly `expected` sizes (and query's dtype/device
// unless `dtype` is given).
void check_same_shape(const char* name, const at::Tensor& t, at::IntArrayRef expected,
                      const at::Tensor& like, std::optional<at::ScalarType> dtype = std::nullopt);

// A buffer of `sizes` that a call allocates on the CPU and writes in full (an
// output, a gradient) must fit in the memory the process can hold (RAM and
// swap, within its cgroup's limit; Linux): where the system overcommits
// memory (vm.overcommit_memory = 1, as on Kubernetes nodes) its allocation
// succeeds and the writes end in the out-of-memory killer, or run for hours.
// A clear error instead, naming the buffer. Other devices' allocators refuse
// such sizes themselves.
void check_fits_in_memory(const char* what, at::IntArrayRef sizes, const at::TensorOptions& options);

std::string format_shape(at::IntArrayRef sizes);
std::string dtype_name(at::ScalarType t);

}  // namespace mha_ext
