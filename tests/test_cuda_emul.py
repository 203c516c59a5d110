"""The CUDA backend, held to the CPU backend (torch.ops.mha_ext.* on CPU
tensors) and, for half and bfloat16, to the float64 reference; dropout masks
must agree bit for bit. Each test runs on two backends:

- emul: tests/emul/attention_emul.cpp compiles the CUDA backend (csrc/cuda:
  host functions, launchers and the device code of attention_kernels.h)
  against the CPU emulation of the CUDA primitives (csrc/cuda/simt_emul.h:
  32-lane warps, real block and warp barriers, shared memory per block, the
  documented mma.sync m16n8k16 register layout) as torch.ops.mha_ext_emul.*;
- cuda: the real CUDA kernels on a GPU (skipped without one).

Key splits and the decode kernel: test_cuda_emul_decode.py; the run-time
kernel settings (operand loads, float32 math, forward rows):
test_cuda_emul_settings.py; the backends and the assertions: cuda_backends.py."""
import glob
import os
import subprocess
import sys

import pytest
import torch

import mha_ext  # noqa: F401  (registers torch.ops.mha_ext)
import reference as R
from cuda_backends import (DTYPES, NO_RNG, ROOT, SHAPES, OnCuda, _err, assert_all_like_cpu,  # noqa: F401
                           assert_near_reference, backend, forward_block, make, references, run_backward)
from cxx_runtime import hostile_toolchain, insert_long_kinds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_emul_forward_matches_cpu(backend, dtype, shape, is_causal):
    q, k, v = make(shape, dtype)
    gqa = shape[1] != shape[2]
    out, lse, _ = backend.attention(q, k, v, None, 0.0, is_causal, None, gqa)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.0, is_causal, None, gqa)
    assert_all_like_cpu(out, cpu_out, references(q, k, v, is_causal=is_causal, enable_gqa=gqa), dtype)
    assert lse.dtype == cpu_lse.dtype
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-5 if dtype != torch.float64 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ev", [33, 34, 58])
def test_emul_output_columns_past_and_odd(backend, dtype, ev):
    # 16-bit outputs go out by column pairs where the rows allow 32-bit stores
    # (even Ev: 34 and 58 end inside a 32-bit pair's chunk of the padded head
    # dim 64), element by element otherwise (odd Ev: odd row stride)
    q, k, v = make((1, 2, 2, 40, 50, 64, ev), dtype)
    out, _, _ = backend.attention(q, k, v, None, 0.0, False, None, False)
    cpu_out, _, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, False)
    assert_all_like_cpu(out, cpu_out, references(q, k, v), dtype)


@pytest.mark.parametrize("layout", ["contiguous", "column_stride_2", "misaligned", "head_dim_40"])
def test_emul_query_tile_layouts(backend, layout):
    # Q comes in by cp.async: whole 16-byte chunks, the zero padding of the
    # rows past L (L = 150: one whole 128-row block and a partial one) and of
    # the head dim past E, and element by element where the rows are not
    # 16-byte chunks (a column stride, a storage offset of one element)
    e = 40 if layout == "head_dim_40" else 64
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1, 2, 150, 2 * e + 1, generator=g).to(torch.float16)
    if layout == "column_stride_2":
        q = base[..., : 2 * e : 2]
    elif layout == "misaligned":
        q = base.flatten()[1: 1 + 2 * 150 * e].view(1, 2, 150, e)
    else:
        q = base[..., :e].contiguous()
    assert (layout == "misaligned") == (q.storage_offset() % 8 != 0)
    k = torch.randn(1, 2, 70, e, generator=g).to(torch.float16)
    v = torch.randn(1, 2, 70, e, generator=g).to(torch.float16)
    out, lse, _ = backend.attention(q, k, v, None, 0.0, False, None, False)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, False)
    assert_all_like_cpu(out, cpu_out, references(q, k, v), torch.float16)
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_emul_backward_matches_cpu(backend, dtype, shape, is_causal, deterministic):
    q, k, v = make(shape, dtype)
    gqa = shape[1] != shape[2]
    out, lse, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.0, is_causal, None, gqa)
    go = torch.randn_like(out)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, out, lse, go, is_causal=is_causal, gqa=gqa)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        ours = run_backward(backend, q, k, v, out, lse, go, is_causal=is_causal, gqa=gqa)
    finally:
        torch.use_deterministic_algorithms(before)
    assert_all_like_cpu(ours[:3], cpu[:3], references(q, k, v, go, is_causal=is_causal, enable_gqa=gqa), dtype)
    assert ours[3].numel() == 0


