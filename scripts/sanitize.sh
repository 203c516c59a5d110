#!/usr/bin/env bash
# The LibTorch library and the C++ tests (the dispatcher tests and the SIMT
# emulation tests) built with AddressSanitizer and UndefinedBehaviorSanitizer
# into build/sanitize, then ctest. Any report fails the run (halt_on_error).
# Needs what scripts/test.sh sets up (.venv with torch, GoogleTest, cmake).
set -euo pipefail
cd "$(dirname "$0")/.."
# minutes since this script began, on the stage lines
at() { printf '(at %d:%02d)' $((SECONDS / 60)) $((SECONDS % 60)); }
prefix=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')
echo "==> configuring build/sanitize (-fsanitize=address,undefined)"
# Debug information as line tables only (-g1): the reports still name each
# frame's file and line; a translation unit compiled in 0.7 of its time
# with -g, and the whole script took 6.2 minutes against 7.2 in the CI
# run before (2 cores, separate runs).
cuda_root=${CUDA_HOME:-/usr/local/cuda}
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0} cmake -S . -B build/sanitize -DCMAKE_PREFIX_PATH="$prefix" \
  -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" -DCUDAToolkit_ROOT="$cuda_root" -DMHA_EXT_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  >build/sanitize-configure.log 2>&1 || {
  cat build/sanitize-configure.log >&2; exit 1; }
echo "==> building $(at)"
cmake --build build/sanitize -j "${MAX_JOBS:-2}" >build/sanitize-build.log 2>&1 || {
  tail -50 build/sanitize-build.log >&2; exit 1; }
echo "==> ctest under ASan + UBSan $(at)"
# Leak checking covers our code; torch's own one-time allocations at exit are
# suppressed by library name (tests/sanitize/lsan.supp).
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitize/lsan.supp:print_suppressions=0"
ctest --test-dir build/sanitize --output-on-failure
