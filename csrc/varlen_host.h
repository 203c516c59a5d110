// Host-side preparation of the varlen ops, shared by every backend: checks,
// outputs, and params of B sequences packed along the rows that the dense
// kernels read one sequence at a time (sequence_params, attention_params.h).
//
// Layouts (FlashAttention's varlen convention):
//   query (total_q, Hq, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev)
//   out   (total_q, Hq, Ev), logsumexp (Hq, total_q) float32 (float64 for float64)
//   cu_seqlens_q / cu_seqlens_k int32 (B + 1): sequence b is rows cu[b] .. cu[b + 1]
#pragma once

#include "host_common.h"

namespace mha_ext {

// A packed (total, H, D) tensor as the kernels' (b, h, row, col) view; the
// batch stride is 0 and sequence_params moves the pointer to a sequence's rows.
inline Strides4 packed_strides(const at::Tensor& t) { return Strides4{0, t.stride(1), t.stride(0), t.stride(2)}; }

struct VarlenArgs {
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
};

// Checks (check_varlen_inputs, check_variant) and fills what the forward and
// backward share; returns the tensors p points into.
inline std::vector<at::Tensor> fill_varlen(AttentionFwdParams& p, const VarlenShape& s, const at::Tensor& query,
                                           const at::Tensor& key, const at::Tensor& value, const VarlenArgs& vl,
                                           double dropout_p, const VariantArgs& va, std::optional<double> scale,
                                           const std::optional<at::Tensor>& rng_state) {
  std::vector<at::Tensor> keep_alive;
  p.q = query.const_data_ptr();
  p.k = key.const_data_ptr();
  p.v = value.const_data_ptr();
  p.q_stride = packed_strides(query);
  p.k_stride = packed_strides(key);
  p.v_stride = packed_strides(value);
  fill_scalars(p, s, query, dropout_p, va, scale, rng_state, keep_alive);
  p.lse_stride_b = 0;  // lse (Hq, total_q)
  p.lse_stride_h = s.total_q;
  at::Tensor cq = vl.cu_seqlens_q.contiguous(), ck = vl.cu_seqlens_k.contiguous();
  p.cu_seqlens_q = cq.const_data_ptr<int32_t>();
  p.cu_seqlens_k = ck.const_data_ptr<int32_t>();
  keep_alive.insert(keep_alive.end(), {cq, ck});
  return keep_alive;
}

inline VarlenShape check_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const VarlenArgs& vl, double dropout_p, const VariantArgs& va) {
  VarlenShape s = check_varlen_inputs(query, key, value, vl.cu_seqlens_q, vl.cu_seqlens_k, vl.max_seqlen_q,
                                      vl.max_seqlen_k, dropout_p);
  check_variant(s, query, va.window_left, va.window_right, va.softcap, va.alibi_slopes);
  return s;
}

struct VarlenForwardCall {
  VarlenShape s;
  at::Tensor out, lse, rng_state;
  AttentionFwdParams p;
  std::vector<at::Tensor> keep_alive;
  bool has_rows = false;  // total_q * Hq > 0: p is filled
};

// The forward's checks, rng state (as prepare_forward), outputs and params.
template <typename Draw>
VarlenForwardCall prepare_varlen_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                         const VarlenArgs& vl, double dropout_p, const VariantArgs& va,
                                         std::optional<double> scale, const std::optional<at::Tensor>& rng_state,
                                         Draw&& draw) {
  VarlenForwardCall c;
  c.s = check_varlen(query, key, value, vl, dropout_p, va);
  if (dropout_p > 0.0) {
    if (rng_state.has_value()) check_rng_state(*rng_state, query.device());
    c.rng_state = rng_state.has_value() ? rng_state->clone() : draw();
  } else {
    c.rng_state = no_rng_state(query);
  }
  const VarlenShape& s = c.s;
  c.out = empty_checked("the output", {s.total_q, s.heads_q, s.head_dim_v}, query.options());
  c.lse = empty_checked("the logsumexp", {s.heads_q, s.total_q}, query.options().dtype(acc_type_of(query.scalar_type())));
  c.has_rows = s.total_q * s.heads_q > 0;
  if (!c.has_rows) return c;
  c.keep_alive = fill_varlen(c.p, s, query, key, value, vl, dropout_p, va, scale, c.rng_state);
  c.p.out = c.out.data_ptr();
  c.p.out_stride = packed_strides(c.out);
  c.p.lse = c.lse.data_ptr();
  return c;
}

struct VarlenBackwardCall {
  VarlenShape s;
  AttentionBwdParams p;
  std::vector<at::Tensor> keep_alive;
  bool has_heads = false;  // B * Hq > 0: p is filled
};

// The backward's checks (grad_out, out and logsumexp too) and the params of
// its inputs; outputs are the backend's.
inline VarlenBackwardCall prepare_varlen_backward(const at::Tensor& grad_out, const at::Tensor& query,
                                                  const at::Tensor& key, const at::Tensor& value,
                                                  const at::Tensor& out, const at::Tensor& logsumexp,
                                                  const VarlenArgs& vl, double dropout_p, const VariantArgs& va,
                                                  std::optional<double> scale, const at::Tensor& rng_state) {
  VarlenBackwardCall c;
  c.s = check_varlen(query, key, value, vl, dropout_p, va);
  const VarlenShape& s = c.s;
  check_same_shape("grad_out", grad_out, {s.total_q, s.heads_q, s.head_dim_v}, query);
  check_same_shape("out", out, {s.total_q, s.heads_q, s.head_dim_v}, query);
  check_same_shape("logsumexp", logsumexp, {s.heads_q, s.total_q}, query, acc_type_of(query.scalar_type()));
  if (dropout_p > 0.0) check_rng_state(rng_state, query.device());
  c.has_heads = s.batch * s.heads_q > 0;
  if (!c.has_heads) return c;
  c.keep_alive = fill_varlen(c.p, s, query, key, value, vl, dropout_p, va, scale, rng_state);
  if (!logsumexp.is_contiguous()) check_fits_in_memory("logsumexp's contiguous copy", logsumexp.sizes(), logsumexp.options());
  const at::Tensor lse_c = logsumexp.contiguous();
  c.p.grad_out = grad_out.const_data_ptr();
  c.p.grad_out_stride = packed_strides(grad_out);
  c.p.out = const_cast<void*>(out.const_data_ptr());
  c.p.out_stride = packed_strides(out);
  c.p.lse = const_cast<void*>(lse_c.const_data_ptr());
  c.keep_alive.push_back(lse_c);
  return c;
}

}  // namespace mha_ext
