"""The CPU kernels give the tile unit's state back (tilerelease) at the end
of each parallel task that used it, as torch's own AMX kernels do
(cpublas::brgemm_release): no thread keeps 8 KiB of tile state, saved and
restored at each of its context switches, from one call to the next. A probe
built here reads the calling thread's XINUSE bits (XGETBV with ECX = 1: bit
17 the tile configuration, bit 18 the tile data); with one thread the kernels
run on the calling thread. Each case first puts tile state in use through
the probe (which the probe must then see: the check can fail), then runs an
op whose bfloat16 products take the tile unit, and expects the state back
in its initial form."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import mha_ext

PROBE = r"""
#include <cpuid.h>
#include <cstdint>
struct TileConfig { uint8_t palette = 1, start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
extern "C" int xinuse_readable() {  // CPUID.(EAX=0DH, ECX=1):EAX[2], XGETBV with ECX = 1
  unsigned a, b, c, d;
  return __get_cpuid_count(0xd, 1, &a, &b, &c, &d) && ((a >> 2) & 1);
}
extern "C" int tile_state_in_use() {  // XINUSE bits 17 (TILECFG) and 18 (TILEDATA)
  unsigned lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  return (lo >> 17) & 3;
}
extern "C" void hold_tiles() {  // a configuration and a zeroed tile: state in use until released
  TileConfig cfg;
  cfg.rows[0] = 16;
  cfg.colsb[0] = 64;
  asm volatile("ldtilecfg %0" : : "m"(cfg));
  asm volatile("tilezero %%tmm0" ::);
}
"""

SCRIPT = textwrap.dedent("""
    import ctypes, sys, torch, mha_ext
    torch.set_num_threads(1)
    assert mha_ext.ops.cpu_isa() == "amx"  # (this also asks the kernel for the tile state, once)
    probe = ctypes.CDLL(sys.argv[1])
    assert probe.xinuse_readable()
    bf = torch.bfloat16
    def decode():  # a GQA group of four query heads, one query row: the decode kernel's tile routines
        q, k, v = torch.randn(1, 4, 1, 128, dtype=bf), torch.randn(1, 1, 700, 128, dtype=bf), torch.randn(1, 1, 700, 128, dtype=bf)
        mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    def forward():  # the dense forward's tile products
        q, k, v = torch.randn(1, 2, 70, 64, dtype=bf), torch.randn(1, 2, 300, 64, dtype=bf), torch.randn(1, 2, 300, 64, dtype=bf)
        mha_ext.scaled_dot_product_attention(q, k, v)
    def backward():  # the backward's tile products (the forward before it releases too)
        q, k, v = (torch.randn(1, 2, n, 64, dtype=bf, requires_grad=True) for n in (70, 300, 300))
        out = mha_ext.scaled_dot_product_attention(q, k, v)
        probe.hold_tiles()
        out.sum().backward()
    for name, case in [("decode", decode), ("forward", forward), ("backward", backward)]:
        probe.hold_tiles()
        held = probe.tile_state_in_use()
        case()
        print(name, held, probe.tile_state_in_use())
""")


@pytest.mark.skipif(mha_ext.ops.cpu_isa() != "amx", reason="needs a CPU with AMX (the tile routines)")
def test_kernels_release_the_tile_state(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.fail("a C++ compiler is needed to build the probe")
    src, lib = tmp_path / "probe.cpp", tmp_path / "probe.so"
    src.write_text(PROBE)
    subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(lib)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = {line.split()[0]: tuple(int(x) for x in line.split()[1:]) for line in run.stdout.splitlines()}
    assert set(results) == {"decode", "forward", "backward"}, run.stdout
    for name, (held, after) in results.items():
        assert held == 3, f"{name}: the probe does not see the tile state it put in use ({held})"
        assert after == 0, f"{name}: the op left the tile state in use (XINUSE bits 17-18: {after})"
