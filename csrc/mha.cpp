// Every schema of the mha_ext library, defined once. Backends only m.impl;
// fake kernels and autograd live in Python (mha_ext/ops.py), which the
// library names with set_python_module: torch checks that they are registered
// from there and points a C++-first user at the module to import.
#include "schema.h"

#include <torch/library.h>

TORCH_LIBRARY(mha_ext, m) {
  m.set_python_module("mha_ext.ops");

  // Fused scaled-dot-product attention with the semantics of
  // torch.nn.functional.scaled_dot_product_attention, plus is_causal together
  // with attn_mask (both applied), and the variants of AttentionVariant
  // (attention_params.h): bottom_right aligns is_causal, the window
  // (window_left, window_right; -1 = unbounded) and ALiBi at the bottom-right
  // corner as FlashAttention does; softcap > 0 caps the scaled scores;
  // alibi_slopes, (Hq) or (N..., Hq), subtract slope * |i + S - L - j|
  // (bottom-right) or slope * |i - j|. Returns the output (N..., Hq, L, Ev), the
  // per-row logsumexp (N..., Hq, L) in float32 (float64 for float64 inputs;
  // -inf for a row with every key masked, whose output is 0), and the
  // (seed, offset) used for dropout: a copy of rng_state when given (on the
  // CPU or on query's device), else drawn from the generator of query's
  // device (on a GPU by device ops, so a captured CUDA graph draws anew on
  // each replay) and returned on query's device. A given rng_state may also
  // hold (seed, offset, rows, row0, col0), a dropout frame: the call's scores
  // are rows row0 .. row0 + L - 1 and columns col0 .. of an attention with
  // `rows` query rows, and draw that attention's dropout mask (ring attention
  // attends a sequence block by block with the mask of the whole).
  m.def(mha_ext::kAttentionSchema);

  // Fused backward of `attention`: recomputes the probabilities from the
  // saved logsumexp and regenerates the dropout mask from rng_state. Returns
  // the gradients of query, key, value and, when attn_mask_requires_grad, of
  // a floating attn_mask (its own shape); otherwise an empty tensor there.
  m.def(mha_ext::kAttentionBackwardSchema);

  // `attention` over a batch of sequences of different lengths packed along
  // the rows, FlashAttention's varlen convention: query (total_q, Hq, E), key
  // (total_k, Hkv, E), value (total_k, Hkv, Ev), int32 cu_seqlens_q /
  // cu_seqlens_k (B + 1) of cumulative lengths (0 first, the packed length
  // last), max_seqlen_q / max_seqlen_k at least the longest sequence. Each
  // sequence attends to its own keys only, with GQA (Hq a multiple of Hkv),
  // the variants of `attention` per sequence (bottom_right, default True,
  // aligns is_causal, windows and ALiBi at each sequence's last key), dropout
  // and scale. Returns out (total_q, Hq, Ev), logsumexp (Hq, total_q) and the
  // (seed, offset) used, as `attention` does. No work on padding: the cost is
  // the sum of the sequences' L x S.
  m.def(mha_ext::kVarlenAttentionSchema);

  // Fused backward of `varlen_attention`: the gradients of query, key and value.
  m.def(mha_ext::kVarlenAttentionBackwardSchema);

  // Attention against a preallocated KV cache, FlashAttention's
  // flash_attn_with_kvcache convention: query (B, Lq, Hq, E), k_cache
  // (B, S_max, Hkv, E), v_cache (B, S_max, Hkv, Ev), cache_seqlens int32 (B)
  // keys already cached; k_new / v_new (B, L_new, Hkv, E / Ev), when given,
  // are written into the caches in place at rows cache_seqlens[b] ..
  // (nothing is copied or concatenated). Batch b attends to its first
  // cache_seqlens[b] + L_new keys with the causal alignment, windows and ALiBi
  // at the bottom-right corner; GQA, softcap, scale. Forward only (inference).
  // Returns out (B, Lq, Hq, Ev) and logsumexp (B, Hq, Lq). Paged, with
  // block_table int32 (B, max_blocks): the caches are a pool (num_blocks,
  // block_size, Hkv, E / Ev), block_size a multiple of 256, and batch b's key
  // j is row j % block_size of block block_table[b, j / block_size].
  m.def(mha_ext::kKVCacheAttentionSchema);

  // The dropout (seed, offset) that `attention` draws for a call with
  // dropout, no rng_state, a query like `like` (its device) and len_kv keys,
  // drawn from the generator of like's device and advancing it as that call
  // would (on a GPU by ceil(len_kv / 4) Philox blocks per row), returned on
  // like's device. For callers that attend one sequence block by block with
  // dropout frames (ring attention), however long the whole sequence.
  m.def(mha_ext::kDrawRngStateSchema);

  // The keep mask (True = kept) that `attention` applies for this rng_state
  // and dropout_p, as a bool tensor of `shape` = (N..., H, L, S). For need_weights
  // paths and tests; the fused ops never materialise it.
  m.def("dropout_mask(Tensor rng_state, int[] shape, float dropout_p) -> Tensor");

  // The instruction set the CPU kernels use in this process: "amx", "avx512",
  // "avx2" or "generic" (the best the CPU has, or lower if MHA_EXT_CPU_ISA says so).
  m.def("cpu_isa() -> str");
}
