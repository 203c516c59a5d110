// Host-side helpers every backend's host functions share: flattening the
// batch dims, strides, the dropout contract and filling the kernel params.
#pragma once

#include "attention_params.h"
#include "checks.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <vector>

namespace mha_ext {

// A fresh (seed, offset) from torch's default CPU generator.
inline at::Tensor draw_cpu_rng_state() {
  return at::randint(0, int64_t(1) << 62, {2}, at::TensorOptions().dtype(at::kLong));
}

// (N..., X, Y, Z) -> (B, X, Y, Z) without a copy when the batch dims collapse,
// which covers contiguous, transposed-inner and expanded inputs.
inline at::Tensor flatten_batch(const at::Tensor& t) {
  if (t.dim() == 3) return t.unsqueeze(0);
  if (t.dim() == 4) return t;
  return t.reshape({-1, t.size(-3), t.size(-2), t.size(-1)});
}

inline Strides4 strides_of(const at::Tensor& t4) {
  return Strides4{t4.stride(0), t4.stride(1), t4.stride(2), t4.stride(3)};
}

inline std::vector<int64_t> with_batch(const AttentionShape& s, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> v = s.batch_sizes;
  v.insert(v.end(), tail);
  return v;
}

// at::empty for a buffer the call writes in full, once it is known to fit in
// the machine's memory (check_fits_in_memory).
inline at::Tensor empty_checked(const char* what, at::IntArrayRef sizes, const at::TensorOptions& options) {
  check_fits_in_memory(what, sizes, options);
  return at::empty(sizes, options);
}

// An output (N, Hq, L, Ev) whose leading dims lie in memory in the order of
// query's strides, as torch's fused SDPA allocates its output: a query that is
// a view of (N, L, Hq * E) gives an output that is a view of (N, L, Hq * Ev),
// which a transformers backend's out.transpose(1, 2).contiguous() and the
// output projection then take without a copy. Dims of size 1 or stride 0 stay
// where they are; other ranks (torch's fallback) get a contiguous output.
inline at::Tensor empty_in_query_order(const at::Tensor& query, const std::vector<int64_t>& sizes) {
  check_fits_in_memory("the output", sizes, query.options());
  if (query.dim() != 4 || sizes.size() != 4) return at::empty(sizes, query.options());
  std::vector<int64_t> slots;  // the dims that take part, in their logical order
  for (int64_t d = 0; d < 3; ++d)
    if (query.size(d) > 1 && query.stride(d) > 0) slots.push_back(d);
  std::vector<int64_t> order = slots;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return query.stride(a) > query.stride(b); });
  std::vector<int64_t> perm = {0, 1, 2, 3};  // perm[m]: the logical dim at memory position m
  for (size_t i = 0; i < slots.size(); ++i) perm[slots[i]] = order[i];
  std::vector<int64_t> mem_sizes(4), inv(4);
  for (int64_t m = 0; m < 4; ++m) mem_sizes[m] = sizes[perm[m]], inv[perm[m]] = m;
  return at::empty(mem_sizes, query.options()).permute(inv);
}

inline at::ScalarType acc_type_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The dropout contract of dropout.h for probability p and (seed, offset)
// (and the frame, for 5 entries): read here from a CPU rng_state; a kernel
// reads one on another device.
inline DropoutParams dropout_params(double p, const at::Tensor& rng_state) {
  const int64_t* r = rng_state.const_data_ptr<int64_t>();
  DropoutParams d;
  d.p = p;
  d.rescale = 1.0 / (1.0 - p);
  d.drop_threshold = static_cast<uint32_t>(std::floor(p * 4294967296.0));
  const bool framed = rng_state.numel() == 5;
  if (rng_state.device().is_cpu()) {
    d.seed = static_cast<uint64_t>(r[0]);
    d.offset = static_cast<uint64_t>(r[1]);
    if (framed) d.frame_rows = r[2], d.frame_row0 = r[3], d.frame_col0 = r[4];
  } else {
    d.seed_ptr = r;
    d.offset_ptr = r + 1;
    if (framed) d.frame_ptr = r + 2;
  }
  return d;
}

// The variant arguments of both ops as the schemas name them (see
// AttentionVariant): is_causal, window_left / window_right, bottom_right,
// softcap, alibi_slopes.
struct VariantArgs {
  bool is_causal = false;
  int64_t window_left = -1, window_right = -1;
  bool bottom_right = false;
  double softcap = 0.0;
  const std::optional<at::Tensor>& alibi_slopes;
};

