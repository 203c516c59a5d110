// One variant of the plain CUDA forward kernel (attention_fwd_kernel<T, D,
// true>), for bench/cuda_ab.py: compiled once per source tree with
// -I<tree>/csrc/cuda, its namespace renamed (-Dmha_ext=mha_ext_abN) and its
// entry named (-DAB_ENTRY=ab_fwd_N), so that several versions of the kernel
// link into one library and run side by side in one process, without the
// torch extension's build. Contiguous (B, H, L, D) inputs, Hq = Hkv, E = Ev
// = D (64 or 128), the default scale, causal top-left or none; the launch as
// launch.h makes it for such calls (128-row blocks of 128 threads past 64
// query rows, no key splits). Built with nvcc for a GPU, or with g++ and
// -DMHA_SIMT_EMULATION for a check of the harness on the CPU.
#include "attention_kernels.h"

#include <cmath>
#include <cstdint>

namespace {

using namespace mha_ext;
using namespace mha_ext::device;
using namespace mha_ext::simt;

template <typename T, int kHeadDim>
int run(int64_t B, int64_t H, int64_t L, int64_t S, int causal, const void* q, const void* k, const void* v,
        void* out, void* lse, int reps) {
  using C = TileConfig<T, kHeadDim>;
  AttentionFwdParams p;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  p.q_stride = Strides4{H * L * kHeadDim, L * kHeadDim, kHeadDim, 1};
  p.k_stride = p.v_stride = Strides4{H * S * kHeadDim, S * kHeadDim, kHeadDim, 1};
  p.out_stride = p.q_stride;
  p.batch = B, p.heads_q = H, p.heads_kv = H, p.len_q = L, p.len_kv = S;
  p.head_dim = p.head_dim_v = kHeadDim;
  p.scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
  if (causal) p.variant.right = 0;  // top-left, as SDPA's is_causal
  p.lse_stride_b = H * L, p.lse_stride_h = L;
  const int slices = L > 64 ? C::kFwdWideWarps : C::kFwdWarps;  // 16-row slices a block
  const SharedMemory smem{static_cast<size_t>(C::fwd_shared_bytes(slices)),
                          static_cast<size_t>(C::fwd_shared_bytes(C::kFwdWideWarps))};
  const dim3 grid(static_cast<unsigned>((L + 16 * slices - 1) / (16 * slices)), static_cast<unsigned>(B * H), 1);
  for (int r = 0; r < reps; ++r) {
    const auto err = launch_kernel(attention_fwd_kernel<T, kHeadDim, true>, grid, dim3(32 * slices / C::kFwdRowTiles),
                                   smem, Stream{}, p);
    if (err) return static_cast<int>(err);
  }
  return 0;
}

}  // namespace

// dtype 0: float16, 1: bfloat16; D 64 or 128. Returns the first launch error (0: none).
extern "C" int AB_ENTRY(int dtype, int64_t B, int64_t H, int64_t L, int64_t S, int64_t D, int causal, const void* q,
                        const void* k, const void* v, void* out, void* lse, int reps) {
  if (dtype == 0) return D == 64 ? run<f16, 64>(B, H, L, S, causal, q, k, v, out, lse, reps)
                                 : run<f16, 128>(B, H, L, S, causal, q, k, v, out, lse, reps);
  return D == 64 ? run<bf16, 64>(B, H, L, S, causal, q, k, v, out, lse, reps)
                 : run<bf16, 128>(B, H, L, S, causal, q, k, v, out, lse, reps);
}