def _mask_cases(L, S, hq):
    g = torch.Generator().manual_seed(1)
    bool2 = torch.rand(L, S, generator=g) > 0.3
    bool2[3] = False  # a fully masked row
    float4 = torch.randn(1, hq, L, S, generator=g, dtype=torch.float64)
    float4[0, 0, 5] = float("-inf")  # a fully masked row in head 0
    return {"bool_2d": bool2, "bool_4d_broadcast": bool2[None, None].expand(2, 1, L, S),
            "float_4d": float4, "float_row_broadcast": torch.randn(S, dtype=torch.float64)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("mask_name", ["bool_2d", "bool_4d_broadcast", "float_4d", "float_row_broadcast"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_emul_masks_and_mask_grad(backend, dtype, mask_name, is_causal):
    shape = (2, 2, 2, 24, 40, 32, 32)
    q, k, v = make(shape, dtype)
    mask = _mask_cases(24, 40, 2)[mask_name]
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    want_grad = mask.dtype != torch.bool
    out, lse, _ = backend.attention(q, k, v, mask, 0.0, is_causal, 0.3)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, mask, 0.0, is_causal, 0.3)
    assert_all_like_cpu(out, cpu_out, references(q, k, v, mask=mask, is_causal=is_causal, scale=0.3), dtype)
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)
    go = torch.randn_like(out)
    ours = run_backward(backend, q, k, v, cpu_out, cpu_lse, go, mask, is_causal=is_causal, scale=0.3, mask_grad=want_grad)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go, mask, is_causal=is_causal, scale=0.3,
                    mask_grad=want_grad)
    refs = references(q, k, v, go, mask=mask, is_causal=is_causal, scale=0.3)
    assert_all_like_cpu(ours if want_grad else ours[:3], cpu if want_grad else cpu[:3], refs, dtype)
    if want_grad:
        assert ours[3].shape == mask.shape


def test_emul_dropout_mask_is_bit_identical_to_cpu(backend):
    # q = 0 makes every probability 1 / S; v = I (Ev = S) makes out[i, j] =
    # keep(i, j) / ((1 - p) S): the output spells out the kept elements.
    n, h, L, S, p = 2, 3, 21, 48, 0.3
    q = torch.zeros(n, h, L, 16, dtype=torch.float64)
    k = torch.randn(n, h, S, 16, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).expand(n, h, S, S)
    rng = torch.tensor([123456789123, 77], dtype=torch.long)
    out, _, used = backend.attention(q, k, v, None, p, False, None, False, rng)
    assert torch.equal(used, rng)
    keep = torch.ops.mha_ext.dropout_mask(rng, [n, h, L, S], p)
    assert torch.equal(out != 0, keep)
    assert torch.equal(keep, R.dropout_keep(123456789123, 77, (n, h, L, S), p))
    torch.testing.assert_close(out, keep.double() / ((1 - p) * S), rtol=1e-12, atol=1e-12)


def test_emul_dropout_without_rng_state_draws_one(backend):
    # the op draws (seed, offset) itself (on a GPU from torch's CUDA generator,
    # graph-safe) and returns it; the CPU op with that state drops the same
    q, k, v = make((1, 2, 2, 30, 41, 16, 16), torch.float64)
    out, lse, rng = backend.attention(q, k, v, None, 0.25, False, None, False, None)
    assert rng.dtype == torch.int64 and rng.shape == (2,)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.25, False, None, False, rng.cpu())
    torch.testing.assert_close(out, cpu_out, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(out)
    ours = run_backward(backend, q, k, v, out, lse, go, None, 0.25, rng=rng)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go, None, 0.25, rng=rng.cpu())
    for a, c in zip(ours[:3], cpu[:3]):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_emul_draw_rng_state_is_what_the_op_draws(backend):
    # (seed, offset) and the generator's advance of a forward with dropout and
    # no rng_state, for a key length past the kernels' sequence limit
    q, k, v = make((1, 2, 2, 30, 41, 16, 16), torch.float64)
    torch.manual_seed(9)
    drawn = backend.draw_rng_state(q, 2**21)
    torch.manual_seed(9)
    _, _, used = backend.attention(q, k, v, None, 0.25, False, None, False, None)
    assert torch.equal(drawn.cpu(), used.cpu())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_emul_dropout_forward_and_backward_match_cpu(backend, dtype):
    shape = (1, 4, 2, 50, 70, 64, 48)
    q, k, v = make(shape, dtype)
    rng = torch.tensor([987654321, 4242], dtype=torch.long)
    out, lse, _ = backend.attention(q, k, v, None, 0.2, True, None, True, rng)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.2, True, None, True, rng)
    keep = R.dropout_keep(987654321, 4242, (1, 4, 50, 70), 0.2)
    kw = dict(is_causal=True, enable_gqa=True, keep=keep, dropout_p=0.2)
    assert_all_like_cpu(out, cpu_out, references(q, k, v, **kw), dtype)
    go = torch.randn_like(out)
    ours = run_backward(backend, q, k, v, cpu_out, cpu_lse, go, None, 0.2, True, None, True, rng)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go, None, 0.2, True, None, True, rng)
    assert_all_like_cpu(ours[:3], cpu[:3], references(q, k, v, go, **kw), dtype)


