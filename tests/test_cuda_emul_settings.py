"""The CUDA backend's run-time kernel settings, each choice held to the
others and to the CPU backend, on the emulation and (where a GPU is present)
the real kernels: MHA_EXT_CUDA_OPERANDS (tensor-core fragments by ldmatrix or
by plain loads), MHA_EXT_CUDA_FLOAT32 (float32 on CUDA cores, or in TF32 or
3xTF32 on tensor cores, following torch's TF32 setting), MHA_EXT_CUDA_FWD_ROWS
(64 or 128 query rows a forward block) and MHA_EXT_CUDA_FWD_WARP_ROWS (16 or
32 rows a warp: the general or the plain forward kernel). The choices stay
selectable and tested so that a GPU session can run each and tell which is
right where they differ; a bad value of each is a clear error."""
import pytest
import torch

import mha_ext  # noqa: F401  (registers torch.ops.mha_ext)
import reference as R
from cuda_backends import (OnCuda, _err, assert_all_like_cpu, assert_near_reference, backend,  # noqa: F401
                           forward_block, make, references, run_backward)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4, 2, 50, 70, 64, 48), (1, 2, 1, 33, 80, 128, 128), (1, 1, 1, 20, 35, 256, 160)])
def test_emul_scalar_operands_give_the_ldmatrix_results(backend, dtype, shape, monkeypatch):
    # MHA_EXT_CUDA_OPERANDS=scalar loads the same tensor-core fragments by
    # plain loads (the kernels' way before ldmatrix): the same results, bit
    # for bit where no atomic order enters, and held to the reference as the
    # default path is (float32: 3xTF32 operands). The H200 and H100 runs
    # compared the two this way; a default build leaves the plain-load path
    # out (the emulation has it): there the setting is a clear error.
    q, k, v = make(shape, dtype)
    gqa = shape[1] != shape[2]
    rng = torch.tensor([987654321, 4242], dtype=torch.long)
    keep = R.dropout_keep(987654321, 4242, (shape[0], shape[1], shape[3], shape[4]), 0.2)
    kw = dict(is_causal=True, enable_gqa=gqa, keep=keep, dropout_p=0.2)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.2, True, None, gqa, rng)
    go = torch.randn_like(cpu_out)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go, None, 0.2, True, None, gqa, rng)
    if dtype == torch.float32:  # its tensor-core operands: 3xTF32
        monkeypatch.setenv("MHA_EXT_CUDA_FLOAT32", "3xtf32")
    results = {}
    for mode in ("ldmatrix", "scalar"):
        monkeypatch.setenv("MHA_EXT_CUDA_OPERANDS", mode)
        try:
            out, lse, _ = backend.attention(q, k, v, None, 0.2, True, None, gqa, rng)
        except (RuntimeError, ValueError) as e:  # a default GPU build: the setting is a clear error
            if mode == "scalar" and isinstance(backend, OnCuda) and (
                    "MHA_EXT_CUDA_OPERANDS=scalar needs the plain-load operand path, which this build leaves out"
                    in str(e)):
                return
            raise
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            grads = run_backward(backend, q, k, v, cpu_out, cpu_lse, go, None, 0.2, True, None, gqa, rng)
        finally:
            torch.use_deterministic_algorithms(before)
        results[mode] = (out, lse) + tuple(grads[:3])
    for a, b in zip(results["ldmatrix"], results["scalar"]):
        assert torch.equal(a, b)
    assert_all_like_cpu(results["scalar"][0], cpu_out, references(q, k, v, **kw), dtype)
    assert_all_like_cpu(results["scalar"][2:], cpu[:3], references(q, k, v, go, **kw), dtype)


def test_emul_operands_setting_is_checked(backend, monkeypatch):
    q, k, v = make((1, 1, 1, 8, 8, 16, 16), torch.float16)
    monkeypatch.setenv("MHA_EXT_CUDA_OPERANDS", "fast")
    with pytest.raises((RuntimeError, ValueError), match='MHA_EXT_CUDA_OPERANDS must be "ldmatrix" or "scalar", got "fast"'):
        backend.attention(q, k, v, None, 0.0, False, None, False)


