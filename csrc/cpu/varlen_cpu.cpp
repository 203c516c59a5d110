// CPU host functions of the varlen ops: check, allocate, fill params, call the
// dense kernels, which take the packed sequences one at a time
// (sequence_params). No work is spent on padding: each (sequence, head)
// costs its own L x S.
#include "../varlen_host.h"
#include "kernels_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

namespace mha_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_fwd_cpu(
    const at::Tensor& query,         // (total_q, Hq, E), any strides
    const at::Tensor& key,           // (total_k, Hkv, E), any strides
    const at::Tensor& value,         // (total_k, Hkv, Ev), any strides
    const at::Tensor& cu_seqlens_q,  // (B + 1) int32
    const at::Tensor& cu_seqlens_k,  // (B + 1) int32
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal, std::optional<double> scale,
    const std::optional<at::Tensor>& rng_state,  // int64 (seed, offset), CPU
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {  // (Hq) or (B, Hq)
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
  const VarlenArgs vl{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  VarlenForwardCall c =
      prepare_varlen_forward(query, key, value, vl, dropout_p, va, scale, rng_state, draw_cpu_rng_state);
  if (!c.has_rows) return {c.out, c.lse, c.rng_state};
  const AttentionFwdParams& p = c.p;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "varlen_attention_fwd_cpu",
                                  [&] { attention_fwd_kernel<scalar_t>(p); });
  return {c.out, c.lse, c.rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_cpu(
    const at::Tensor& grad_out,   // (total_q, Hq, Ev), any strides
    const at::Tensor& query,      // (total_q, Hq, E)
    const at::Tensor& key,        // (total_k, Hkv, E)
    const at::Tensor& value,      // (total_k, Hkv, Ev)
    const at::Tensor& out,        // (total_q, Hq, Ev), the forward's output
    const at::Tensor& logsumexp,  // (Hq, total_q), float32 (float64 for float64)
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, bool is_causal, std::optional<double> scale,
    const at::Tensor& rng_state,  // int64 (seed, offset), CPU
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
  const VarlenArgs vl{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  VarlenBackwardCall c =
      prepare_varlen_backward(grad_out, query, key, value, out, logsumexp, vl, dropout_p, va, scale, rng_state);
  const VarlenShape& s = c.s;
  const int64_t Hq = s.heads_q, Hkv = s.heads_kv, G = Hq / std::max<int64_t>(Hkv, 1);
  const int64_t E = s.head_dim, Ev = s.head_dim_v, Tk = s.total_kv;
  const auto acc_opts = query.options().dtype(acc_type_of(query.scalar_type()));
  at::Tensor grad_q = empty_checked("grad_query", {s.total_q, Hq, E}, query.options()).zero_();
  at::Tensor grad_k = empty_checked("grad_key", {Tk, Hkv, E}, query.options());
  at::Tensor grad_v = empty_checked("grad_value", {Tk, Hkv, Ev}, query.options());
  // dK and dV per query head, (total_k, Hq, D): a GQA group's heads are adjacent
  at::Tensor dk_heads = empty_checked("grad_key per query head", {Tk, Hq, E}, acc_opts).zero_();
  at::Tensor dv_heads = empty_checked("grad_value per query head", {Tk, Hq, Ev}, acc_opts).zero_();
  if (c.has_heads) {
    AttentionBwdParams& p = c.p;
    p.grad_q = grad_q.data_ptr();
    p.grad_k = dk_heads.data_ptr();
    p.grad_v = dv_heads.data_ptr();
    p.grad_q_stride = packed_strides(grad_q);
    p.grad_k_stride = packed_strides(dk_heads);
    p.grad_v_stride = packed_strides(dv_heads);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "varlen_attention_bwd_cpu",
                                    [&] { attention_bwd_kernel<scalar_t>(p); });
  }
  // Sum each GQA group of query heads, in order, into its key/value head.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "varlen_attention_bwd_reduce", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto reduce = [&](const at::Tensor& heads, at::Tensor& dst, int64_t D) {
      const acc_t* src = heads.const_data_ptr<acc_t>();
      scalar_t* d = dst.data_ptr<scalar_t>();
      at::parallel_for(0, Tk * Hkv, 64, [&](int64_t begin, int64_t end) {
        for (int64_t rk = begin; rk < end; ++rk)  // rk = (row, hk)
          for (int64_t x = 0; x < D; ++x) {
            acc_t sum = 0;
            for (int64_t g = 0; g < G; ++g) sum += src[(rk * G + g) * D + x];
            d[rk * D + x] = static_cast<scalar_t>(sum);
          }
      });
    };
    reduce(dk_heads, grad_k, E);
    reduce(dv_heads, grad_v, Ev);
  });
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(mha_ext, CPU, m) {
  m.impl("varlen_attention", &varlen_attention_fwd_cpu);
  m.impl("varlen_attention_backward", &varlen_attention_bwd_cpu);
}

}  // namespace mha_ext
