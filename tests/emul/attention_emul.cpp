// Test library: the CUDA backend's host functions and kernels, compiled for
// the CPU emulation of the CUDA primitives (csrc/cuda/simt_emul.h) and
// registered as torch.ops.mha_ext_emul.attention / attention_backward (and the varlen and KV-cache ops) on CPU
// tensors, with the schemas of the real ops. tests/cuda_backends.py builds it
// and holds its results to the CPU backend.
#define MHA_SIMT_EMULATION 1
#define MHA_SCALAR_OPERANDS 1  // test_emul_scalar_operands_give_the_ldmatrix_results compares both paths
#include "../../csrc/cuda/attention_host.h"
#include "../../csrc/cuda/kvcache_attention_host.h"
#include "../../csrc/cuda/varlen_attention_host.h"
#include "../../csrc/schema.h"

#include <torch/library.h>

TORCH_LIBRARY(mha_ext_emul, m) {
  m.def(mha_ext::kAttentionSchema);
  m.def(mha_ext::kAttentionBackwardSchema);
  m.def(mha_ext::kVarlenAttentionSchema);
  m.def(mha_ext::kVarlenAttentionBackwardSchema);
  m.def(mha_ext::kKVCacheAttentionSchema);
  m.def(mha_ext::kDrawRngStateSchema);
  m.def("launched_grids() -> int[]");  // (x, y, z) of each launch since the last call
  m.def("launched_threads() -> int[]");  // the threads per block of each launch since the last call
  m.def("launched_shared() -> int[]");  // the dynamic shared bytes of each launch since the last call
}

// The grids the emulated kernels were launched with since the last call, flat.
std::vector<int64_t> launched_grids() {
  std::vector<int64_t> flat;
  for (const auto& g : mha_ext::simt::launched_grids()) flat.insert(flat.end(), g.begin(), g.end());
  mha_ext::simt::launched_grids().clear();
  return flat;
}

TORCH_LIBRARY_IMPL(mha_ext_emul, CPU, m) {
  m.impl("attention", &mha_ext::device_host::attention_fwd_device);
  m.impl("attention_backward", &mha_ext::device_host::attention_bwd_device);
  m.impl("varlen_attention", &mha_ext::device_host::varlen_attention_fwd_device);
  m.impl("varlen_attention_backward", &mha_ext::device_host::varlen_attention_bwd_device);
  m.impl("kvcache_attention", &mha_ext::device_host::kvcache_attention_device);
  m.impl("draw_rng_state", &mha_ext::device_host::draw_rng_state_device);
}

// The threads per block of the launches since the last call.
std::vector<int64_t> launched_threads() {
  std::vector<int64_t> out(mha_ext::simt::launched_threads().begin(), mha_ext::simt::launched_threads().end());
  mha_ext::simt::launched_threads().clear();
  return out;
}

// The dynamic shared bytes of the launches since the last call.
std::vector<int64_t> launched_shared() {
  std::vector<int64_t> out(mha_ext::simt::launched_shared().begin(), mha_ext::simt::launched_shared().end());
  mha_ext::simt::launched_shared().clear();
  return out;
}

TORCH_LIBRARY_IMPL(mha_ext_emul, CatchAll, m) {
  m.impl("launched_grids", &launched_grids);
  m.impl("launched_threads", &launched_threads);
  m.impl("launched_shared", &launched_shared);
}
