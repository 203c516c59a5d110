// The schema strings of the attention ops, in one place: mha.cpp defines the
// mha_ext library with them (and says what each op does); the emulation
// test library of the CUDA kernels (tests/emul) defines its ops with the
// same strings, so the two cannot drift apart.
#pragma once

namespace mha_ext {

inline constexpr const char* kAttentionSchema =
    "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
    "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
    "Tensor? rng_state=None, int window_left=-1, int window_right=-1, bool bottom_right=False, "
    "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor out, Tensor logsumexp, Tensor rng_state)";

inline constexpr const char* kAttentionBackwardSchema =
    "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor? attn_mask, float dropout_p, bool is_causal, float? scale, "
    "bool enable_gqa, Tensor rng_state, bool attn_mask_requires_grad, int window_left=-1, "
    "int window_right=-1, bool bottom_right=False, float softcap=0.0, Tensor? alibi_slopes=None) -> "
    "(Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_attn_mask)";

inline constexpr const char* kVarlenAttentionSchema =
    "varlen_attention(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p=0.0, bool is_causal=False, float? scale=None, "
    "Tensor? rng_state=None, int window_left=-1, int window_right=-1, bool bottom_right=True, "
    "float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor out, Tensor logsumexp, Tensor rng_state)";

inline constexpr const char* kVarlenAttentionBackwardSchema =
    "varlen_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
    "float dropout_p, bool is_causal, float? scale, Tensor rng_state, int window_left=-1, "
    "int window_right=-1, bool bottom_right=True, float softcap=0.0, Tensor? alibi_slopes=None) -> "
    "(Tensor grad_query, Tensor grad_key, Tensor grad_value)";

inline constexpr const char* kKVCacheAttentionSchema =
    "kvcache_attention(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, "
    "Tensor? k_new=None, Tensor? v_new=None, float? scale=None, bool is_causal=False, int window_left=-1, "
    "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? block_table=None) -> "
    "(Tensor out, Tensor logsumexp)";

inline constexpr const char* kDrawRngStateSchema = "draw_rng_state(Tensor like, int len_kv) -> Tensor";

}  // namespace mha_ext
