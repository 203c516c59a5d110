"""Forward parity of mha_ext.scaled_dot_product_attention against the float64
reference and torch's own SDPA."""
import math

import pytest
import torch
import torch.nn.functional as F

import mha_ext
import reference as R
from conftest import DEVICES

sdpa = mha_ext.scaled_dot_product_attention

# (batch dims, Hq, Hkv, L, S, E, Ev)
SHAPES = [
    ((2,), 3, 3, 17, 17, 16, 16),
    ((1,), 2, 2, 1, 9, 8, 8),        # L = 1
    ((2,), 2, 2, 9, 1, 8, 8),        # S = 1
    ((3,), 2, 2, 67, 300, 32, 24),   # L != S, E != Ev, odd, several key tiles
    ((2,), 2, 2, 300, 67, 16, 40),   # L > S, several query tiles
    ((), 4, 4, 5, 6, 8, 8),          # no batch dims
    ((2, 3), 2, 2, 7, 11, 8, 12),    # two batch dims
    ((2,), 6, 2, 33, 40, 16, 16),    # GQA
]


def make(shape, dtype=torch.float64, device="cpu"):
    batch, hq, hkv, L, S, E, Ev = shape
    q = torch.randn(*batch, hq, L, E, dtype=dtype, device=device)
    k = torch.randn(*batch, hkv, S, E, dtype=dtype, device=device)
    v = torch.randn(*batch, hkv, S, Ev, dtype=dtype, device=device)
    return q, k, v


def gqa_of(shape):
    return shape[1] != shape[2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_reference_float64(device, shape, is_causal):
    q, k, v = make(shape, device=device)
    out = sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa_of(shape))
    ref = R.attention(q.cpu(), k.cpu(), v.cpu(), is_causal=is_causal, enable_gqa=gqa_of(shape))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_torch_sdpa_float32(shape, is_causal):
    q, k, v = make(shape, dtype=torch.float32)
    out = sdpa(q, k, v, is_causal=is_causal, enable_gqa=gqa_of(shape))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa_of(shape))
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


MASKS = {
    "bool (L,S)": lambda b, H, L, S: torch.rand(L, S) > 0.3,
    "bool (N,1,1,S)": lambda b, H, L, S: torch.rand(*b, 1, 1, S) > 0.3,
    "bool (N,H,L,S)": lambda b, H, L, S: torch.rand(*b, H, L, S) > 0.3,
    "float (L,S)": lambda b, H, L, S: torch.randn(L, S, dtype=torch.float64),
    "float (1,S)": lambda b, H, L, S: torch.randn(1, S, dtype=torch.float64),
    "float (H,1,S) 3-D": lambda b, H, L, S: torch.randn(H, 1, S, dtype=torch.float64),
    "float (N,H,L,S) with -inf": lambda b, H, L, S: torch.randn(*b, H, L, S, dtype=torch.float64).masked_fill(
        torch.rand(*b, H, L, S) > 0.7, float("-inf")),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4], SHAPES[7]], ids=str)
def test_masks(mask_name, is_causal, shape):
    batch, hq, _, L, S, _, _ = shape
    q, k, v = make(shape)
    mask = MASKS[mask_name](batch, hq, L, S)
    out = sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa_of(shape))
    ref = R.attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa_of(shape))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    if not is_causal and mask.dtype == torch.bool:
        # torch's SDPA agrees wherever a row has a key to attend to (it gives NaN elsewhere)
        t = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa_of(shape))
        rows = mask.expand(out.shape[:-1] + (S,)).any(-1)
        torch.testing.assert_close(out[rows], t[rows], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask_name", ["bool (L,S)", "float (L,S)", "float (N,H,L,S) with -inf"])
@pytest.mark.parametrize("shape", [SHAPES[3], SHAPES[4], SHAPES[7]], ids=str)
def test_masks_float32_match_reference_and_torch(mask_name, shape):
    # float32 masks go through the vectorised mask rows
    batch, hq, _, L, S, _, _ = shape
    q, k, v = make(shape, dtype=torch.float32)
    mask = MASKS[mask_name](batch, hq, L, S)
    mask = mask if mask.dtype == torch.bool else mask.float()
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa_of(shape))
    ref = R.attention(q.double(), k.double(), v.double(), attn_mask=mask if mask.dtype == torch.bool else mask.double(),
                      enable_gqa=gqa_of(shape))
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    rows = mask.expand(out.shape[:-1] + (S,)).isfinite().any(-1) if mask.dtype != torch.bool else \
        mask.expand(out.shape[:-1] + (S,)).any(-1)
    t = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa_of(shape))
    torch.testing.assert_close(out[rows], t[rows], rtol=2e-5, atol=2e-5)


def test_scale_and_logsumexp():
    q, k, v = make(SHAPES[3])
    mask = torch.rand(q.shape[-2], k.shape[-2]) > 0.2
    out, lse, _ = torch.ops.mha_ext.attention(q, k, v, mask, 0.0, True, 0.3)
    torch.testing.assert_close(out, R.attention(q, k, v, attn_mask=mask, is_causal=True, scale=0.3))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask & torch.ones_like(mask).tril(), scale=0.3).nan_to_num(0.0))
    torch.testing.assert_close(lse, R.logsumexp(q, k, attn_mask=mask, is_causal=True, scale=0.3))
    assert lse.dtype == torch.float64
    _, lse32, _ = torch.ops.mha_ext.attention(q.float(), k.float(), v.float())
    assert lse32.dtype == torch.float32 and lse32.shape == q.shape[:-1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_low_precision_error_no_worse_than_torch(dtype, is_causal):
    shape = ((2,), 4, 4, 130, 260, 64, 64)
    q, k, v = make(shape)
    mask = torch.randn(shape[3], shape[4], dtype=torch.float64)
    ref = R.attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    ql, kl, vl, ml = q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype)
    ours = sdpa(ql, kl, vl, attn_mask=ml, is_causal=is_causal)
    full = ml + torch.zeros(shape[3], shape[4], dtype=dtype).masked_fill(
        ~torch.ones(shape[3], shape[4], dtype=torch.bool).tril(), float("-inf")) if is_causal else ml
    theirs = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=full)
    assert ours.dtype == dtype
    err_ours = (ours.double() - ref).abs().max().item()
    err_torch = (theirs.double() - ref).abs().max().item()
    assert err_ours <= 2.0 * err_torch + 1e-6, (err_ours, err_torch)