def test_emul_dropout_frame_matches_reference(backend):
    # a block (rows 13.., columns 7..) of a larger attention draws that block of its mask
    q, k, v = make((1, 4, 2, 40, 70, 32, 16), torch.float64)
    rng = torch.tensor([987654321, 4242, 100, 13, 7], dtype=torch.long)
    out, lse, _ = backend.attention(q, k, v, None, 0.2, False, None, True, rng)
    keep = R.dropout_keep(987654321, 4242, (1, 4, 100, 77), 0.2)[..., 13:53, 7:77]
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = R.attention(*xs, enable_gqa=True, keep=keep, dropout_p=0.2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    go = torch.randn_like(out)
    ours = run_backward(backend, q, k, v, out, lse, go, None, 0.2, False, None, True, rng)
    for a, b in zip(ours[:3], torch.autograd.grad(ref, xs, go)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_emul_strided_and_batched_inputs(backend):
    # (N1, N2, L, H, E) transposed to (N1, N2, H, L, E); key/value expanded over N2
    q = torch.randn(2, 3, 19, 2, 24, dtype=torch.float64).transpose(-3, -2)
    k = torch.randn(2, 1, 2, 27, 24, dtype=torch.float64).expand(2, 3, 2, 27, 24)
    v = torch.randn(2, 1, 27, 2, 40, dtype=torch.float64).transpose(-3, -2).expand(2, 3, 2, 27, 40)
    out, lse, _ = backend.attention(q, k, v)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v)
    torch.testing.assert_close(out, cpu_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(out).transpose(-2, -1).contiguous().transpose(-2, -1)
    ours = run_backward(backend, q, k, v, out, lse, go)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go)
    for a, c in zip(ours[:3], cpu[:3]):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,fp32", [(torch.float32, "auto"), (torch.float32, "3xtf32"), (torch.float16, "auto")])
def test_emul_hostile_inputs(backend, dtype, fp32, monkeypatch):
    # huge logits stay finite; a fully masked row gives 0 and no gradient; a
    # NaN in one query row makes that row (only) NaN (float32 on the CUDA
    # cores and as 3xTF32 on the tensor cores)
    monkeypatch.setenv("MHA_EXT_CUDA_FLOAT32", fp32)
    n, h, L, S, E = 1, 2, 18, 33, 16
    q = (torch.randn(n, h, L, E) * 300).to(dtype)
    k, v = torch.randn(n, h, S, E).to(dtype), torch.randn(n, h, S, E).to(dtype)
    q[0, 1, 7, 3] = float("nan")
    mask = torch.ones(L, S, dtype=torch.bool)
    mask[4] = False
    out, lse, _ = backend.attention(q, k, v, mask)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, mask)
    nan_rows = torch.zeros(n, h, L, dtype=torch.bool)
    nan_rows[0, 1, 7] = True
    assert torch.isnan(out).any(-1).equal(nan_rows) and torch.isnan(lse).equal(nan_rows)
    assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4]))
    assert torch.isneginf(lse[:, :, 4]).all()
    fin = ~nan_rows
    q_ok = q.clone()
    q_ok[0, 1, 7, 3] = 0
    go = torch.randn_like(out)
    (ref_out, ref_grads), (eager_out, eager_grads) = references(q_ok, k, v, go, mask=mask)
    # logits ~ 1e3: exp(score - lse) in float carries eps * |lse| relative error
    spread = 1.0 + R.logsumexp(q_ok, k, mask).abs().nan_to_num(posinf=0.0).max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(out[fin].double(), ref_out[fin], rtol=0, atol=1e-6 * spread)
    else:
        assert _err(out[fin], ref_out[fin]) <= 2.0 * max(_err(cpu_out[fin], ref_out[fin]), _err(eager_out[fin], ref_out[fin])) + 1e-6
    o2, l2, _ = torch.ops.mha_ext.attention(q_ok, k, v, mask)
    ours = run_backward(backend, q_ok, k, v, o2, l2, go, mask)
    cpu = run_backward(torch.ops.mha_ext, q_ok, k, v, o2, l2, go, mask)
    assert torch.equal(ours[0][:, :, 4], torch.zeros_like(ours[0][:, :, 4]))
    for a, c, r, e in zip(ours[:3], cpu[:3], ref_grads, eager_grads):
        assert torch.isfinite(a).all()
        if dtype == torch.float32:
            torch.testing.assert_close(a.double(), r, rtol=0, atol=1e-6 * spread * max(1.0, r.abs().max().item()))
        else:
            assert _err(a, r) <= 2.0 * max(_err(c, r), _err(e, r)) + 1e-6, (_err(a, r), _err(c, r), _err(e, r))


