"""Builds mha_ext._C: the C++ (and, where available, CUDA) sources under csrc/.

CUDA is built when a CUDA toolkit (nvcc) and a CUDA build of torch are both
present and csrc/cuda has sources; FORCE_CUDA=1 forces it, USE_CUDA=0 skips it.
TORCH_CUDA_ARCH_LIST is honoured (default "8.0;9.0"). MAX_JOBS caps the
parallel compile jobs. The decision is printed.
"""
import glob
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


cpp_sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
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
# The C++ runtime from the shared libstdc++ that torch itself uses, named before
# the driver's own -lstdc++: where a toolchain or LDFLAGS links it statically
# (-static-libstdc++), the library's private copy of the stream and locale code
# does not match the facets of the process's runtime, and integers formatted
# into an error message stop the message (g++ 12 here) or crash (seen on a GPU
# machine's image when a C++ input check threw).
# On one GPU image even that was not enough: its compiler's search path held
# only the static archive, and the library came out with no libstdc++.so.6
# needed at all. So the file itself is named where it can be found: the
# libstdc++.so.6 this process (and torch) runs on.


def _shared_libstdcxx():
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # address perms offset dev inode path (the path may hold spaces)
                fields = line.rstrip("\n").split(None, 5)
                path = fields[5] if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


_stdcxx = _shared_libstdcxx()
link_flags = ["-fopenmp", "-Wl,--push-state,-Bdynamic,--no-as-needed",
              _stdcxx if _stdcxx else "-lstdc++", "-Wl,--pop-state"]
print(f"mha_ext: C++ runtime {_stdcxx or '-lstdc++'}", flush=True)
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
