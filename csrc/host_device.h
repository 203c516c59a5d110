// MHA_HOST_DEVICE marks code that host functions and CUDA kernels both call
// (the params structs, the dropout stream).
#pragma once

#if defined(__CUDACC__)
#define MHA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MHA_HOST_DEVICE inline
#endif
