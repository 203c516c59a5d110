// CUDA backend of mha_ext: registers the host functions of attention_host.h
// (check, allocate, fill params, launch on the current stream) for CUDA
// tensors. The device code is attention_kernels.h; this is its only
// translation unit, so every kernel instantiation (launch.h counts them) is
// compiled once per architecture.
#include "attention_host.h"
#include "kvcache_attention_host.h"
#include "varlen_attention_host.h"

#include <torch/library.h>

namespace mha_ext {

TORCH_LIBRARY_IMPL(mha_ext, CUDA, m) {
  m.impl("attention", &device_host::attention_fwd_device);
  m.impl("attention_backward", &device_host::attention_bwd_device);
  m.impl("varlen_attention", &device_host::varlen_attention_fwd_device);
  m.impl("varlen_attention_backward", &device_host::varlen_attention_bwd_device);
  m.impl("kvcache_attention", &device_host::kvcache_attention_device);
  m.impl("draw_rng_state", &device_host::draw_rng_state_device);
}

}  // namespace mha_ext
