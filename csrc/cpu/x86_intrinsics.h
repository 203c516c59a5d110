// The x86 intrinsics of the SIMD translation units (gemm_cpu.cpp,
// rows_cpu.cpp): MHA_X86 says whether they are there (x86-64 with GCC or
// Clang); elsewhere only the portable paths are built.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define MHA_X86 1
// GCC 12's intrinsic headers build _mm*_undefined_* values by self-assignment,
// which -Wall reports as uninitialised wherever they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define MHA_X86 0
#endif