@pytest.mark.parametrize("shape", [(1, 4, 2, 50, 70, 64, 48), (1, 4, 2, 70, 45, 40, 72), (1, 2, 1, 33, 80, 128, 128)])
def test_emul_float32_math_follows_torchs_tf32_setting(backend, shape, monkeypatch):
    # float32 products: float32 FMAs on the CUDA cores by default (the tests
    # above), TF32 on the tensor cores where torch allows TF32 matmuls (10
    # mantissa bits, as float16: within twice the error of plain eager
    # PyTorch in float16, and measurably less exact than float32), 3xTF32
    # with MHA_EXT_CUDA_FLOAT32=3xtf32 (float32's tolerance), and float32 FMAs
    # with MHA_EXT_CUDA_FLOAT32=cuda-cores whatever torch allows.
    q, k, v = make(shape, torch.float32)
    gqa = shape[1] != shape[2]
    go = torch.randn(shape[0], shape[1], shape[3], shape[6], dtype=torch.float64).float()
    (ref_out, ref_grads), _ = references(q, k, v, go, is_causal=True, enable_gqa=gqa)
    (_, _), (h_out, h_grads) = references(q.half(), k.half(), v.half(), go.half(), is_causal=True, enable_gqa=gqa)
    refs, halves = [ref_out] + ref_grads, [h_out] + h_grads

    def run(mode, precision):
        monkeypatch.setenv("MHA_EXT_CUDA_FLOAT32", mode)
        torch.backends.cuda.matmul.fp32_precision = precision
        out, lse, _ = backend.attention(q, k, v, None, 0.0, True, None, gqa)
        return [out] + list(run_backward(backend, q, k, v, out, lse, go, is_causal=True, gqa=gqa)[:3])

    before = torch.backends.cuda.matmul.fp32_precision
    try:
        results = {(m, pr): run(m, pr) for m in ("auto", "3xtf32", "cuda-cores") for pr in ("ieee", "tf32")}
        # the older switch selects TF32 too (from "ieee", so that it is what changes the arithmetic)
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        monkeypatch.setenv("MHA_EXT_CUDA_FLOAT32", "auto")
        out, lse, _ = backend.attention(q, k, v, None, 0.0, True, None, gqa)
        assert torch.equal(out, results[("auto", "tf32")][0])
        assert not torch.equal(out, results[("auto", "ieee")][0])
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    for key in (("auto", "ieee"), ("3xtf32", "ieee"), ("3xtf32", "tf32")):
        assert_near_reference(results[key], refs, refs, torch.float32)
    for a, b, c in zip(results[("auto", "ieee")], results[("cuda-cores", "ieee")], results[("cuda-cores", "tf32")]):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(results[("3xtf32", "ieee")], results[("3xtf32", "tf32")]):
        assert torch.equal(a, b)
    for a, r, h in zip(results[("auto", "tf32")], refs, halves):
        scale = max(1.0, r.abs().max().item())
        assert 1e-5 * scale < _err(a, r) <= 2.0 * _err(h, r), (_err(a, r), _err(h, r))


def test_emul_float32_setting_is_checked(backend, monkeypatch):
    q, k, v = make((1, 1, 1, 8, 8, 16, 16), torch.float32)
    monkeypatch.setenv("MHA_EXT_CUDA_FLOAT32", "tf64")
    with pytest.raises((RuntimeError, ValueError),
                       match='MHA_EXT_CUDA_FLOAT32 must be "auto", "3xtf32" or "cuda-cores", got "tf64"'):
        backend.attention(q, k, v, None, 0.0, False, None, False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2, 1, 150, 97, 64, 48), (2, 2, 2, 130, 140, 128, 128), (1, 1, 1, 129, 70, 200, 256)])