// Fills what every op's params share beyond the tensors q, k, v and the
// mask: sizes, scale, the variant, dropout. Views it made go to keep_alive.
inline void fill_scalars(AttentionFwdParams& p, const AttentionShape& s, const at::Tensor& query, double dropout_p,
                         const VariantArgs& va, std::optional<double> scale,
                         const std::optional<at::Tensor>& rng_state, std::vector<at::Tensor>& keep_alive) {
  p.batch = s.batch;
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.len_q = s.len_q;
  p.len_kv = s.len_kv;
  p.head_dim = s.head_dim;
  p.head_dim_v = s.head_dim_v;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  AttentionVariant& w = p.variant;
  w.bottom_right = va.bottom_right;
  w.diag_offset = va.bottom_right ? s.len_kv - s.len_q : 0;
  // a window wider than L + S changes nothing; clamped there, i + offset +- it cannot overflow
  const int64_t widest = s.len_q + s.len_kv;
  const int64_t left = std::min(va.window_left, widest), right = std::min(va.window_right, widest);
  w.left = left;
  w.right = va.is_causal ? (right < 0 ? 0 : std::min<int64_t>(right, 0)) : right;
  w.softcap = va.softcap;
  if (va.alibi_slopes.has_value()) {  // (Hq) or (N..., Hq) -> (B, Hq) in the accumulation type
    at::Tensor a = va.alibi_slopes->to(acc_type_of(query.scalar_type()));
    a = a.expand(with_batch(s, {s.heads_q})).reshape({s.batch, s.heads_q});
    w.alibi = a.const_data_ptr();
    w.alibi_stride_b = a.stride(0);
    w.alibi_stride_h = a.stride(1);
    keep_alive.push_back(a);
  }
  if (dropout_p > 0.0) {
    TORCH_INTERNAL_ASSERT(rng_state.has_value());
    at::Tensor rng = rng_state->contiguous();  // kernels read (seed, offset) at [0], [1]
    p.dropout = dropout_params(dropout_p, rng);
    keep_alive.push_back(rng);
  }
}

// Fills everything the forward and backward share: sizes, strides, mask,
// scale, the variant, dropout. Returns the flattened views it pointed at, which must
// outlive the kernel call.
inline std::vector<at::Tensor> fill_common(AttentionFwdParams& p, const AttentionShape& s,
                                    const at::Tensor& query, const at::Tensor& key,
                                    const at::Tensor& value,
                                    const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                    const VariantArgs& va, std::optional<double> scale,
                                    const std::optional<at::Tensor>& rng_state) {
  std::vector<at::Tensor> keep_alive;
  at::Tensor q4 = flatten_batch(query), k4 = flatten_batch(key), v4 = flatten_batch(value);
  p.q = q4.const_data_ptr();
  p.k = k4.const_data_ptr();
  p.v = v4.const_data_ptr();
  p.q_stride = strides_of(q4);
  p.k_stride = strides_of(k4);
  p.v_stride = strides_of(v4);
  keep_alive.insert(keep_alive.end(), {q4, k4, v4});
  fill_scalars(p, s, query, dropout_p, va, scale, rng_state, keep_alive);
  p.lse_stride_b = s.heads_q * s.len_q;  // lse (B, Hq, L), contiguous
  p.lse_stride_h = s.len_q;

  if (attn_mask.has_value()) {
    at::Tensor m4 = flatten_batch(attn_mask->expand(with_batch(s, {s.heads_q, s.len_q, s.len_kv})));
    p.mask = m4.const_data_ptr();
    p.mask_stride = strides_of(m4);
    p.mask_kind = m4.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kFloat;
    keep_alive.push_back(m4);
  }
  return keep_alive;
}

// The rng_state a call without dropout returns: (0, 0) on query's device
// (on the CPU written in place, one dispatched op fewer than zeros())
inline at::Tensor no_rng_state(const at::Tensor& query) {
  if (!query.device().is_cpu()) return at::zeros({2}, query.options().dtype(at::kLong));
  at::Tensor r = at::empty({2}, query.options().dtype(at::kLong));
  r.data_ptr<int64_t>()[0] = r.data_ptr<int64_t>()[1] = 0;
  return r;
}

