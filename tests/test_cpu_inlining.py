"""The small helpers that the CPU decode routines call at every key or block
(sum16, the fetch schedules' operator()) stay inlined in the built libraries.
The x86-64 ABI keeps no vector register across a call, so one such helper
left out of line puts a routine's accumulators on the stack. g++ 12 left
sum16 out of line in both builds (the Python extension and the LibTorch
library), and a store followed every multiply-add of the AVX-512 scores (the
same routine built both ways and timed in one process: whole decode steps
1.03-1.22x faster inlined); whether g++ inlines it depends on unrelated
code (marking the fetch operators always_inline alone inlined it in one build).
The same holds for the block bodies that the score and value routines take
with constant head dims (score_block_e, value_block_e) and for the lambdas
that pass the constants. They are marked always_inline; this reads the libraries' symbol tables,
where an out-of-line copy would show. Also: the AMX routines load tiles and
their configuration through forms that declare the memory they read."""
import pathlib
import platform
import re
import shutil
import subprocess

import pytest

import mha_ext

HELPERS = {
    "sum16": re.compile(r"::sum16\("),
    "PageFetch::operator()": re.compile(r"PageFetch::operator\(\)"),
    "RowFetch<...>::operator()": re.compile(r"RowFetch<[^>]*>::operator\(\)"),
    "SpreadFetch::operator()": re.compile(r"SpreadFetch::operator\(\)"),  # the AMX decode routines' fetch
    # the block bodies that score_block / value_block take with constant head
    # dims and fetches, and the lambdas that pass them the constants
    "score_block_e / value_block_e": re.compile(r"::(score|value)_block_e<"),
    "with_fixed_page": re.compile(r"::with_fixed_page<"),
    "a lambda of score_block / value_block": re.compile(r"::(score|value)_block<.*::\{lambda"),
}


def defined_symbols(path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is needed to read the library's symbols")
    out = subprocess.run([nm, "-C", "--defined-only", path], check=True, capture_output=True, text=True).stdout
    return [line.split(" ", 2)[-1] for line in out.splitlines() if line.strip()]


def out_of_line(symbols):
    found = {name: [s for s in symbols if pat.search(s)] for name, pat in HELPERS.items()}
    return {name: syms for name, syms in found.items() if syms}


def test_the_check_finds_an_out_of_line_helper():
    syms = ["void mha_ext::cpu::(anonymous namespace)::score_block<3, 1, false>(...)",
            "mha_ext::cpu::(anonymous namespace)::sum16(float __vector(16) const*)",
            "mha_ext::cpu::rows::RowFetch<3>::operator()()",
            "mha_ext::cpu::(anonymous namespace)::SpreadFetch::operator()()",
            "void mha_ext::cpu::(anonymous namespace)::value_block_e<1, 1, 2, false>(...)",
            "mha_ext::cpu::(anonymous namespace)::score_block<3, 1, false>(...)::{lambda(auto:1)#1}::operator()(...)"]
    assert set(out_of_line(syms)) == {"sum16", "RowFetch<...>::operator()", "SpreadFetch::operator()",
                                      "score_block_e / value_block_e",
                                      "a lambda of score_block / value_block"}


# the Python extension, and the LibTorch library where scripts/setup.sh --cpp built it
CMAKE_LIBRARY = pathlib.Path(__file__).resolve().parent.parent / "build" / "cmake" / "libmha_ext.so"
LIBRARIES = [mha_ext.library_path] + ([str(CMAKE_LIBRARY)] if CMAKE_LIBRARY.exists() else [])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the vector row routines are x86-64 only")
@pytest.mark.parametrize("path", LIBRARIES)
def test_decode_helpers_are_inlined(path):
    syms = defined_symbols(path)
    # the routines that call them are in the table (not a stripped library)
    assert any("score_block<" in s for s in syms), f"no score_block symbol in {path}: is it stripped?"
    assert out_of_line(syms) == {}


# GCC's AMX intrinsics declare less memory than the instructions touch
# (_tile_loadconfig: 8 of the configuration's 64 bytes, so the stores of its
# shapes may be dropped; _tile_loadd: none, so stores to the rows it reads may
# move past it). csrc/cpu/amx_cpu.cpp has its own forms that declare them.
UNDERDECLARED = re.compile(r"\b_tile_(loadconfig|loadd|stream_loadd)\s*\(")


def code_lines(text):
    """The lines of a C++ source without its // comments."""
    return [line.split("//", 1)[0] for line in text.splitlines()]


def test_the_check_finds_an_underdeclared_tile_intrinsic():
    src = "  _tile_loadconfig(&cfg);  // shapes\n  // _tile_loadd(2, a, 64) in a comment\n  _tile_loadd(4, q, 64);\n"
    assert [m.group(1) for line in code_lines(src) for m in UNDERDECLARED.finditer(line)] == ["loadconfig", "loadd"]


def test_amx_routines_declare_the_memory_their_tile_instructions_touch():
    path = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "cpu" / "amx_cpu.cpp"
    bad = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(code_lines(path.read_text()), 1)
           if UNDERDECLARED.search(line)]
    assert bad == [], "tile loads / configuration through GCC's intrinsics, not MHA_TILE_LOAD / load_config:\n" + "\n".join(bad)
