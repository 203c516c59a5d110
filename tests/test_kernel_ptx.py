"""The PTX nvcc emits for sm_80 keeps the FlashAttention-2-class design of the
CUDA kernels: in the main loop of the forward, the key-block backward and the
deterministic dQ kernel (16-bit types, and float32, where the tensor cores run),
tiles arrive by 16-byte cp.async copies, tensor-core operands come by ldmatrix, and,
apart from the plain-load path MHA_EXT_CUDA_OPERANDS=scalar selects, no operand
is read from shared memory two bytes at a time. The design's
regressions fail here, on a machine without a GPU (scripts/kernel_report.py
prints the same counts, with registers and occupancy)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
import kernel_report as K  # noqa: E402


def _loops(tmp_path_factory, scalar_operands):
    if K.nvcc() is None:
        pytest.skip("needs nvcc (a CUDA toolkit) to compile device code")
    ptx = K.compile_ptx(str(tmp_path_factory.mktemp("ptx") / "kernels.ptx"), scalar_operands=scalar_operands)
    return {K.describe(name): K.loop_counts(K.main_loop(lines)) for name, lines in K.kernels(ptx).items()}


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """The kernels with the plain-load operand path that
    MHA_EXT_CUDA_OPERANDS=scalar selects built in (MHA_EXT_SCALAR_OPERANDS=1)."""
    return _loops(tmp_path_factory, True)


@pytest.fixture(scope="module")
def default_loops(tmp_path_factory):
    """The kernels as a default build has them (no plain-load path)."""
    return _loops(tmp_path_factory, False)


CONFIGS = [(kind, dtype, d) for kind in ("fwd", "bwd", "dq") for dtype, d in (("f16", 64), ("bf16", 128), ("float", 64))]
CONFIGS += [("fwd-plain", "f16", 64), ("fwd-plain", "bf16", 128)]  # the plain forward kernel, 32 rows a warp
CONFIGS += [("decode", "f16", 64), ("decode", "bf16", 128)]  # the decode kernel, warps sharing key tiles


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(map(str, c)) for c in CONFIGS])
def test_main_loop_keeps_async_copies_and_ldmatrix(loops, default_loops, config):
    for c in (loops[config], default_loops[config]):
        assert c["mma"] > 0, "no loop with tensor-core mma found"
        if config[1] == "float":  # TF32 / 3xTF32 on the tensor cores
            assert c["mma_tf32"] > 0, f"{config}: no TF32 mma in the main loop: {c}"
        assert c["cp_async_16"] > 0, f"{config}: no 16-byte cp.async in the main loop: {c}"
        assert c["ldmatrix"] > 0, f"{config}: no ldmatrix in the main loop: {c}"
    c = default_loops[config]
    assert c["shared_loads"].get(2, 0) == 0, f"{config}: 2-byte shared loads of operands in the main loop: {c}"
    assert c["generic_atomics"] == 0, f"{config}: atomics on a generic address in the main loop: {c}"
    if config[0] == "bwd":  # dQ accumulates into global memory by red.global.add
        assert c["red_global"] > 0, f"{config}: no red.global in the key-block backward's main loop: {c}"


def test_counts_read_a_known_loop():
    # the parser itself, on a hand-written loop: a backward branch around two
    # mma, an ldmatrix, a 16-byte cp.async, a 2-byte and a 16-byte load, a
    # generic and a global atomic and a global reduction
    ptx = """.visible .entry _ZN7mha_ext6device20attention_fwd_kernelI6__halfLi64EEEvNS_18AttentionFwdParamsE(
)
{
mov.u32 %r1, 0;
$L__BB0_1:
ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
cp.async.cg.shared.global [%r6], [%rd1], 16;
ld.shared.u16 %rs1, [%r7];
@%p1 ld.global.v4.u32 {%r8, %r9, %r10, %r11}, [%rd2];
atom.add.f32 %f5, [%rd3], %f6;
atom.global.add.f32 %f5, [%rd3], %f6;
@%p3 red.global.add.f32 [%rd4], %f7;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r1, %r2}, {%f1, %f2, %f3, %f4};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r1, %r2}, {%f1, %f2, %f3, %f4};
@%p2 bra $L__BB0_1;
ret;
}
"""
    (name, lines), = K.kernels(ptx).items()
    assert K.describe(name) == ("fwd", "f16", 64)
    c = K.loop_counts(K.main_loop(lines))
    assert c == dict(instructions=10, mma=2, mma_tf32=0, ldmatrix=1, cp_async_16=1, global_loads={16: 1}, shared_loads={2: 1},
                     generic_atomics=1, red_global=1)
