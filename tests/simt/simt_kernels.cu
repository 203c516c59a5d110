// Compiled by tests/test_simt_nvcc.py with nvcc: the kernels of
// simt_test_kernels.h, emulated in test_simt_emul.cpp, are CUDA as written.
#include "simt_test_kernels.h"
