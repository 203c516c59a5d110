// The only hardware the CUDA device code of mha_ext may touch, as a handful
// of primitives. Under nvcc they are the CUDA built-ins; in a host build with
// MHA_SIMT_EMULATION they come from simt_emul.h, a CPU emulation that runs the
// threads of a block as fibers with real barriers, so device code can be
// tested on a machine without a GPU (see ../../README.md, "CUDA").
//
//   thread_idx(), block_idx(), block_dim(), grid_dim()   like threadIdx & co.
//   sync_threads()                                        __syncthreads()
//   sync_warp()                                           __syncwarp()
//   shfl(v, src_lane), shfl_xor(v, mask), shfl_down(v, d) full-warp shuffles
//   vote_ballot(p), vote_any(p), vote_all(p)              full-warp votes
//   atomic_add_global(ptr, v)         atomicAdd into global memory, no result:
//                                     red.global.add (a generic atomicAdd
//                                     compiles on sm_90 to an ATOM whose result
//                                     a branch waits for, about 17 instructions
//                                     executed, with shared-memory fallbacks)
//   dynamic_shared<T>()                                   extern __shared__ T[]
//   cp_async_16(smem, gmem)           cp.async.cg.shared.global, 16 bytes (both
//                                     addresses 16-byte aligned); the data is
//                                     not there before the wait of its group
//   cp_async_commit()                 cp.async.commit_group: the copies issued
//                                     since the last commit become a group
//   cp_async_wait<N>()                cp.async.wait_group N: every group but the
//                                     N newest has landed (for this thread;
//                                     other threads see it after a barrier)
//   launch_kernel(kernel, grid, block, shared_bytes, stream, args...)
//                                 kernel<<<grid, block, shared_bytes, stream>>>(args...)
//                                 (host side; raises the dynamic shared memory
//                                 limit first when shared_bytes > 48 KiB)
//   max_shared_per_block()        the current GPU's opt-in shared memory per
//                                 block in bytes (host side; the emulation
//                                 answers an H100's 227 KiB)
//   multiprocessor_count()        the current GPU's streaming multiprocessors
//                                 (host side; the emulation answers an H100
//                                 SXM's 132)
#pragma once

#include <cstddef>
#include <cstdint>

namespace mha_ext::simt {
// The dynamic shared memory of a launch (launch_kernel) and the limit set on
// the kernel before it.
struct SharedMemory {
  size_t bytes, limit;
};
}  // namespace mha_ext::simt

#if defined(__CUDACC__)

#define MHA_DEVICE __device__ __forceinline__
#define MHA_KERNEL __global__ void
// at most `threads` a block, registers for `blocks` of them a multiprocessor
#define MHA_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#define MHA_UNROLL _Pragma("unroll")
#define MHA_NO_UNROLL _Pragma("unroll 1")

namespace mha_ext::simt {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

MHA_DEVICE dim3 thread_idx() { return threadIdx; }
MHA_DEVICE dim3 block_idx() { return blockIdx; }
MHA_DEVICE dim3 block_dim() { return blockDim; }
MHA_DEVICE dim3 grid_dim() { return gridDim; }
MHA_DEVICE void sync_threads() { __syncthreads(); }
MHA_DEVICE void sync_warp() { __syncwarp(); }
template <typename T>
MHA_DEVICE T shfl(T v, int src_lane) { return __shfl_sync(kFullMask, v, src_lane); }
template <typename T>
MHA_DEVICE T shfl_xor(T v, int lane_mask) { return __shfl_xor_sync(kFullMask, v, lane_mask); }
template <typename T>
MHA_DEVICE T shfl_down(T v, unsigned delta) { return __shfl_down_sync(kFullMask, v, delta); }
MHA_DEVICE unsigned vote_ballot(bool p) { return __ballot_sync(kFullMask, p); }
MHA_DEVICE bool vote_any(bool p) { return __any_sync(kFullMask, p); }
MHA_DEVICE bool vote_all(bool p) { return __all_sync(kFullMask, p); }
// float or double; p must point to global memory
template <typename T>
MHA_DEVICE void atomic_add_global(T* p, T v) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomic_add_global: float or double");
#if defined(__CUDA_ARCH__)
  const size_t g = __cvta_generic_to_global(p);
  if constexpr (sizeof(T) == 4) {
    asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(g), "f"(v) : "memory");
  } else {
    asm volatile("red.global.add.f64 [%0], %1;\n" ::"l"(g), "d"(v) : "memory");
  }
#else
  atomicAdd(p, v);
#endif
}
template <typename T>
MHA_DEVICE T* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char mha_simt_shared[];
  return reinterpret_cast<T*>(mha_simt_shared);
}

MHA_DEVICE uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

MHA_DEVICE void cp_async_16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(smem)), "l"(gmem));
#elif defined(__CUDA_ARCH__)
#error "cp.async needs sm_80 or newer"
#endif
}
MHA_DEVICE void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
MHA_DEVICE void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

using Stream = cudaStream_t;

inline int max_shared_per_block() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 48 * 1024;  // what every GPU allows; the launch reports the error
  return bytes;
}

inline int shared_per_multiprocessor() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess)
    return 64 * 1024;  // the launch reports the error
  return bytes;
}

inline int multiprocessor_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 1;  // no split of the keys then; the launch reports the error
  return count;
}

// Returns the first CUDA error of the attribute call or the launch. The
// kernel's dynamic shared-memory limit is set to shared.limit (at least
// shared.bytes): a kernel launched with several sizes passes the largest as
// its limit every time, so that threads launching it at once, or a graph
// captured with the larger size, never find the limit lowered by another
// launch.
template <typename... KArgs, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, SharedMemory shared,
                                 Stream stream, Args&&... args) {
  if (shared.limit > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared.limit));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, block, shared.bytes, stream>>>(static_cast<Args&&>(args)...);
  return cudaGetLastError();
}
template <typename... KArgs, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                                 Stream stream, Args&&... args) {
  return launch_kernel(kernel, grid, block, SharedMemory{shared_bytes, shared_bytes}, stream,
                       static_cast<Args&&>(args)...);
}

}  // namespace mha_ext::simt

#elif defined(MHA_SIMT_EMULATION)

#include "simt_emul.h"

#else
#error "csrc/cuda/simt.h: compile with nvcc, or define MHA_SIMT_EMULATION for the CPU emulation"
#endif