def test_strided_inputs_need_no_copy_and_match():
    # (N, L, H, E) storage viewed as (N, H, L, E), an expanded key and a sliced value
    base = torch.randn(2, 19, 3, 16, dtype=torch.float64)
    q = base.transpose(1, 2)
    k = torch.randn(2, 1, 23, 16, dtype=torch.float64).expand(2, 3, 23, 16)
    v = torch.randn(2, 3, 23, 40, dtype=torch.float64)[..., ::2]
    assert not q.is_contiguous() and k.stride(1) == 0 and v.stride(-1) == 2
    out = sdpa(q, k, v)
    torch.testing.assert_close(out, R.attention(q, k, v), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, sdpa(q.contiguous(), k.contiguous(), v.contiguous()), rtol=0, atol=0)


def test_empty_inputs():
    q, k, v = make(((2,), 2, 2, 0, 5, 8, 8))
    assert sdpa(q, k, v).shape == (2, 2, 0, 8)
    q, k, v = make(((0,), 2, 2, 3, 5, 8, 8))
    assert sdpa(q, k, v).shape == (0, 2, 3, 8)
    q, k, v = make(((2,), 2, 2, 3, 0, 8, 6))
    out, lse, _ = torch.ops.mha_ext.attention(q, k, v)
    assert out.shape == (2, 2, 3, 6) and torch.all(out == 0) and torch.all(lse == float("-inf"))


class TestHostileInputs:
    def test_huge_logits_stay_finite(self):
        q, k, v = make(SHAPES[3], dtype=torch.float32)
        q, k = q * 300.0, k * 300.0  # logits ~ 1e5 / sqrt(E)
        out = sdpa(q, k, v)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, R.attention(q, k, v).float(), rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
    def test_fully_masked_rows_give_zero(self, dtype):
        q, k, v = make(SHAPES[0], dtype=dtype)
        mask = torch.rand(q.shape[-2], k.shape[-2]) > 0.5
        mask[3] = False
        fmask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
        for m in (mask, fmask):
            out, lse, _ = torch.ops.mha_ext.attention(q, k, v, m)
            assert torch.all(out[..., 3, :] == 0) and torch.all(lse[..., 3] == float("-inf"))
            assert torch.isfinite(out).all()
            tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
            torch.testing.assert_close(out.double(), R.attention(q, k, v, attn_mask=mask), rtol=tol, atol=tol)

    def test_causal_rows_beyond_s_see_everything(self):
        # top-left: with L > S, rows i >= S see all S keys
        q, k, v = make(((1,), 1, 1, 10, 4, 8, 8))
        out = sdpa(q, k, v, is_causal=True)
        full = R.attention(q, k, v)
        torch.testing.assert_close(out[..., 4:, :], full[..., 4:, :])

    def test_nan_propagates_to_its_row_only(self):
        q, k, v = make(SHAPES[0])
        q[0, 1, 5, 2] = float("nan")
        out = sdpa(q, k, v)
        assert torch.isnan(out[0, 1, 5]).all()
        nan_rows = torch.isnan(out).any(-1)
        assert nan_rows.sum() == 1
        # a NaN key that is masked out does not leak
        q, k, v = make(SHAPES[0])
        k[..., 4, :] = float("nan")
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
        mask[:, 4] = False
        torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask), R.attention(q, k, v, attn_mask=mask))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_finfo_min_mask_matches_torch(self, dtype):
        # padding masks filled with finfo.min (not -inf): a row masked that way
        # everywhere is a uniform average in torch's softmax, not "fully masked"
        q, k, v = (torch.randn(2, 3, 9, 16, dtype=torch.float64).to(dtype) for _ in range(3))
        mask = torch.zeros(9, 9, dtype=dtype)
        mask[:, 6:] = torch.finfo(dtype).min
        mask[4] = torch.finfo(dtype).min
        out = sdpa(q, k, v, attn_mask=mask)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[..., 4, :].double(), v.double().mean(-2), rtol=tol, atol=tol)
        torch.testing.assert_close(out.double(), expected.double(), rtol=tol, atol=tol)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_nan_value_no_query_sees_does_not_leak(self, dtype):
        # causal with S > L: keys L.. are hidden from every row; NaN values
        # there (inside the 32-key padding of the bfloat16 tile path) stay out
        q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64).to(dtype),
                   torch.randn(1, 2, 50, 16, dtype=torch.float64).to(dtype),
                   torch.randn(1, 2, 50, 8, dtype=torch.float64).to(dtype))
        v[..., 44, :] = float("nan")
        out = sdpa(q, k, v, is_causal=True)
        v_ref = v.clone()
        v_ref[..., 44, :] = 0
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.double(), R.attention(q, k, v_ref, is_causal=True), rtol=tol, atol=tol)
