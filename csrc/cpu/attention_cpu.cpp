// CPU host functions of mha_ext: check, allocate, fill params, call the kernel.
#include "../attention_params.h"
#include "../checks.h"
#include "../dropout.h"
#include "../host_common.h"
#include "gemm_cpu.h"
#include "kernels_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace mha_ext {
namespace {

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_fwd_cpu(
    const at::Tensor& query,  // (N..., Hq, L, E), any strides
    const at::Tensor& key,    // (N..., Hkv, S, E), any strides
    const at::Tensor& value,  // (N..., Hkv, S, Ev), any strides
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (N..., Hq, L, S)
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa,
    const std::optional<at::Tensor>& rng_state,  // int64 (seed, offset), CPU
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {  // (Hq) or (N..., Hq) slopes
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
  ForwardCall c = prepare_forward(query, key, value, attn_mask, dropout_p, va, scale, enable_gqa,
                                  rng_state, [](const AttentionShape&) {}, draw_cpu_rng_state);
  if (!c.has_rows) return {c.out, c.lse, c.rng_state};
  const AttentionFwdParams& p = c.p;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(),
                                  "attention_fwd_cpu", [&] { attention_fwd_kernel<scalar_t>(p); });
  return {c.out, c.lse, c.rng_state};
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
    bool attn_mask_requires_grad, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
  BackwardCall c = prepare_backward(grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p, va,
                                    scale, enable_gqa, rng_state, attn_mask_requires_grad,
                                    [](const AttentionShape&) {});
  const AttentionShape& s = c.s;
  const bool want_mask_grad = c.want_mask_grad;
  const at::ScalarType acc = acc_type_of(query.scalar_type());
  const int64_t B = s.batch, Hq = s.heads_q, Hkv = s.heads_kv, G = Hq / std::max<int64_t>(Hkv, 1);
  const int64_t L = s.len_q, S = s.len_kv, E = s.head_dim, Ev = s.head_dim_v;
  at::Tensor grad_q = empty_checked("grad_query", with_batch(s, {Hq, L, E}), query.options());
  at::Tensor grad_k = empty_checked("grad_key", with_batch(s, {Hkv, S, E}), query.options());
  at::Tensor grad_v = empty_checked("grad_value", with_batch(s, {Hkv, S, Ev}), query.options());
  at::Tensor grad_mask = at::empty({0}, query.options());
  const auto acc_opts = query.options().dtype(acc);
  at::Tensor dk_heads = empty_checked("grad_key per query head", {B, Hq, S, E}, acc_opts);
  at::Tensor dv_heads = empty_checked("grad_value per query head", {B, Hq, S, Ev}, acc_opts);
  at::Tensor dmask_full =
      want_mask_grad ? empty_checked("grad_attn_mask per head", {B, Hq, L, S}, acc_opts).zero_() : at::Tensor();

  if (c.has_heads) {
    AttentionBwdParams& p = c.p;
    p.grad_q = grad_q.data_ptr();
    p.grad_k = dk_heads.data_ptr();
    p.grad_v = dv_heads.data_ptr();
    p.grad_q_stride = Strides4{Hq * L * E, L * E, E, 1};
    p.grad_k_stride = strides_of(dk_heads);
    p.grad_v_stride = strides_of(dv_heads);
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

at::Tensor dropout_mask_cpu(const at::Tensor& rng_state,  // int64 (seed, offset[, rows, row0, col0]), CPU
                            at::IntArrayRef shape,        // (N..., H, L, S)
                            double dropout_p) {
  TORCH_CHECK(!shape.empty(), "shape must have at least 1 dim, got ()");
  const int64_t L = shape.size() >= 2 ? shape[shape.size() - 2] : 1;
  check_rng_state(rng_state, at::Device(at::kCPU), L);
  check_dropout_p(dropout_p);
  at::Tensor keep = empty_checked("the mask", shape, at::TensorOptions().dtype(at::kBool));
  const int64_t S = shape.back();
  const int64_t rows = S == 0 ? 0 : keep.numel() / S;
  const DropoutParams d = dropout_params(dropout_p, rng_state.contiguous());
  const DropoutFrame f = dropout_frame(d);
  uint8_t* dst = reinterpret_cast<uint8_t*>(keep.data_ptr<bool>());
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {  // r = (b H + h) L + i
      const int64_t id = f.rows > 0 ? (r / L) * f.rows + f.row0 + r % L : r;
      dropout_keep_row_cpu(d, static_cast<uint64_t>(id), 0, S, dst + r * S);
    }
  });
  return keep;
}

at::Tensor draw_rng_state_cpu(const at::Tensor& like, int64_t len_kv) {
  TORCH_CHECK(len_kv >= 0, "len_kv must be >= 0, got ", len_kv);
  (void)like;
  return draw_cpu_rng_state();
}

std::string cpu_isa() { return cpu::isa_name(cpu::active_isa()); }

}  // namespace

// No tensor argument to dispatch on: the kernel serves every backend.
TORCH_LIBRARY_IMPL(mha_ext, CompositeImplicitAutograd, m) { m.impl("cpu_isa", &cpu_isa); }

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("attention", &attention_fwd_cpu);
  m.impl("attention_backward", &attention_bwd_cpu);
  m.impl("dropout_mask", &dropout_mask_cpu);
  m.impl("draw_rng_state", &draw_rng_state_cpu);
}

}  // namespace mha_ext
