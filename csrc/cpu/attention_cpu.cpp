// CPU host functions of mha_ext: check, allocate, fill params, call the kernel.
#include "../attention_params.h"
#include "../checks.h"
#include "../dropout.h"
#include "gemm_cpu.h"
#include "kernels_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace mha_ext {
namespace {

// (N..., X, Y, Z) -> (B, X, Y, Z) without a copy when the batch dims collapse,
// which covers contiguous, transposed-inner and expanded inputs.
at::Tensor flatten_batch(const at::Tensor& t) {
  if (t.dim() == 3) return t.unsqueeze(0);
  if (t.dim() == 4) return t;
  return t.reshape({-1, t.size(-3), t.size(-2), t.size(-1)});
}

Strides4 strides_of(const at::Tensor& t4) {
  return Strides4{t4.stride(0), t4.stride(1), t4.stride(2), t4.stride(3)};
}

std::vector<int64_t> with_batch(const AttentionShape& s, std::initializer_list<int64_t> tail) {
  std::vector<int64_t> v = s.batch_sizes;
  v.insert(v.end(), tail);
  return v;
}

at::ScalarType acc_type_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// The dropout contract of dropout.h for probability p and (seed, offset).
DropoutParams dropout_params(double p, const at::Tensor& rng_state) {
  const int64_t* r = rng_state.const_data_ptr<int64_t>();
  DropoutParams d;
  d.p = p;
  d.rescale = 1.0 / (1.0 - p);
  d.drop_threshold = static_cast<uint32_t>(std::floor(p * 4294967296.0));
  d.seed = static_cast<uint64_t>(r[0]);
  d.offset = static_cast<uint64_t>(r[1]);
  return d;
}

// Fills everything the forward and backward share: sizes, strides, mask,
// scale, dropout. Returns the flattened views it pointed at, which must
// outlive the kernel call.
std::vector<at::Tensor> fill_common(AttentionFwdParams& p, const AttentionShape& s,
                                    const at::Tensor& query, const at::Tensor& key,
                                    const at::Tensor& value,
                                    const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                    bool is_causal, std::optional<double> scale,
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

  p.batch = s.batch;
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.len_q = s.len_q;
  p.len_kv = s.len_kv;
  p.head_dim = s.head_dim;
  p.head_dim_v = s.head_dim_v;
  p.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  p.is_causal = is_causal;

  if (attn_mask.has_value()) {
    at::Tensor m4 = flatten_batch(attn_mask->expand(with_batch(s, {s.heads_q, s.len_q, s.len_kv})));
    p.mask = m4.const_data_ptr();
    p.mask_stride = strides_of(m4);
    p.mask_kind = m4.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kFloat;
    keep_alive.push_back(m4);
  }

  if (dropout_p > 0.0) {
    TORCH_INTERNAL_ASSERT(rng_state.has_value());
    p.dropout = dropout_params(dropout_p, *rng_state);
  }
  return keep_alive;
}

// Sums `full` (contiguous, shape `full_sizes`) into a contiguous tensor of
// `red_sizes` (each dim equal to full's or 1, right-aligned), in index order:
// deterministic whatever the thread count.
template <typename acc_t>
void sum_to_shape(const acc_t* full, at::IntArrayRef full_sizes, acc_t* red,
                  at::IntArrayRef red_sizes) {
  const int64_t nd = full_sizes.size(), pad = nd - static_cast<int64_t>(red_sizes.size());
  std::vector<int64_t> red_stride(nd, 0);
  int64_t st = 1;
  for (int64_t d = nd - 1; d >= pad; --d) {
    const int64_t rs = red_sizes[d - pad];
    red_stride[d] = rs == 1 ? 0 : st;
    st *= rs;
  }
  std::fill(red, red + st, acc_t(0));
  int64_t total = 1;
  for (int64_t x : full_sizes) total *= x;
  std::vector<int64_t> idx(nd, 0);
  int64_t off = 0;
  for (int64_t flat = 0; flat < total; ++flat) {
    red[off] += full[flat];
    for (int64_t d = nd - 1; d >= 0; --d) {
      off += red_stride[d];
      if (++idx[d] < full_sizes[d]) break;
      off -= red_stride[d] * idx[d];
      idx[d] = 0;
    }
  }
}

at::Tensor draw_rng_state() {
  return at::randint(0, int64_t(1) << 62, {2}, at::TensorOptions().dtype(at::kLong));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_fwd_cpu(
    const at::Tensor& query,  // (N..., Hq, L, E), any strides
    const at::Tensor& key,    // (N..., Hkv, S, E), any strides
    const at::Tensor& value,  // (N..., Hkv, S, Ev), any strides
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (N..., Hq, L, S)
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa,
    const std::optional<at::Tensor>& rng_state) {  // int64 (seed, offset), CPU
  const AttentionShape s =
      check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa);
  at::Tensor rng_out;
  if (dropout_p > 0.0) {
    if (rng_state.has_value()) check_rng_state(*rng_state);
    rng_out = rng_state.has_value() ? rng_state->clone() : draw_rng_state();
  } else {
    rng_out = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  }

  at::Tensor out = at::empty(with_batch(s, {s.heads_q, s.len_q, s.head_dim_v}), query.options());
  at::Tensor lse = at::empty(with_batch(s, {s.heads_q, s.len_q}),
                             query.options().dtype(acc_type_of(query.scalar_type())));
  if (s.batch * s.heads_q * s.len_q == 0) return {out, lse, rng_out};

  AttentionFwdParams p;
  auto keep_alive = fill_common(p, s, query, key, value, attn_mask, dropout_p, is_causal, scale,
                                rng_out);
  at::Tensor out4 = flatten_batch(out);
  p.out = out4.data_ptr();
  p.out_stride = strides_of(out4);
  p.lse = lse.data_ptr();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(),
                                  "attention_fwd_cpu", [&] { attention_fwd_kernel<scalar_t>(p); });
  return {out, lse, rng_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& grad_out,  // (N..., Hq, L, Ev), any strides
    const at::Tensor& query,     // (N..., Hq, L, E)
    const at::Tensor& key,       // (N..., Hkv, S, E)
    const at::Tensor& value,     // (N..., Hkv, S, Ev)
    const at::Tensor& out,       // (N..., Hq, L, Ev), the forward's output
    const at::Tensor& logsumexp,  // (N..., Hq, L), float32 (float64 for float64)
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa,
    const at::Tensor& rng_state,  // int64 (seed, offset), CPU
    bool attn_mask_requires_grad) {
  const AttentionShape s =
      check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa);
  const auto out_sizes = with_batch(s, {s.heads_q, s.len_q, s.head_dim_v});
  check_same_shape("grad_out", grad_out, out_sizes, query);
  check_same_shape("out", out, out_sizes, query);
  const at::ScalarType acc = acc_type_of(query.scalar_type());
  check_same_shape("logsumexp", logsumexp, with_batch(s, {s.heads_q, s.len_q}), query, acc);
  if (dropout_p > 0.0) check_rng_state(rng_state);
  const bool want_mask_grad = attn_mask_requires_grad && attn_mask.has_value() &&
                              attn_mask->scalar_type() != at::kBool;