@pytest.mark.parametrize("sizes", [(0, 5, 5), (1, 0, 5), (1, 5, 0)])
def test_emul_empty_inputs(backend, sizes):
    n, L, S = sizes
    q = torch.randn(n, 2, L, 8, dtype=torch.float64, requires_grad=False)
    k, v = torch.randn(n, 2, S, 8, dtype=torch.float64), torch.randn(n, 2, S, 6, dtype=torch.float64)
    out, lse, _ = backend.attention(q, k, v)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v)
    assert torch.equal(out, cpu_out) and torch.equal(lse, cpu_lse)
    go = torch.randn_like(out)
    ours = run_backward(backend, q, k, v, out, lse, go)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go)
    for a, c in zip(ours[:3], cpu[:3]):
        assert torch.equal(a, c)


class _Attention(torch.autograd.Function):
    """Forward and backward of a backend under test, for gradcheck."""

    @staticmethod
    def forward(ctx, ops, q, k, v, mask, is_causal):
        out, lse, rng = ops.attention(q, k, v, mask, 0.0, is_causal)
        ctx.ops, ctx.is_causal = ops, is_causal
        ctx.save_for_backward(q, k, v, out, lse, rng, mask)
        return out

    @staticmethod
    def backward(ctx, go):
        q, k, v, out, lse, rng, mask = ctx.saved_tensors
        gq, gk, gv, gm = ctx.ops.attention_backward(go.contiguous(), q, k, v, out, lse, mask, 0.0, ctx.is_causal,
                                                     None, False, rng, mask.requires_grad)
        return None, gq, gk, gv, gm if mask.requires_grad else None, None