def test_emul_forward_rows_64_and_128_are_bit_identical(backend, dtype, shape, monkeypatch):
    # MHA_EXT_CUDA_FWD_ROWS: 16-bit forward tiles of 64 query rows or 128
    # ("auto" picks them at head dims 128 and 256, and for the plain kernel);
    # MHA_EXT_CUDA_FWD_WARP_ROWS: the plain kernel's warps of 32 rows (calls
    # without a mask tensor, dropout, softcap or ALiBi, head dims 64 and 128)
    # or the general kernel's 16. Within a kernel a row's result does not
    # depend on the rows a block: the same bits (causal and a window add
    # tiles fully masked for some rows of a wider block, which the plain
    # kernel's warps skip; rows past L in a warp's second row tile; dropout,
    # which takes the general kernel; GQA). The two kernels differ in their
    # last bits where the plain kernel's edge tiles take the FMA softmax and
    # the general kernel's the exact one; the reference holds both.
    q, k, v = make(shape, dtype)
    gqa = shape[1] != shape[2]
    rng = torch.tensor([1234567, 89], dtype=torch.long)
    monkeypatch.delenv("MHA_EXT_CUDA_OPERANDS", raising=False)
    cases = [dict(), dict(is_causal=True), dict(window=(40, 3)), dict(window=(7, 0)), dict(dropout_p=0.2)]
    for case in cases:
        win = case.get("window", (-1, -1))
        args = (q, k, v, None, case.get("dropout_p", 0.0), case.get("is_causal", False), None, gqa, rng,
                win[0], win[1], True)
        results = {}
        for rows in ("64", "128", "auto"):
            for warp_rows in ("16", "32"):
                monkeypatch.setenv("MHA_EXT_CUDA_FWD_ROWS", rows)
                monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", warp_rows)
                if isinstance(backend, OnCuda):
                    results[rows, warp_rows] = backend.attention(*args)[:2]
                    continue
                backend.launched_grids(), backend.launched_threads()
                results[rows, warp_rows] = backend.attention(*args)[:2]
                # which kernel ran, from the launch: the plain one (32 rows a
                # warp) for the calls it takes, else the general one (16)
                d, L = max(shape[5], shape[6]), shape[3]
                plain = warp_rows == "32" and d <= 128 and "dropout_p" not in case
                block, threads = forward_block(d, L, plain, rows)
                assert backend.launched_grids()[0] == -(-L // block), (case, rows, warp_rows)
                assert backend.launched_threads()[0] == threads, (case, rows, warp_rows)
        for key, got in results.items():
            for a, b in zip(results["64", key[1]], got):
                assert torch.equal(a, b), (case, key)
        cpu_out = torch.ops.mha_ext.attention(*args)[0]
        kw = dict(enable_gqa=gqa, bottom_right=True)
        if "dropout_p" in case:
            kw.update(keep=R.dropout_keep(1234567, 89, (shape[0], shape[1], shape[3], shape[4]), 0.2), dropout_p=0.2)
        if case.get("is_causal"):
            kw.update(is_causal=True)
        if "window" in case:
            kw.update(window=win)
        refs = references(q, k, v, **kw)
        for warp_rows in ("16", "32"):
            assert_all_like_cpu(results["auto", warp_rows][0], cpu_out, refs, dtype)


def test_emul_forward_warp_rows_with_key_splits_are_bit_identical(backend, monkeypatch):
    # Key splits (flash-decoding) counted in 64-row blocks whatever the
    # launch's rows per block: the plain kernel's 128-row blocks (2 here)
    # and the general kernel's 64-row ones (3) split the keys alike (92 key
    # tiles in 22 runs of at most 5: 528 blocks fit, 4 of 46 KiB a
    # multiprocessor, 528 // 24 = 22), so a non-causal row sums the same runs
    # in the same order, and the combine gives the same bits (counted in the
    # launch's blocks, the plain kernel would make 23 runs of 4: 528 // 16 =
    # 33, at most 92 // 4). The keys fill their last tile: an edge tile takes
    # the FMA softmax in the plain kernel and the exact one in the general.
    for name in ("MHA_EXT_CUDA_KV_SPLITS", "MHA_EXT_CUDA_FWD_ROWS", "MHA_EXT_CUDA_OPERANDS"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(11)
    q, k, v = make((1, 8, 2, 130, 5888, 64, 64), torch.bfloat16)
    args = (q, k, v, None, 0.0, False, None, True)
    results = {}
    for warp_rows, q_blocks in (("16", 3), ("32", 2)):
        monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", warp_rows)
        if isinstance(backend, OnCuda):
            results[warp_rows] = backend.attention(*args)[:2]
            continue
        backend.launched_grids()
        results[warp_rows] = backend.attention(*args)[:2]
        grids = backend.launched_grids()
        assert grids[0] == q_blocks * 22 and len(grids) == 6, (warp_rows, grids)  # then the combine
    for a, b in zip(results["16"], results["32"]):
        assert torch.equal(a, b)
    cpu_out = torch.ops.mha_ext.attention(*args)[0]
    assert_all_like_cpu(results["32"][0], cpu_out, references(q, k, v, enable_gqa=True), torch.bfloat16)


def test_emul_forward_rows_setting_is_checked(backend, monkeypatch):
    q, k, v = make((1, 1, 1, 8, 8, 16, 16), torch.float16)
    monkeypatch.setenv("MHA_EXT_CUDA_FWD_ROWS", "256")
    with pytest.raises((RuntimeError, ValueError), match='MHA_EXT_CUDA_FWD_ROWS must be "auto", "64" or "128", got "256"'):
        backend.attention(q, k, v, None, 0.0, False, None, False)
    monkeypatch.setenv("MHA_EXT_CUDA_FWD_ROWS", "auto")
    monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", "64")
    with pytest.raises((RuntimeError, ValueError), match='MHA_EXT_CUDA_FWD_WARP_ROWS must be "auto", "16" or "32", got "64"'):
        backend.attention(q, k, v, None, 0.0, False, None, False)


def test_emul_mask_ranges_setting_is_checked(backend, monkeypatch):
    q, k, v = make((1, 1, 1, 20, 30, 16, 16), torch.float32)
    mask = torch.ones(20, 30, dtype=torch.bool)
    monkeypatch.setenv("MHA_EXT_CUDA_MASK_RANGES", "on")
    with pytest.raises((RuntimeError, ValueError), match='MHA_EXT_CUDA_MASK_RANGES must be "auto" or "off", got "on"'):
        backend.attention(q, k, v, mask, 0.0, False, None, False)