  const int64_t B = s.batch, Hq = s.heads_q, Hkv = s.heads_kv, G = Hq / std::max<int64_t>(Hkv, 1);
  const int64_t L = s.len_q, S = s.len_kv, E = s.head_dim, Ev = s.head_dim_v;
  at::Tensor grad_q = at::empty(with_batch(s, {Hq, L, E}), query.options());
  at::Tensor grad_k = at::empty(with_batch(s, {Hkv, S, E}), query.options());
  at::Tensor grad_v = at::empty(with_batch(s, {Hkv, S, Ev}), query.options());
  at::Tensor grad_mask = at::empty({0}, query.options());
  const auto acc_opts = query.options().dtype(acc);
  at::Tensor dk_heads = at::empty({B, Hq, S, E}, acc_opts);
  at::Tensor dv_heads = at::empty({B, Hq, S, Ev}, acc_opts);
  at::Tensor dmask_full = want_mask_grad ? at::zeros({B, Hq, L, S}, acc_opts) : at::Tensor();

  if (B * Hq > 0) {
    AttentionBwdParams p;
    auto keep_alive = fill_common(p, s, query, key, value, attn_mask, dropout_p, is_causal, scale,
                                  rng_state);
    at::Tensor go4 = flatten_batch(grad_out), o4 = flatten_batch(out);
    at::Tensor lse_c = logsumexp.contiguous();
    p.grad_out = go4.const_data_ptr();
    p.grad_out_stride = strides_of(go4);
    p.out = const_cast<void*>(o4.const_data_ptr());
    p.out_stride = strides_of(o4);
    p.lse = const_cast<void*>(lse_c.const_data_ptr());
    p.grad_q = grad_q.data_ptr();
    p.grad_k = dk_heads.data_ptr();
    p.grad_v = dv_heads.data_ptr();
    p.grad_mask = want_mask_grad ? dmask_full.data_ptr() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(),
                                    "attention_bwd_cpu", [&] { attention_bwd_kernel<scalar_t>(p); });
  } else {
    dk_heads.zero_();
    dv_heads.zero_();
  }

  // Sum each GQA group of query heads, in order, into its key/value head.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "attention_bwd_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto reduce = [&](const at::Tensor& heads, at::Tensor& dst, int64_t D) {
      const acc_t* src = heads.const_data_ptr<acc_t>();
      scalar_t* out_ptr = dst.data_ptr<scalar_t>();
      const int64_t row = S * D;
      at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bk = begin; bk < end; ++bk) {
          const int64_t b = bk / Hkv, hk = bk % Hkv;
          for (int64_t x = 0; x < row; ++x) {
            acc_t sum = 0;
            for (int64_t g = 0; g < G; ++g) sum += src[((b * Hq) + hk * G + g) * row + x];
            out_ptr[bk * row + x] = static_cast<scalar_t>(sum);
          }
        }
      });
    };
    reduce(dk_heads, grad_k, E);
    reduce(dv_heads, grad_v, Ev);
    if (want_mask_grad) {
      std::vector<int64_t> full = with_batch(s, {Hq, L, S});
      at::Tensor red = at::empty(attn_mask->sizes(), acc_opts);
      sum_to_shape<acc_t>(dmask_full.const_data_ptr<acc_t>(), full, red.data_ptr<acc_t>(),
                          attn_mask->sizes());
      grad_mask = red.to(attn_mask->scalar_type());
    }
  });
  return {grad_q, grad_k, grad_v, grad_mask};
}

