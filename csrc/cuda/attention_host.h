// Host functions of the CUDA backend: check, allocate, fill params, launch.
// Included by attention_cuda.cu (nvcc: CUDA tensors, real launches on the
// current stream) and by the emulation test library tests/emul (CPU tensors,
// the same kernels run by simt_emul.h), so the tests cover this code too.
#pragma once

#include "../checks.h"
#include "../host_common.h"
#include "launch.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ExpandUtils.h>
#include <ATen/ops/zeros.h>

#include <limits>
#include <tuple>

#if defined(__CUDACC__)
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace mha_ext {
namespace device_host {

// Calls f with a value of the device element type of `t`.
template <typename F>
auto dispatch_device_type(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kHalf: return f(simt::f16{});
    case at::kBFloat16: return f(simt::bf16{});
    case at::kFloat: return f(float{});
    case at::kDouble: return f(double{});
    default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype_name(t));
  }
}

inline void check_device_limits(const AttentionShape& s) {
  TORCH_CHECK(device::padded_head_dim(s.head_dim, s.head_dim_v) != 0,
              "the CUDA kernels support head dims up to ", device::kMaxHeadDim, ", got E = ", s.head_dim,
              ", Ev = ", s.head_dim_v);
  TORCH_CHECK(s.batch * s.heads_q <= std::numeric_limits<int32_t>::max(),
              "batch x heads must fit in 31 bits for the CUDA grid, got ", s.batch * s.heads_q);
  const int64_t rows = std::max(s.len_q, s.len_kv);
  TORCH_CHECK(rows <= device::kMaxRows, "the CUDA kernels support sequence lengths up to ", device::kMaxRows,
              ", got L = ", s.len_q, ", S = ", s.len_kv);
}

// The GPU must be sm_80 or newer, and the tile configuration of this dtype
// and head dim must fit its shared memory per block (float64 at head dim >
// 128 needs 132 KiB: sm_80 / sm_90 have it, sm_86 / sm_89 do not).
inline void check_gpu(const at::Tensor& query, const AttentionShape& s) {
#if defined(__CUDACC__)
  const int index = query.device().index();
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
  if (major < 8) {  // the name only for the error
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
    check_compute_capability(major, minor, prop.name);
  }
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, query.device().index()));
  const size_t need = dispatch_device_type(query.scalar_type(), "attention", [&](auto elem) {
    return device::shared_bytes_needed<decltype(elem)>(s.head_dim, s.head_dim_v);
  });
  TORCH_CHECK(need <= static_cast<size_t>(optin), "the CUDA kernels for ", dtype_name(query.scalar_type()),
              " with head dim ", std::max(s.head_dim, s.head_dim_v), " need ", need / 1024,
              " KiB of shared memory per block; this GPU allows ", optin / 1024, " KiB",
              query.scalar_type() == at::kDouble ? " (float32 needs less)" : "");
#else
  (void)query;
  (void)s;
#endif
}

inline simt::Stream current_stream(const at::Tensor& t) {
#if defined(__CUDACC__)
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#else
  (void)t;
  return nullptr;
#endif
}

template <typename Status>
void check_launch(Status status) {
#if defined(__CUDACC__)
  C10_CUDA_CHECK(status);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
  (void)status;
#endif
}

// A decode step's GQA group as the query rows of one block, as
// FlashAttention's decoding does: with one query row a head, query heads
// hk G .. hk G + G - 1 become rows 0 .. G - 1 of key/value head hk, so that
// each K/V tile is read once a group instead of once a query head. Their q,
// out, mask and lse entries stay where they are (the head stride becomes
// the row stride; lse's rows are 1 apart). Only where nothing else depends
// on a row's index or head: no ALiBi, no dropout, and no bound on the keys
// (with one row aligned bottom-right, causal bounds nothing: that row's
// diagonal is the last key). Returns whether it packed.
inline bool pack_gqa_rows(AttentionFwdParams& p) {
  AttentionVariant v = p.variant;
  if (v.bottom_right && p.len_q == 1 && v.left < 0) v.right = -1;
  if (p.len_q != 1 || p.heads_kv <= 0 || p.group_size() <= 1 || p.cu_seqlens_q != nullptr || p.dropout.enabled() ||
      v.alibi != nullptr || v.limits_keys() || p.lse_stride_h != 1)
    return false;
  const int64_t G = p.group_size();
  auto pack = [G](Strides4& st) { st = Strides4{st.b, G * st.h, st.h, st.col}; };
  pack(p.q_stride);
  pack(p.out_stride);
  pack(p.mask_stride);
  p.variant = v;
  p.lse_stride_h = G;
  p.heads_q = p.heads_kv;
  p.len_q = G;
  p.variant.diag_offset = v.bottom_right ? p.len_kv - G : 0;  // bounds nothing (above)
  return true;
}

