"""The built library carries the CUDA backend where it can be built (a CUDA
build of torch and nvcc, as on this project's machines): CUDA kernels are
registered for both ops even without a GPU, and the library holds device code
(ELF) for every architecture of TORCH_CUDA_ARCH_LIST (default 8.0;9.0+PTX),
and PTX for those marked +PTX."""
import os
import re
import shutil
import struct

import pytest
import torch

import mha_ext

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def _cuda_buildable():
    if os.environ.get("USE_CUDA", "") == "0" or torch.version.cuda is None:
        return False
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


needs_cuda_build = pytest.mark.skipif(not _cuda_buildable(),
                                      reason="no CUDA backend to build here: torch is CPU-only, no nvcc, or USE_CUDA=0")


def fatbin_entries(data):
    """(kind, sm) of every entry of every fatbin in a binary. A fatbin is a
    16-byte header (magic, version u16, header size u16, size u64) and
    entries, each a header (kind u16, version u16, header size u32, payload
    size u64, ..., sm u32 at byte 28) and its payload."""
    entries, magic = [], struct.pack("<I", FATBIN_MAGIC)
    at = data.find(magic)
    while at != -1:
        _, header, size = struct.unpack_from("<HHQ", data, at + 4)
        off, end = at + header, at + header + size
        while off < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, off)
            (sm,) = struct.unpack_from("<I", data, off + 28)
            entries.append((kind, sm))
            off += entry_header + payload
        at = data.find(magic, max(end, at + 4))
    return entries


@needs_cuda_build
@pytest.mark.parametrize("op", ["mha_ext::attention", "mha_ext::attention_backward"])
def test_cuda_kernels_are_registered(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")


@needs_cuda_build
def test_library_holds_device_code_for_each_architecture():
    arch_list = [a for a in os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX").replace(" ", ";").split(";") if a]
    # "9.0a" (arch-specific features) is sm_90 device code too
    sm = lambda a: int(re.sub(r"[^0-9]", "", a.replace("+PTX", "")))  # noqa: E731
    wanted = {sm(a) for a in arch_list}
    wanted_ptx = {sm(a) for a in arch_list if a.endswith("+PTX")}
    with open(mha_ext.library_path, "rb") as f:
        entries = fatbin_entries(f.read())
    elf = {sm for kind, sm in entries if kind == KIND_ELF}
    ptx = {sm for kind, sm in entries if kind == KIND_PTX}
    assert wanted <= elf, f"device code for sm {sorted(elf)}, wanted {sorted(wanted)}"
    assert wanted_ptx <= ptx, f"PTX for sm {sorted(ptx)}, wanted {sorted(wanted_ptx)}"