at::Tensor dropout_mask_cpu(const at::Tensor& rng_state,  // int64 (seed, offset), CPU
                            at::IntArrayRef shape,        // (N..., H, L, S)
                            double dropout_p) {
  check_rng_state(rng_state);
  check_dropout_p(dropout_p);
  TORCH_CHECK(!shape.empty(), "shape must have at least 1 dim, got ()");
  at::Tensor keep = at::empty(shape, at::TensorOptions().dtype(at::kBool));
  const int64_t S = shape.back();
  const int64_t rows = S == 0 ? 0 : keep.numel() / S;
  const DropoutParams d = dropout_params(dropout_p, rng_state);
  uint8_t* dst = reinterpret_cast<uint8_t*>(keep.data_ptr<bool>());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      dropout_keep_row_cpu(d, static_cast<uint64_t>(r), 0, S, dst + r * S);
    }
  });
  return keep;
}

std::string cpu_isa() { return cpu::isa_name(cpu::active_isa()); }

}  // namespace

// No tensor argument to dispatch on: the kernel serves every backend.
TORCH_LIBRARY_IMPL(mha_ext, CompositeImplicitAutograd, m) { m.impl("cpu_isa", &cpu_isa); }

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("attention", &attention_fwd_cpu);
  m.impl("attention_backward", &attention_bwd_cpu);
  m.impl("dropout_mask", &dropout_mask_cpu);
}

}  // namespace mha_ext