// The workspace callback of the launch functions (launch.h; one call a
// launch function: the key splits' partial results, a bool mask's ranges):
// n bytes from torch's allocator on the device of `options`, held while this
// object lives, which ends when the op's call returns: the caching
// allocator hands them out again only to work queued after those kernels on
// the stream.
struct DeviceWorkspace {
  at::TensorOptions options;
  at::Tensor bytes;
  void* operator()(size_t n) {
    bytes = at::empty({static_cast<int64_t>(n)}, options.dtype(at::kByte));
    return bytes.data_ptr();
  }
};

// The forward's launches (device::launch_attention_fwd) for element type T,
// a decode step's GQA group packed (pack_gqa_rows), their workspace on query's device.
template <typename T>
void launch_forward(AttentionFwdParams p, const at::Tensor& query, simt::Stream stream) {
  pack_gqa_rows(p);
  DeviceWorkspace workspace{query.options()};
  device::launch_attention_fwd<T>(p, stream, [](auto status) { check_launch(status); }, workspace);
}

// (seed, offset) for a call with dropout and no rng_state, as an int64 (2)
// tensor on query's device: from torch's CUDA generator, advanced by the
// Philox counters a row of S keys uses. Inside a CUDA graph the generator's
// seed and offset live in device memory (what at::cuda::philox::unpack
// reads); the tensor is then assembled by device ops from them, so each
// replay of the graph draws anew. The emulation draws from the CPU generator.
inline at::Tensor draw_rng_state(const at::Tensor& query, int64_t len_kv) {
#if defined(__CUDACC__)
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(query.device().index()));
  // a row uses ceil(S / 4) Philox blocks of 4 numbers; torch counts numbers
  const uint64_t numbers = 4 * static_cast<uint64_t>((len_kv + 3) / 4);
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(numbers);
  }
  const auto on_device = query.options().dtype(at::kLong);
  if (state.captured_) {
    auto wrap = [&](int64_t* ptr) {
      return at::for_blob(ptr, {1}).options(on_device).target_device(query.device()).make_tensor();
    };
    // torch's offsets count 32-bit numbers; ours counts Philox blocks of 4
    at::Tensor offset = wrap(state.offset_.ptr).add(static_cast<int64_t>(state.offset_intragraph_));
    return at::cat({wrap(state.seed_.ptr), offset.div(4, "floor")});
  }
  at::Tensor r = at::empty({2}, on_device);  // filled by device ops: no host sync
  r.select(0, 0).fill_(static_cast<int64_t>(state.seed_.val));
  r.select(0, 1).fill_(static_cast<int64_t>(state.offset_.val / 4));
  return r;
#else
  (void)query;
  (void)len_kv;
  return draw_cpu_rng_state();
#endif
}

// The op draw_rng_state: what a forward with dropout and no rng_state draws.
inline at::Tensor draw_rng_state_device(const at::Tensor& like, int64_t len_kv) {
  TORCH_CHECK(len_kv >= 0, "len_kv must be >= 0, got ", len_kv);
#if defined(__CUDACC__)
  const c10::cuda::CUDAGuard guard(like.device());
#endif
  return draw_rng_state(like, len_kv);
}