// What the forward host function of every backend does before its kernel:
// check the inputs (plus `check_backend` on the shape), settle the rng state
// (a copy of the given one, or `draw()` when dropout needs one; zeros on
// query's device without dropout), allocate out and lse, and, when there is
// a row to compute, fill the params.
struct ForwardCall {
  AttentionShape s;
  at::Tensor out, lse, rng_state;
  AttentionFwdParams p;
  std::vector<at::Tensor> keep_alive;  // views p points into
  bool has_rows = false;               // B * Hq * L > 0: p is filled
};

template <typename CheckBackend, typename Draw>
ForwardCall prepare_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask, double dropout_p, const VariantArgs& va,
                            std::optional<double> scale, bool enable_gqa,
                            const std::optional<at::Tensor>& rng_state, CheckBackend&& check_backend,
                            Draw&& draw) {
  ForwardCall c;
  c.s = check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa);
  check_variant(c.s, query, va.window_left, va.window_right, va.softcap, va.alibi_slopes);
  check_backend(c.s);
  if (dropout_p > 0.0) {
    if (rng_state.has_value()) check_rng_state(*rng_state, query.device(), c.s.len_q);
    c.rng_state = rng_state.has_value() ? rng_state->clone() : draw();
  } else {
    c.rng_state = no_rng_state(query);
  }
  const AttentionShape& s = c.s;
  c.out = empty_in_query_order(query, with_batch(s, {s.heads_q, s.len_q, s.head_dim_v}));
  c.lse = empty_checked("the logsumexp", with_batch(s, {s.heads_q, s.len_q}),
                        query.options().dtype(acc_type_of(query.scalar_type())));
  c.has_rows = s.batch * s.heads_q * s.len_q > 0;
  if (!c.has_rows) return c;
  c.keep_alive = fill_common(c.p, s, query, key, value, attn_mask, dropout_p, va, scale, c.rng_state);
  at::Tensor out4 = flatten_batch(c.out);
  c.p.out = out4.data_ptr();
  c.p.out_stride = strides_of(out4);
  c.p.lse = c.lse.data_ptr();
  c.keep_alive.push_back(out4);
  return c;
}

// The same for the backward: checks (grad_out, out and logsumexp against the
// forward's shapes too), whether a mask gradient is wanted, and, when there
// is a head (B * Hq > 0), the params of the inputs. Outputs are the backend's.
struct BackwardCall {
  AttentionShape s;
  bool want_mask_grad = false;  // a floating attn_mask that requires grad
  AttentionBwdParams p;
  std::vector<at::Tensor> keep_alive;
  bool has_heads = false;
};

template <typename CheckBackend>
BackwardCall prepare_backward(const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
                              const std::optional<at::Tensor>& attn_mask, double dropout_p, const VariantArgs& va,
                              std::optional<double> scale, bool enable_gqa, const at::Tensor& rng_state,
                              bool attn_mask_requires_grad, CheckBackend&& check_backend) {
  BackwardCall c;
  c.s = check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa);
  check_variant(c.s, query, va.window_left, va.window_right, va.softcap, va.alibi_slopes);
  check_backend(c.s);
  const AttentionShape& s = c.s;
  const auto out_sizes = with_batch(s, {s.heads_q, s.len_q, s.head_dim_v});
  check_same_shape("grad_out", grad_out, out_sizes, query);
  check_same_shape("out", out, out_sizes, query);
  check_same_shape("logsumexp", logsumexp, with_batch(s, {s.heads_q, s.len_q}), query,
                   acc_type_of(query.scalar_type()));
  if (dropout_p > 0.0) check_rng_state(rng_state, query.device(), s.len_q);
  c.want_mask_grad = attn_mask_requires_grad && attn_mask.has_value() && attn_mask->scalar_type() != at::kBool;
  c.has_heads = s.batch * s.heads_q > 0;
  if (!c.has_heads) return c;
  c.keep_alive = fill_common(c.p, s, query, key, value, attn_mask, dropout_p, va, scale, rng_state);
  if (!logsumexp.is_contiguous()) check_fits_in_memory("logsumexp's contiguous copy", logsumexp.sizes(), logsumexp.options());
  at::Tensor go4 = flatten_batch(grad_out), o4 = flatten_batch(out), lse_c = logsumexp.contiguous();
  c.p.grad_out = go4.const_data_ptr();
  c.p.grad_out_stride = strides_of(go4);
  c.p.out = const_cast<void*>(o4.const_data_ptr());
  c.p.out_stride = strides_of(o4);
  c.p.lse = const_cast<void*>(lse_c.const_data_ptr());
  c.keep_alive.insert(c.keep_alive.end(), {go4, o4, lse_c});
  return c;
}

}  // namespace mha_ext
