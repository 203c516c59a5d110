"""Builds mha_ext._C: the C++ (and, where available, CUDA) sources under csrc/.

CUDA is built when a CUDA toolkit (nvcc) and a CUDA build of torch are both
present and csrc/cuda has sources; FORCE_CUDA=1 forces it, USE_CUDA=0 skips it.
TORCH_CUDA_ARCH_LIST is honoured (default "8.0;9.0"). MAX_JOBS caps the
parallel compile jobs. The decision is printed.
"""
import glob
import importlib.util
import os
import shutil

ROOT = os.path.dirname(os.path.abspath(__file__))

# torch finds the toolkit from CUDA_HOME, else from `which nvcc`; where nvcc is
# a wrapper in /usr/local/bin that would name /usr/local, point at the
# toolkit itself.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _decide_cuda(cuda_sources):
    if os.environ.get("USE_CUDA", "") == "0":
        return False, "USE_CUDA=0"
    if os.environ.get("FORCE_CUDA", "") == "1":
        return True, "FORCE_CUDA=1"
    if not cuda_sources:
        return False, "no CUDA sources under csrc/cuda"
    if torch.version.cuda is None:
        return False, "torch is a CPU-only build"
    if CUDA_HOME is None or shutil.which("nvcc") is None and not os.path.exists(
        os.path.join(CUDA_HOME or "", "bin", "nvcc")
    ):
        return False, "no CUDA toolkit (nvcc) found"
    return True, f"nvcc at {CUDA_HOME}, torch CUDA {torch.version.cuda}"


# csrc/python: the Python module of the library (mha_ext._C's fast calls);
# CMakeLists.txt builds the rest for LibTorch, without Python.
cpp_sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp") + _sources("csrc/python/*.cpp")
cuda_sources = _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu")
with_cuda, why = _decide_cuda(cuda_sources)
print(f"mha_ext: building {'CPU + CUDA' if with_cuda else 'CPU only'} ({why})", flush=True)

# -fopenmp: at::parallel_for is inline and only parallel when compiled with
# OpenMP (torch's own libgomp.so.1, already loaded by torch, serves it).
# One C++ standard for every translation unit, named here rather than left to
# torch: torch 2.14 adds -std=c++20 to g++, older ones -std=c++17, while nvcc
# gets -std=c++20 below. Headers compiled under two standards into one library
# may disagree on inline code and layouts (a build against torch 2.11 crashed
# where a C++ check threw).
cxx_flags = ["-O3", "-fopenmp", "-fvisibility=hidden", "-Wall", "-std=c++20"]
# The C++ runtime: the shared libstdc++ that torch itself uses, by its path
# (mha_ext/_cxx_runtime.py says why; read by path, as the package cannot be
# imported before its library is built).
_spec = importlib.util.spec_from_file_location(
    "mha_ext_cxx_runtime", os.path.join(ROOT, "mha_ext", "_cxx_runtime.py"))
_cxx_runtime = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cxx_runtime)
link_flags = ["-fopenmp"] + _cxx_runtime.link_flags()
print(f"mha_ext: C++ runtime {_cxx_runtime.shared_libstdcxx() or '-lstdc++'}", flush=True)
if with_cuda:
    # SASS for sm_80 and sm_90, and sm_90 PTX that newer GPUs can compile
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    print(f"mha_ext: TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}", flush=True)
    # One .cu holds every kernel instantiation (csrc/cuda/launch.h counts
    # them); --threads compiles its architectures in parallel.
    nvcc_flags = ["-O3", "-std=c++20", "--threads", os.environ.get("MAX_JOBS", "2")]
    if os.environ.get("MHA_EXT_SCALAR_OPERANDS", "") == "1":  # MHA_EXT_CUDA_OPERANDS=scalar at run time
        nvcc_flags.append("-DMHA_SCALAR_OPERANDS")
    if os.environ.get("MHA_EXT_PTXAS_VERBOSE", "") == "1":  # registers, shared memory and spills per kernel
        nvcc_flags.append("-Xptxas=-v")
    ext = CUDAExtension(
        "mha_ext._C",
        cpp_sources + cuda_sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension("mha_ext._C", cpp_sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)

# name, version, dependencies, extras and packages: pyproject.toml
setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