// An rng_state on query's device is read by the kernels themselves (no host
// sync). In the emulation query's device is the CPU, so the tests take this
// path too.
inline void read_rng_on_device(DropoutParams& d, const at::Tensor& rng_state, const at::Tensor& query) {
  if (!d.enabled() || rng_state.device() != query.device()) return;
  d.seed_ptr = rng_state.const_data_ptr<int64_t>();
  d.offset_ptr = d.seed_ptr + 1;
  d.offset = 0;
  if (rng_state.numel() == 5) d.frame_ptr = d.seed_ptr + 2;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_fwd_device(
    const at::Tensor& query,  // (N..., Hq, L, E), any strides
    const at::Tensor& key,    // (N..., Hkv, S, E), any strides
    const at::Tensor& value,  // (N..., Hkv, S, Ev), any strides
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (N..., Hq, L, S)
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa,
    const std::optional<at::Tensor>& rng_state,  // int64 (seed, offset), CPU or query's device
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes) {  // (Hq) or (N..., Hq) slopes
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
#if defined(__CUDACC__)
  const c10::cuda::CUDAGuard guard(query.device());
#endif
  ForwardCall c = prepare_forward(query, key, value, attn_mask, dropout_p, va, scale, enable_gqa,
                                  rng_state, check_device_limits,
                                  [&] { return draw_rng_state(query, key.size(-2)); });
  if (!c.has_rows) return {c.out, c.lse, c.rng_state};
  check_gpu(query, c.s);
  if (c.s.len_kv == 0) {  // no keys: every row fully masked
    c.out.zero_();
    c.lse.fill_(-std::numeric_limits<double>::infinity());
    return {c.out, c.lse, c.rng_state};
  }
  read_rng_on_device(c.p.dropout, c.rng_state, query);
  const simt::Stream stream = current_stream(query);
  dispatch_device_type(query.scalar_type(), "attention", [&](auto elem) {
    using T = decltype(elem);
    launch_forward<T>(c.p, query, stream);
  });
  return {c.out, c.lse, c.rng_state};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_device(
    const at::Tensor& grad_out,   // (N..., Hq, L, Ev), any strides
    const at::Tensor& query,      // (N..., Hq, L, E)
    const at::Tensor& key,        // (N..., Hkv, S, E)
    const at::Tensor& value,      // (N..., Hkv, S, Ev)
    const at::Tensor& out,        // (N..., Hq, L, Ev), the forward's output
    const at::Tensor& logsumexp,  // (N..., Hq, L), float32 (float64 for float64)
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa,
    const at::Tensor& rng_state,  // int64 (seed, offset), CPU or query's device
    bool attn_mask_requires_grad, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const VariantArgs va{is_causal, window_left, window_right, bottom_right, softcap, alibi_slopes};
#if defined(__CUDACC__)
  const c10::cuda::CUDAGuard guard(query.device());
#endif
  BackwardCall c = prepare_backward(grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p, va,
                                    scale, enable_gqa, rng_state, attn_mask_requires_grad, check_device_limits);
  const AttentionShape& s = c.s;
  const bool want_mask_grad = c.want_mask_grad;
  const at::ScalarType acc = acc_type_of(query.scalar_type());
  const int64_t B = s.batch, Hq = s.heads_q, Hkv = s.heads_kv, G = Hq / std::max<int64_t>(Hkv, 1);
  const int64_t L = s.len_q, S = s.len_kv, E = s.head_dim, Ev = s.head_dim_v;
  const auto acc_opts = query.options().dtype(acc);
  at::Tensor grad_q = at::empty(with_batch(s, {Hq, L, E}), query.options());
  // every row is written by the key-block kernel when it runs
  at::Tensor dk_heads = at::empty({B, Hq, S, E}, acc_opts);
  at::Tensor dv_heads = at::empty({B, Hq, S, Ev}, acc_opts);
  at::Tensor dmask_full = want_mask_grad ? at::zeros({B, Hq, L, S}, acc_opts) : at::Tensor();

  if (!c.has_heads || L == 0 || S == 0) {
    grad_q.zero_();
    dk_heads.zero_();
    dv_heads.zero_();
  } else {
    AttentionBwdParams& p = c.p;
    check_gpu(query, s);
    const at::Tensor rng_c = rng_state.contiguous();
    read_rng_on_device(p.dropout, rng_c, query);
    at::Tensor row_stats = at::empty({3, B, Hq, L}, acc_opts);  // D, row_shift, row_log_norm
    // Atomic dQ accumulation unless deterministic algorithms are asked for;
    // then a second kernel recomputes dQ per query block.
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    at::Tensor dq_accum = deterministic ? at::Tensor() : at::zeros({B, Hq, L, E}, acc_opts);
    p.grad_q = grad_q.data_ptr();
    p.grad_k = dk_heads.data_ptr();
    p.grad_v = dv_heads.data_ptr();
    p.grad_mask = want_mask_grad ? dmask_full.data_ptr() : nullptr;
    p.row_dot = row_stats[0].data_ptr();
    p.row_shift = row_stats[1].data_ptr();
    p.row_log_norm = row_stats[2].data_ptr();
    p.grad_q_accum = deterministic ? nullptr : dq_accum.data_ptr();
    p.grad_q_stride = Strides4{Hq * L * E, L * E, E, 1};  // grad_q and dq_accum, contiguous
    p.grad_k_stride = strides_of(dk_heads);
    p.grad_v_stride = strides_of(dv_heads);
    const simt::Stream stream = current_stream(query);
    dispatch_device_type(query.scalar_type(), "attention_backward", [&](auto elem) {
      using T = decltype(elem);
      DeviceWorkspace workspace{query.options()};
      device::launch_attention_bwd<T>(p, stream, [](auto status) { check_launch(status); }, workspace);
    });
    if (!deterministic) grad_q.copy_(dq_accum.view(grad_q.sizes()));
  }

  // Sum each GQA group of query heads into its key/value head.
  at::Tensor grad_k = dk_heads.view({B, Hkv, G, S, E}).sum(2).to(query.scalar_type()).view(with_batch(s, {Hkv, S, E}));
  at::Tensor grad_v =
      dv_heads.view({B, Hkv, G, S, Ev}).sum(2).to(query.scalar_type()).view(with_batch(s, {Hkv, S, Ev}));
  at::Tensor grad_mask = at::empty({0}, query.options());
  if (want_mask_grad)
    grad_mask = at::sum_to(dmask_full.view(with_batch(s, {Hq, L, S})), attn_mask->sizes()).to(attn_mask->scalar_type());
  return {grad_q, grad_k, grad_v, grad_mask};
}

}  // namespace device_host
}  // namespace mha_ext
