"""The kernels that tests/simt/test_simt_emul.cpp runs under the CPU emulation
compile as CUDA, for sm_80 and sm_90, from the same source (csrc/cuda/simt.h
maps the primitives to the CUDA built-ins under nvcc)."""
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (a CUDA toolkit) to compile device code")
def test_simt_kernels_compile_for_sm80_and_sm90(tmp_path):
    out = tmp_path / "simt_kernels.o"
    cmd = [_nvcc(), "-std=c++20", "-c", os.path.join(HERE, "simt", "simt_kernels.cu"), "-o", str(out),
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = out.read_bytes()
    # The fatbin names each architecture's ELF: both must be inside.
    assert b"sm_80" in data and b"sm_90" in data


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (a CUDA toolkit) to compile device code")
def test_simt_primitives_are_the_ptx_instructions(tmp_path):
    # the emulated primitives stand for these instructions under nvcc
    ptx = tmp_path / "simt_kernels.ptx"
    cmd = [_nvcc(), "-std=c++20", "-ptx", os.path.join(HERE, "simt", "simt_kernels.cu"), "-o", str(ptx),
           "-arch=sm_80"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = ptx.read_text()
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "mma.sync.aligned.m16n8k16.row.col.f32.bf16",
                  "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                  "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0",
                  "cp.async.wait_group 1", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32",
                  "red.global.add.f32", "red.global.add.f64"):
        assert instr in text, instr
