// Compiled by scripts/kernel_report.py and tests/test_kernel_ptx.py with nvcc
// alone (no torch): the device code of csrc/cuda/attention_kernels.h,
// instantiated as launch.h instantiates it, so its PTX and ptxas figures can
// be read without building the extension.
#include "../../csrc/cuda/attention_kernels.h"

namespace mha_ext::device {

#define MHA_PTX_INSTANTIATE(T, D)                                                    \
  template __global__ void attention_fwd_kernel<T, D, false>(const AttentionFwdParams); \
  template __global__ void attention_bwd_kernel<T, D>(const AttentionBwdParams); \
  template __global__ void attention_bwd_dq_kernel<T, D>(const AttentionBwdParams);

// the plain forward and decode kernels (launch.h's fwd_plain, fwd_decode): 16-bit types up to head dim
// 128 (the decode kernel at 256 too, below)
#define MHA_PTX_INSTANTIATE_PLAIN(T, D) template __global__ void attention_fwd_kernel<T, D, true>(const AttentionFwdParams); \
  template __global__ void attention_decode_kernel<T, D>(const AttentionFwdParams);

#if defined(MHA_PTX_ALL)
MHA_PTX_INSTANTIATE_PLAIN(f16, 64)
MHA_PTX_INSTANTIATE_PLAIN(f16, 128)
MHA_PTX_INSTANTIATE_PLAIN(bf16, 64)
MHA_PTX_INSTANTIATE_PLAIN(bf16, 128)
template __global__ void attention_decode_kernel<f16, 256>(const AttentionFwdParams);
template __global__ void attention_decode_kernel<bf16, 256>(const AttentionFwdParams);
MHA_PTX_INSTANTIATE(f16, 64)
MHA_PTX_INSTANTIATE(f16, 128)
MHA_PTX_INSTANTIATE(f16, 256)
MHA_PTX_INSTANTIATE(bf16, 64)
MHA_PTX_INSTANTIATE(bf16, 128)
MHA_PTX_INSTANTIATE(bf16, 256)
MHA_PTX_INSTANTIATE(float, 64)
MHA_PTX_INSTANTIATE(float, 128)
MHA_PTX_INSTANTIATE(float, 256)
MHA_PTX_INSTANTIATE(double, 64)
MHA_PTX_INSTANTIATE(double, 128)
MHA_PTX_INSTANTIATE(double, 256)
#else  // the configurations the PTX test reads
MHA_PTX_INSTANTIATE_PLAIN(f16, 64)
MHA_PTX_INSTANTIATE_PLAIN(bf16, 128)
MHA_PTX_INSTANTIATE(f16, 64)
MHA_PTX_INSTANTIATE(bf16, 128)
MHA_PTX_INSTANTIATE(float, 64)
#endif

}  // namespace mha_ext::device
