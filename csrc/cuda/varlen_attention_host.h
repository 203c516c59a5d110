// Host functions of the varlen ops on the CUDA backend (and, like
// attention_host.h, in the emulation test library): check, allocate, fill
// params, launch the dense kernels, which take the packed sequences one at a
// time (sequence_params). Grids span the longest sequence; the blocks past a
// shorter one's rows or keys return at once. cu_seqlens are copied to the
// host once per call to check their values (a sync on a GPU).
#pragma once

#include "../varlen_host.h"
#include "attention_host.h"

namespace mha_ext {
namespace device_host {

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_fwd_device(
    const at::Tensor& query,         // (total_q, Hq, E), any strides
    const at::Tensor& key,           // (total_k, Hkv, E), any strides
    const at::Tensor& value,         // (total_k, Hkv, Ev), any strides
    const at::Tensor& cu_seqlens_q,  // (B + 1) int32
    const at::Tensor& cu_seqlens_k,  // (B + 1) int32
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal, std::optional<double> scale,
    const std::optional<at::Tensor>& rng_state,  // int64 (seed, offset), CPU or query's device
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {  // (Hq) or (B, Hq)
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
  const VarlenArgs vl{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
#if defined(__CUDACC__)
  const c10::cuda::CUDAGuard guard(query.device());
#endif
  VarlenForwardCall c = prepare_varlen_forward(query, key, value, vl, dropout_p, va, scale, rng_state,
                                               [&] { return draw_rng_state(query, max_seqlen_k); });
  if (!c.has_rows) return {c.out, c.lse, c.rng_state};
  check_device_limits(c.s);
  check_gpu(query, c.s);
  read_rng_on_device(c.p.dropout, c.rng_state, query);
  const simt::Stream stream = current_stream(query);
  dispatch_device_type(query.scalar_type(), "varlen_attention", [&](auto elem) {
    using T = decltype(elem);
    launch_forward<T>(c.p, query, stream);
  });
  return {c.out, c.lse, c.rng_state};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_device(
    const at::Tensor& grad_out,   // (total_q, Hq, Ev), any strides
    const at::Tensor& query,      // (total_q, Hq, E)
    const at::Tensor& key,        // (total_k, Hkv, E)
    const at::Tensor& value,      // (total_k, Hkv, Ev)
    const at::Tensor& out,        // (total_q, Hq, Ev), the forward's output
    const at::Tensor& logsumexp,  // (Hq, total_q), float32 (float64 for float64)
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, bool is_causal, std::optional<double> scale,
    const at::Tensor& rng_state,  // int64 (seed, offset), CPU or query's device
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
  const VarlenArgs vl{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
#if defined(__CUDACC__)
  const c10::cuda::CUDAGuard guard(query.device());
#endif
  VarlenBackwardCall c =
      prepare_varlen_backward(grad_out, query, key, value, out, logsumexp, vl, dropout_p, va, scale, rng_state);
  const VarlenShape& s = c.s;
  const int64_t Hq = s.heads_q, Hkv = s.heads_kv, G = Hq / std::max<int64_t>(Hkv, 1);
  const int64_t E = s.head_dim, Ev = s.head_dim_v, Tq = s.total_q, Tk = s.total_kv;
  const auto acc_opts = query.options().dtype(acc_type_of(query.scalar_type()));
  at::Tensor grad_q = at::zeros({Tq, Hq, E}, query.options());
  // dK and dV per query head, (total_k, Hq, D): a GQA group's heads are adjacent
  at::Tensor dk_heads = at::zeros({Tk, Hq, E}, acc_opts);
  at::Tensor dv_heads = at::zeros({Tk, Hq, Ev}, acc_opts);
  if (c.has_heads && s.len_q > 0 && s.len_kv > 0) {
    AttentionBwdParams& p = c.p;
    check_device_limits(s);
    check_gpu(query, s);
    const at::Tensor rng_c = rng_state.contiguous();
    read_rng_on_device(p.dropout, rng_c, query);
    at::Tensor row_stats = at::empty({3, Hq, Tq}, acc_opts);  // D, row_shift, row_log_norm: lse's layout
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    at::Tensor dq_accum = deterministic ? at::Tensor() : at::zeros({Tq, Hq, E}, acc_opts);
    p.grad_q = grad_q.data_ptr();
    p.grad_k = dk_heads.data_ptr();
    p.grad_v = dv_heads.data_ptr();
    p.grad_q_stride = packed_strides(grad_q);  // and dq_accum's
    p.grad_k_stride = packed_strides(dk_heads);
    p.grad_v_stride = packed_strides(dv_heads);
    p.row_dot = row_stats[0].data_ptr();
    p.row_shift = row_stats[1].data_ptr();
    p.row_log_norm = row_stats[2].data_ptr();
    p.grad_q_accum = deterministic ? nullptr : dq_accum.data_ptr();
    const simt::Stream stream = current_stream(query);
    dispatch_device_type(query.scalar_type(), "varlen_attention_backward", [&](auto elem) {
      using T = decltype(elem);
      DeviceWorkspace workspace{query.options()};
      device::launch_attention_bwd<T>(p, stream, [](auto status) { check_launch(status); }, workspace);
    });
    if (!deterministic) grad_q.copy_(dq_accum);
  }
  at::Tensor grad_k = dk_heads.view({Tk, Hkv, G, E}).sum(2).to(query.scalar_type());
  at::Tensor grad_v = dv_heads.view({Tk, Hkv, G, Ev}).sum(2).to(query.scalar_type());
  return {grad_q, grad_k, grad_v};
}

}  // namespace device_host
}  // namespace mha_ext