@pytest.mark.parametrize("is_causal", [False, True])
def test_emul_gradcheck_float64(backend, is_causal):
    q = torch.randn(1, 2, 9, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 11, 12, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 11, 10, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(9, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *x: _Attention.apply(backend, *x, is_causal), (q, k, v, mask))


@pytest.mark.parametrize("warp_rows", ["32", "16"], ids=["plain kernel", "general kernel"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emul_fma_scores_split_equal_keys_at_every_magnitude(backend, dtype, is_causal, warp_rows, monkeypatch):
    # The forward folds the scale into one FMA a score while a row's max in
    # a tile, in log2 units, is within 512 (fma_scores), and takes the exact
    # path past it: the plain kernel (head dim 128) in all its tiles, the
    # general kernel (MHA_EXT_CUDA_FWD_WARP_ROWS=16) in interior tiles only,
    # so that its rows mix the paths. Each row has two equal best keys, 10
    # (an interior tile) and 150 (the partial last tile; causal: the rows'
    # diagonal tile), far above the rest, at a best score from 100 to 1e7 in
    # log2 units: the output must be their values' mean to one unit in the
    # last place of the dtype, and lse the float64 reference's. (In the
    # general kernel an FMA at 1e6 would err by up to 2^-24 * 1e6 = 0.06 in
    # the exponent against the exact path's score of the other key, a weight
    # of 0.5 +- 2%: the test fails there if the bound is lifted.) The
    # backward recomputes the scores by the exact path against the forward's
    # lse: the gradient of V at the two keys, from these rows alone, must be
    # half the sum of their output gradients.
    monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", warp_rows)
    n, h, S, E = 1, 1, 190, 128
    L = S if is_causal else 64
    g = torch.Generator().manual_seed(1)
    targets = torch.tensor([100.0, 400.0, 500.0, 520.0, 3e3, 1e5, 1e6, 1e7])
    b = 4096.0
    log2_units = E ** -0.5 / torch.log(torch.tensor(2.0)).item()
    q = torch.randn(n, h, L, E, generator=g) * 0.1
    k = torch.randn(n, h, S, E, generator=g) * 0.1
    v = torch.randn(n, h, S, E, generator=g)
    # causal (top-left): rows 152-187 see both best keys
    rows = 152 + 5 * torch.arange(len(targets)) if is_causal else torch.arange(0, 8 * len(targets), 8)
    q[0, 0, rows] = 0.0
    q[0, 0, rows, 0] = targets / (b * log2_units)
    k[0, 0, :, 0] = b * 0.3 * torch.rand(S, generator=g)
    k[0, 0, 10, 0] = k[0, 0, 150, 0] = b
    k[0, 0, 150, 1:] = k[0, 0, 10, 1:]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse, _ = backend.attention(q, k, v, None, 0.0, is_causal, None)
    mean = ((v[0, 0, 10].double() + v[0, 0, 150].double()) / 2).to(dtype).double()
    ulp = torch.finfo(dtype).eps * mean.abs().clamp(min=2.0 ** -4)
    for r in rows.tolist():
        err = (out[0, 0, r].double() - mean).abs()
        assert (err <= ulp).all(), (r, (err / ulp).max().item())
    ref_lse = R.logsumexp(q, k, None, is_causal).double()
    torch.testing.assert_close(lse.double(), ref_lse.reshape(lse.shape), rtol=2e-6, atol=1e-6)
    go = torch.zeros_like(out)
    go[0, 0, rows] = torch.randn(len(rows), E, generator=g).to(dtype)
    dv = run_backward(backend, q, k, v, out, lse, go, is_causal=is_causal)[2]
    half = go[0, 0, rows].double().sum(0) / 2
    for j in (10, 150):
        err = (dv[0, 0, j].double() - half).abs()
        assert (err <= 2 * torch.finfo(dtype).eps * half.abs().clamp(min=1.0)).all(), (j, err.max().item())


@pytest.mark.parametrize("scale", [None, 1.0], ids=["default scale", "scale 1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emul_hostile_scores_on_interior_tiles(backend, dtype, scale):
    # Whole key tiles with no mask (interior tiles) take the plain softmax in
    # float16 / bfloat16 where their scores stay finite once scaled, the exact
    # clamped path elsewhere; both must give the same scaled scores to the
    # bit, since a row's tiles and its backward mix them. Head dim 128 (the
    # whole-tile copies), L = 64 (whole query tiles for the backward), S = 190
    # (a partial last key tile, an edge tile). Head 0: rows 16-31 score ~1e11
    # on one key dimension, so their lse is ~1e10 and the backward uses the
    # rows' exact statistics; those with a positive coefficient see two equal
    # best keys, 10 (interior tile) and 150 (edge tile), and must split 0.5 /
    # 0.5 (a one-ulp disagreement between the paths makes them one-hot), the
    # others one best key, 40. Row 3 has a finite dot product of 3e38, which
    # at scale 1 overflows once scaled (the exact way: clamped, its key's value
    # row, as in the float64 reference; the CPU kernels give NaN there). Head
    # 1 has a NaN query row, NaN alone. Other rows: moderate logits.
    n, h, L, S, E = 1, 2, 64, 190, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, m, E, generator=g) for m in (L, S, S))
    q[..., :2] = 0.0
    k[..., :2] = 0.0
    sign = torch.where(torch.arange(16) % 3 == 0, -1.0, 1.0)
    q[0, 0, 16:32, 0] = sign * (1 + torch.rand(16, generator=g)) * 2e5
    k[0, 0, :, 0] = (1.5 + torch.rand(S, generator=g)) * 1e5
    k[0, 0, 10, 0], k[0, 0, 40, 0] = 3e5, 1e5
    k[0, 0, 150] = k[0, 0, 10]
    q[0, 0, 3, 1] = 2e19
    k[0, 0, 70, 1] = 1.5e19
    q[0, 1, 5, 2] = float("nan")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse, _ = backend.attention(q, k, v, None, 0.0, False, scale)
    nan_rows = torch.zeros(n, h, L, dtype=torch.bool)
    nan_rows[0, 1, 5] = True
    assert torch.isnan(out).any(-1).equal(nan_rows) and torch.isnan(lse).equal(nan_rows)
    torch.testing.assert_close(out[0, 0, 3], v[0, 0, 70], rtol=1e-6, atol=0)
    two = sign > 0
    torch.testing.assert_close(out[0, 0, 16:32][two], ((v[0, 0, 10].double() + v[0, 0, 150].double()) / 2)
                               .to(dtype).expand(int(two.sum()), E), rtol=1e-6, atol=0)
    torch.testing.assert_close(out[0, 0, 16:32][~two], v[0, 0, 40].expand(int((~two).sum()), E), rtol=1e-6, atol=0)
    q_ok = q.clone()
    q_ok[0, 1, 5, 2] = 0
    (ref, _), (eager, _) = references(q_ok, k, v, scale=scale)
    ok = ~nan_rows
    assert _err(out[ok], ref[ok]) <= 2.0 * _err(eager[ok], ref[ok]) + 1e-6
    if dtype != torch.bfloat16:
        return
    # bfloat16, where interior tiles take the plain backward too: dV of head 0
    # (head 1's gradients are NaN) against the reference, within twice eager
    # torch's error in the dtype (dQ and dK of one-hot rows carry a rounding
    # residue of D = rowsum(dO O) times q ~ 1e19 here, in any kernel that
    # takes D; eager's softmax backward has exactly 0 there)
    head = [x[:, :1].contiguous() for x in (q, k, v, out, lse)]
    go = torch.randn(head[3].shape, generator=g).to(dtype)
    dv = run_backward(backend, *head, go, scale=scale)[2]
    (_, ref_grads), (_, eager_grads) = references(*head[:3], go, scale=scale)
    assert torch.isfinite(dv).all()
    assert _err(dv, ref_grads[2]) <= 2.0 * _err(eager_grads[2], ref_grads[2]) + 1e-6, (
        _err(dv, ref_grads[2]), _err(eager_grads[2], ref_grads[2]))


def test_emul_head_dim_limit_is_a_clear_error(backend):
    q = torch.randn(1, 1, 4, 264)
    with pytest.raises(RuntimeError, match=r"head dims up to 256, got E = 264, Ev = 264"):
        backend.attention(q, q, q)


def test_emul_library_takes_the_shared_cpp_runtime(tmp_path):
    # The emulation is built at test time by the compiler the machine has. A GPU
    # image's linked the C++ runtime statically (from a search path holding only
    # libstdc++.a), and every check whose message held an integer crashed the
    # process. Built here by such a compiler (in a process of its own): the
    # message whole, the stream code imported from libstdc++.so. (At -O1,
    # which compiles faster than the tests' -O2 and, unlike -O0, makes the
    # stream call this test reads.)
    build = tmp_path / "emul"
    script = f"""
import sys, torch
sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
from cuda_backends import _load_emulation
ops = _load_emulation({str(build)!r}, opt="-O1")
q = torch.randn(1, 1, 4, 264)
try:
    ops.attention(q, q, q)
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""
    env = dict(os.environ, CXX=hostile_toolchain(tmp_path))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "head dims up to 256, got E = 264, Ev = 264" in res.stdout, res.stdout
    assert insert_long_kinds(str(build / "mha_ext_emul.so")) == ["U"]


def test_emul_device_code_reaches_hardware_only_through_simt():
    """What the emulation runs is what nvcc compiles: the attention device
    code touches no CUDA built-in except through simt.h / mma.h."""
    banned = ["__syncthreads", "__shfl", "threadIdx", "blockIdx", "atomicAdd", "__ballot", "extern __shared__"]
    for path in glob.glob(os.path.join(ROOT, "csrc", "cuda", "attention_*.h")):
        text = open(path).read()
        for word in banned:
            assert word not in text, f"{os.path.basename(path)} uses {word} directly"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_draw_fresh_dropout():
    # Captured without rng_state, the op reads torch's generator state on the
    # device: each replay draws a new (seed, offset), and drops what the CPU op
    # drops for it.
    q, k, v = (torch.randn(1, 2, 64, 32, device="cuda", dtype=torch.float16) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.mha_ext.attention(q, k, v, None, 0.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, rng = torch.ops.mha_ext.attention(q, k, v, None, 0.5)
    used = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        ref, _, _ = torch.ops.mha_ext.attention(q.cpu(), k.cpu(), v.cpu(), None, 0.5, rng_state=rng.cpu())
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=2e-2)
        used.append(rng.cpu().clone())
    assert not torch.equal(used[0], used[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_emul_padding_rows_and_batch_varying_mask(backend, dtype, is_causal):
    # A float mask that differs per batch element (a mask offset without its
    # batch term reads batch 0's mask for batch 1), with finfo.min padding:
    # batch 1 pads its first 5 keys and its first 3 query rows see only
    # padding (uniform rows, whose gradient the backward must get from the
    # rows' exact statistics), batch 0 pads its last 7 keys. Forward and every
    # gradient against the float64 reference.
    N, H, L, S, E = 2, 2, 21, 38, 16
    q, k, v = make((N, H, H, L, S, E, E), dtype)
    lo = torch.finfo(torch.float32 if dtype == torch.float64 else dtype).min
    mask = torch.randn(N, 1, L, S, dtype=torch.float64).to(dtype)
    mask[0, ..., S - 7:] = lo
    mask[1, ..., :5] = lo
    mask[1, :, :3, :] = lo
    out, lse, _ = backend.attention(q, k, v, mask, 0.0, is_causal)
    go = torch.randn_like(out)
    grads = run_backward(backend, q, k, v, out, lse, go, mask, is_causal=is_causal, mask_grad=True)
    (ref_out, ref_grads), (eager_out, eager_grads) = references(q, k, v, go, mask=mask, is_causal=is_causal)
    assert_near_reference([out] + list(grads), [ref_out] + ref_grads, [eager_out] + eager_grads, dtype)


def _tile_hiding_masks(n, h, L, S):
    """Bool masks that hide whole key tiles (64 keys) from every row of a
    batch, and the keys each poisons: those outside every row's shown range,
    past the last shown key's tile or before the first one's."""
    static = torch.zeros(n, 1, L, S, dtype=torch.bool)
    for i in range(L):
        static[0, 0, i, :100 + i] = True  # a StaticCache: rows past the length (and causal)
    static[1, 0, :, 140:260] = True  # a left-padded batch, a shorter length
    static[2, 0, 20:, 10:30] = True  # rows 0-19 see no key
    pad = torch.zeros(n, 1, 1, S, dtype=torch.bool)
    pad[0, ..., :190], pad[1, ..., 70:], pad[2, ..., 5:60] = True, True, True
    heads = torch.rand(n, h, L, S, generator=torch.Generator().manual_seed(3)) > 0.4
    heads[:, :, :, 256:] = False
    heads[1, :, :, :128] = False
    heads[2, 1] = False  # a head that sees nothing
    masks = {"static_cache": static, "padding": pad.expand(n, 1, L, S), "per_head": heads}
    poisoned = {}
    for name, m in masks.items():
        shown = m.expand(n, h, L, S).any(2).any(1)  # (n, S): keys some row of the batch sees
        keys = torch.zeros(n, S, dtype=torch.bool)
        for b in range(n):
            idx = shown[b].nonzero().flatten()
            lo, hi = (idx.min().item() // 64 * 64, (idx.max().item() // 64 + 1) * 64) if len(idx) else (S, S)
            keys[b, :lo], keys[b, hi:] = True, True
        poisoned[name] = keys
    return masks, poisoned


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask_name", ["static_cache", "padding", "per_head"])
def test_emul_bool_mask_ranges_skip_hidden_tiles(backend, dtype, mask_name, monkeypatch):
    # The general forward, the key-block backward and the dQ kernel take
    # only the key tiles (query tiles) from the first to the last key (row) a
    # bool mask shows their block (score_policy.h's mask_ranges_kernel, run
    # before them): a StaticCache's rows past its length, a left-padded
    # batch's leading keys, the keys of a fully hidden head. Outputs, lse and
    # gradients against the CPU backend and the float64 reference; NaN keys
    # and infinite values in those tiles change nothing (they turn the
    # output NaN where every tile is read, as with MHA_EXT_CUDA_MASK_RANGES=off
    # still does), as on the CPU.
    for name in ("MHA_EXT_CUDA_FWD_WARP_ROWS", "MHA_EXT_CUDA_MASK_RANGES", "MHA_EXT_CUDA_KV_SPLITS"):
        monkeypatch.delenv(name, raising=False)
    n, h, L, S = 3, 2, 80, 400
    q, k, v = make((n, h, h, L, S, 64, 48), dtype)
    masks, poisoned = _tile_hiding_masks(n, h, L, S)
    mask, bad = masks[mask_name], poisoned[mask_name]
    assert bad.any(1).all()  # every batch has poisoned tiles
    out, lse, _ = backend.attention(q, k, v, mask, 0.0, False, None)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, mask, 0.0, False, None)
    go = torch.randn_like(out)
    refs = references(q, k, v, mask=mask)
    assert_all_like_cpu(out, cpu_out, refs, dtype)
    assert torch.equal(torch.isinf(lse), torch.isinf(cpu_lse))
    torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)
    cpu = run_backward(torch.ops.mha_ext, q, k, v, cpu_out, cpu_lse, go, mask)
    k2, v2 = k.clone(), v.clone()
    k2[bad[:, None].expand(n, h, S)] = float("nan")
    v2[bad[:, None].expand(n, h, S)] = float("inf")
    out2, lse2, _ = backend.attention(q, k2, v2, mask, 0.0, False, None)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    monkeypatch.setenv("MHA_EXT_CUDA_MASK_RANGES", "off")  # every tile read, as before the ranges
    # (the same within rounding: with key splits the runs divide another range)
    assert_all_like_cpu(backend.attention(q, k, v, mask, 0.0, False, None)[0], cpu_out, refs, dtype)
    assert torch.isnan(backend.attention(q, k2, v2, mask, 0.0, False, None)[0]).any()
    monkeypatch.setenv("MHA_EXT_CUDA_MASK_RANGES", "auto")
    before = torch.are_deterministic_algorithms_enabled()
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        try:
            ours = run_backward(backend, q, k, v, cpu_out, cpu_lse, go, mask)
            ours2 = run_backward(backend, q, k2, v2, cpu_out, cpu_lse, go, mask)
        finally:
            torch.use_deterministic_algorithms(before)
        assert_all_like_cpu(ours[:3], cpu[:3], references(q, k, v, go, mask=mask), dtype)
        keep = ~bad[:, None, :, None]
        assert torch.equal(ours2[0], ours[0]), deterministic
        for a, b in zip(ours2[1:3], ours[1:3]):  # dK, dV of the poisoned keys: 0, their P is 0
            assert torch.equal(torch.where(keep, a, 0), torch.where(keep, b, 0)), deterministic
            assert (a.masked_select(~keep) == 0).all(), deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_emul_bool_mask_ranges_of_a_packed_gqa_group(backend, dtype, monkeypatch):
    # One query row a head of a GQA group (float32 / float64: the general
    # forward, the group's heads packed as the rows of one block, the mask's
    # head stride its row stride): a StaticCache's (B, 1, 1, S_max) mask and a
    # per-head (B, Hq, 1, S) one; the scan's ranges follow the packed rows.
    # NaN keys and infinite values past each batch's last shown key change
    # nothing; against the CPU backend and the float64 reference.
    for name in ("MHA_EXT_CUDA_MASK_RANGES", "MHA_EXT_CUDA_KV_SPLITS"):
        monkeypatch.delenv(name, raising=False)
    n, hq, hkv, S = 2, 8, 2, 300
    q, k, v = make((n, hq, hkv, 1, S, 32, 32), dtype)
    lengths = [70, 190]
    static = torch.zeros(n, 1, 1, S, dtype=torch.bool)
    per_head = torch.zeros(n, hq, 1, S, dtype=torch.bool)
    for b, length in enumerate(lengths):
        static[b, ..., :length] = True
        for h in range(hq):
            per_head[b, h, 0, 10 * h:length - 5 * h] = True
    for mask in (static, per_head):
        out, lse, _ = backend.attention(q, k, v, mask, 0.0, False, None, True)
        cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q, k, v, mask, 0.0, False, None, True)
        assert_all_like_cpu(out, cpu_out, references(q, k, v, mask=mask, enable_gqa=True), dtype)
        torch.testing.assert_close(lse, cpu_lse, rtol=1e-5 if dtype != torch.float64 else 1e-12, atol=1e-5)
        k2, v2 = k.clone(), v.clone()
        for b, length in enumerate(lengths):
            past = (length + 63) // 64 * 64  # the tiles past the last shown key's (16-64 keys a tile)
            k2[b, :, past:] = float("nan")
            v2[b, :, past:] = float("inf")
        out2, lse2, _ = backend.attention(q, k2, v2, mask, 0.0, False, None, True)
        assert torch.equal(out2, out) and torch.equal(lse2, lse)
