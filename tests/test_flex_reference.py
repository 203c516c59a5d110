"""The attention variants against FlexAttention (torch.nn.attention.flex_attention,
run eagerly: torch's own reference implementation of a score_mod / mask_mod) on
the same inputs: mha_ext's definitions of windows, softcap, ALiBi and packed
documents are the ones FlexAttention users write."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import mha_ext
import reference as R

# (eager FlexAttention warns that it is unfused: here it is the reference, not the thing timed)
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

L, HQ, HKV, E = 203, 4, 2, 32
SLOPES = torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(HQ)])


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, L, E, generator=g, dtype=torch.float64).to(dtype) for h in (HQ, HKV, HKV)]


def _flex(q, k, v, mask_mod, score_mod=None):
    block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu")
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


CASES = {
    # name: (mha_ext.attention kwargs, mask_mod, score_mod)
    "causal": (dict(causal=True), lambda b, h, i, j: i >= j, None),
    "sliding window 40, causal": (dict(causal=True, window=(40, 0)), lambda b, h, i, j: (i >= j) & (i - j <= 40), None),
    "window 17 left, 9 right": (dict(window=(17, 9)), lambda b, h, i, j: (j >= i - 17) & (j <= i + 9), None),
    "softcap 2, causal": (dict(causal=True, softcap=2.0), lambda b, h, i, j: i >= j,
                          lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0)),
    "alibi": (dict(alibi_slopes=SLOPES), lambda b, h, i, j: i >= 0,
              lambda s, b, h, i, j: s - SLOPES.to(s.dtype)[h] * (i - j).abs()),
    "alibi, causal, softcap": (dict(causal=True, alibi_slopes=SLOPES, softcap=3.0), lambda b, h, i, j: i >= j,
                               lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0) - SLOPES.to(s.dtype)[h] * (i - j)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_variant_matches_flex_attention(name, dtype):
    kw, mask_mod, score_mod = CASES[name]
    q, k, v = _inputs(dtype)
    out = mha_ext.attention(q, k, v, enable_gqa=True, **kw)
    ref = _flex(*(t.double() for t in (q, k, v)), mask_mod, score_mod)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    else:  # within twice the error of eager ops rounding to bfloat16 (FlexAttention's float64 as the truth)
        rk = {("is_causal" if n == "causal" else n): a for n, a in kw.items()}
        eager = R.attention(q, k, v, enable_gqa=True, compute_dtype=dtype, **rk)
        err, eager_err = ((x.double() - ref).abs().max().item() for x in (out, eager))
        assert err <= 2 * eager_err + 1e-3 * ref.abs().max().item(), (err, eager_err)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_match_flex_document_mask(causal):
    # documents packed in one row: varlen_attention on the packed rows against FlexAttention's
    # document mask (with causal, top-left within each document as FlexAttention writes it)
    lens = [50, 1, 77, 30, 45]
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v = _inputs(torch.float32, seed=1)
    out = mha_ext.varlen_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, max(lens), max(lens),
                                   causal=causal, alignment="top_left")
    ref = _flex(*(t.double() for t in (q, k, v)),
                lambda b, h, i, j: (doc[i] == doc[j]) & ((i >= j) if causal else (i >= 0)))
    torch.testing.assert_close(out.transpose(0, 1).unsqueeze(0).double(), ref, rtol=2e-5, atol=2e-5)


def test_scale_matches_flex_attention():  # a scale of its own, under the softcap
    q, k, v = _inputs(torch.float32, seed=2)
    out = mha_ext.attention(q, k, v, causal=True, softcap=5.0, scale=0.3, enable_gqa=True)
    block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L, device="cpu")
    ref = flex_attention(*(t.double() for t in (q, k, v)), score_mod=lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0),
                         block_mask=block_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
