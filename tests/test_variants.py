"""The attention variants of mha_ext.attention / torch.ops.mha_ext.attention:
causal alignment (top-left, bottom-right), sliding windows, softcap, ALiBi,
alone and combined with masks, dropout, GQA and E != Ev; forward, logsumexp
and every gradient against the float64 reference (tests/reference.py), float64
gradcheck on the real kernels, and the registration checks."""
import pytest
import torch

import mha_ext
import reference as R

op = torch.ops.mha_ext


def _slopes(h, batch=None):
    # ALiBi's geometric slopes 2^(-8 i / H), (H,) or (N, H)
    s = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    return s if batch is None else s.expand(batch, h).clone() * torch.linspace(0.5, 1.5, batch)[:, None]


# name -> (N, Hq, Hkv, L, S, E, Ev, variant kwargs of the reference)
CASES = {
    "causal bottom-right L<S": (2, 2, 2, 7, 19, 8, 8, dict(is_causal=True, bottom_right=True)),
    "causal bottom-right L>S": (1, 2, 2, 19, 7, 8, 8, dict(is_causal=True, bottom_right=True)),
    "causal bottom-right L=1": (2, 4, 2, 1, 300, 16, 16, dict(is_causal=True, bottom_right=True)),
    "window left": (1, 2, 2, 300, 300, 16, 8, dict(window=(40, -1))),
    "window both, bottom-right": (2, 2, 1, 70, 290, 16, 16, dict(window=(33, 5), bottom_right=True)),
    "window + causal (Mistral)": (1, 2, 2, 280, 280, 16, 16, dict(is_causal=True, window=(63, -1))),
    "window right only": (1, 1, 1, 40, 50, 8, 8, dict(window=(-1, 3))),
    "window beyond the keys": (1, 1, 1, 9, 40, 8, 8, dict(window=(2, 0), bottom_right=False)),
    "softcap": (2, 2, 2, 33, 45, 16, 16, dict(softcap=2.0)),
    "softcap + causal bottom-right": (1, 4, 2, 30, 65, 16, 24, dict(softcap=1.5, is_causal=True, bottom_right=True)),
    "alibi (Hq,)": (2, 4, 4, 33, 40, 16, 16, dict(alibi="h")),
    "alibi (N, Hq) + causal bottom-right": (2, 4, 2, 20, 45, 16, 16, dict(alibi="nh", is_causal=True, bottom_right=True)),
    "everything": (2, 4, 2, 70, 300, 16, 24,
                   dict(is_causal=True, bottom_right=True, window=(100, -1), softcap=3.0, alibi="h", mask=True)),
}


def _build(name, dtype, seed=0):
    N, hq, hkv, L, S, E, Ev, kw = CASES[name]
    kw = dict(kw)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, hq, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(N, hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(N, hkv, S, Ev, generator=g, dtype=torch.float64).to(dtype)
    alibi = kw.pop("alibi", None)
    slopes = None if alibi is None else (_slopes(hq) if alibi == "h" else _slopes(hq, N))
    mask = torch.randn(L, S, generator=g, dtype=torch.float64).to(dtype) if kw.pop("mask", False) else None
    return q, k, v, mask, slopes, kw


def _op_args(kw, slopes):
    w = kw.get("window", (-1, -1))
    return dict(is_causal=kw.get("is_causal", False), window_left=w[0], window_right=w[1],
                bottom_right=kw.get("bottom_right", False), softcap=kw.get("softcap", 0.0), alibi_slopes=slopes)


def _ref_args(kw, slopes):
    return dict(is_causal=kw.get("is_causal", False), window=kw.get("window", (-1, -1)),
                bottom_right=kw.get("bottom_right", False), softcap=kw.get("softcap", 0.0), alibi_slopes=slopes)


def _run_ops(ops, q, k, v, mask, slopes, kw, go, dropout_p=0.0, rng=None):
    a = _op_args(kw, slopes)
    rng = torch.tensor([77, 3]) if rng is None else rng
    gqa = q.shape[-3] != k.shape[-3]
    out, lse, used = ops.attention(q, k, v, mask, dropout_p, a["is_causal"], None, gqa, rng, a["window_left"],
                                   a["window_right"], a["bottom_right"], a["softcap"], a["alibi_slopes"])
    want_mask = mask is not None and mask.dtype != torch.bool
    grads = ops.attention_backward(go, q, k, v, out, lse, mask, dropout_p, a["is_causal"], None, gqa, used, want_mask,
                                   a["window_left"], a["window_right"], a["bottom_right"], a["softcap"],
                                   a["alibi_slopes"])
    return out, lse, [grads[0], grads[1], grads[2]] + ([grads[3]] if want_mask else [])


def _reference(q, k, v, mask, slopes, kw, go, dtype=torch.float64, keep=None, dropout_p=0.0):
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    m = mask
    if mask is not None and mask.dtype != torch.bool:
        m = mask.detach().to(dtype).requires_grad_()
    out = R.attention(*xs, attn_mask=m, enable_gqa=q.shape[-3] != k.shape[-3], compute_dtype=dtype, keep=keep,
                      dropout_p=dropout_p, **_ref_args(kw, slopes))
    wrt = xs + ([m] if m is not None and m.dtype != torch.bool else [])
    return out.detach(), [g.detach() for g in torch.autograd.grad(out, wrt, go.to(dtype))]


def check_against_reference(ops, name, dtype, dropout_p=0.0):
    q, k, v, mask, slopes, kw = _build(name, dtype)
    go = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(9),
                     dtype=torch.float64).to(dtype)
    rng = torch.tensor([1234, 5])
    keep = None
    if dropout_p > 0.0:
        keep = R.dropout_keep(1234, 5, tuple(q.shape[:-1]) + (k.shape[-2],), dropout_p)
    out, lse, grads = _run_ops(ops, q, k, v, mask, slopes, kw, go, dropout_p, rng)
    ref_out, ref_grads = _reference(q, k, v, mask, slopes, kw, go, keep=keep, dropout_p=dropout_p)
    if dtype in (torch.float64, torch.float32):
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        for name_, a, r in zip(("out", "dq", "dk", "dv", "dmask"), [out] + grads, [ref_out] + ref_grads):
            torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol * max(1.0, r.abs().max().item()),
                                       msg=lambda s: f"{name_}: {s}")
        ref_lse = R.logsumexp(q, k, mask, kw.get("is_causal", False), None, q.shape[-3] != k.shape[-3],
                              window=kw.get("window", (-1, -1)), bottom_right=kw.get("bottom_right", False),
                              softcap=kw.get("softcap", 0.0), alibi_slopes=slopes)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    else:
        eager_out, eager_grads = _reference(q, k, v, mask, slopes, kw, go, dtype=dtype, keep=keep, dropout_p=dropout_p)
        for name_, a, r, e in zip(("out", "dq", "dk", "dv", "dmask"), [out] + grads, [ref_out] + ref_grads,
                                  [eager_out] + eager_grads):
            ea, ee = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
            assert ea <= 2.0 * ee + 1e-3 * r.abs().max().item(), (name_, ea, ee)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_variant_matches_reference(name, dtype):
    check_against_reference(op, name, dtype)


@pytest.mark.parametrize("name", ["window both, bottom-right", "softcap + causal bottom-right", "everything"])
def test_variant_with_dropout_matches_reference(name):
    check_against_reference(op, name, torch.float64, dropout_p=0.2)


@pytest.mark.parametrize("name", ["causal bottom-right L>S", "window both, bottom-right", "window right only",
                                  "softcap", "alibi (N, Hq) + causal bottom-right"])
def test_gradcheck_variant(name):
    N, hq, hkv, L, S, E, Ev, kw = CASES[name]
    q, k, v, mask, slopes, kw = _build(name, torch.float64)
    # small: gradcheck differentiates numerically
    q, k, v = q[:1, :, :6, :4], k[:1, :, :7, :4], v[:1, :, :7, :3]
    slopes = None if slopes is None else slopes[..., :hq] if slopes.dim() == 1 else slopes[:1]
    a = _op_args(kw, slopes)
    gqa = hq != hkv
    m = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, m):
        return op.attention(q, k, v, m, 0.0, a["is_causal"], None, gqa, None, a["window_left"], a["window_right"],
                            a["bottom_right"], a["softcap"], a["alibi_slopes"])[0]

    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v)) + (m,)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_functional_attention_matches_reference():
    q, k, v, mask, slopes, kw = _build("everything", torch.float64)
    out, lse = mha_ext.attention(q, k, v, mask, causal=True, alignment="bottom_right", window=(100, -1), softcap=3.0,
                                 alibi_slopes=slopes, enable_gqa=True, return_lse=True)
    ref = R.attention(q, k, v, attn_mask=mask, enable_gqa=True, **_ref_args(kw, slopes))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert lse.shape == q.shape[:-1]
    # defaults are SDPA
    torch.testing.assert_close(mha_ext.attention(q[:, :2], k, v), mha_ext.scaled_dot_product_attention(q[:, :2], k, v))


@pytest.mark.parametrize("L", [1, 4, 96])  # the decode path (few rows a key/value head) and the dense one
def test_softcap_across_score_magnitudes(L):
    # the softcap's tanh on both of its forms (a series below |s / cap| = 1/2, exponentials above) and
    # saturated: key j scaled by 10^(-6 + 9 j / S), so that each row's s / cap runs from about 1e-7 to
    # beyond 100; forward and every gradient against the float64 reference
    g = torch.Generator().manual_seed(3)
    S, E, cap = 333, 32, 4.0
    keys = torch.logspace(-6, 3, S, dtype=torch.float64).view(S, 1)
    q = torch.randn(2, 4, L, E, generator=g).requires_grad_()
    k = (torch.randn(2, 2, S, E, generator=g, dtype=torch.float64) * keys).float().requires_grad_()
    v = torch.randn(2, 2, S, 24, generator=g).requires_grad_()
    go = torch.randn(2, 4, L, 24, generator=g)
    out = mha_ext.attention(q, k, v, softcap=cap, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), go)
    xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = R.attention(*xs, softcap=cap, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, xs, go.double())
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out,) + grads, (ref,) + ref_grads):
        torch.testing.assert_close(a.double(), r, rtol=2e-5, atol=2e-5 * max(1.0, r.abs().max().item()),
                                   msg=lambda m: f"{name}: {m}")


def test_bottom_right_equals_top_left_when_square():
    q = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    a = mha_ext.attention(q, q, q, causal=True, alignment="bottom_right")
    torch.testing.assert_close(a, mha_ext.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_rows_that_see_no_key_give_zero():
    # bottom-right with L > S: the first L - S rows see no key
    q, k, v = torch.randn(1, 1, 9, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    out, lse = mha_ext.attention(q, k, v, causal=True, alignment="bottom_right", return_lse=True)
    assert torch.all(out[..., :5, :] == 0) and torch.all(lse[..., :5] == float("-inf"))
    torch.testing.assert_close(out.double(), R.attention(q, k, v, is_causal=True, bottom_right=True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["window", "softcap+alibi"])
def test_opcheck_variants(case):
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    extra = (3, 1, True, 0.0, None) if case == "window" else (-1, -1, True, 5.0, torch.rand(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    torch.library.opcheck(op.attention, (q, k, v, None, 0.0, True, None, True, None) + extra)
    out, lse, rng = op.attention(q, k, v, None, 0.0, True, None, True, None, *extra)
    torch.library.opcheck(op.attention_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, None, 0.0,
                           True, None, True, rng, False) + extra)


def test_compile_fullgraph_variants():
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    slopes = _slopes(2)

    def f(q, k, v):
        return mha_ext.attention(q, k, v, causal=True, alignment="bottom_right", window=(4, -1), softcap=2.0,
                                 alibi_slopes=slopes)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, f(q, k, v))
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(f(q, k, v).sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kwargs,message", [
    (dict(window_left=-2), r"window_left must be >= -1 \(-1: no limit\), got -2"),
    (dict(window_right=-5), r"window_right must be >= -1 \(-1: no limit\), got -5"),
    (dict(softcap=-1.0), r"softcap must be a finite number >= 0 \(0: none\), got -1"),
    (dict(softcap=float("inf")), r"softcap must be a finite number >= 0 \(0: none\), got inf"),
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must be a floating-point tensor of shape \(Hq\) = \(4\) or "
                                       r"\(N..., Hq\) = \(2, 4\), got torch.float32 of shape \(3\)"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), r"alibi_slopes must be a floating-point tensor"),
])
def test_variant_errors_eager_and_fake_say_the_same(kwargs, message):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = dict(window_left=-1, window_right=-1, bottom_right=False, softcap=0.0, alibi_slopes=None)
    args.update(kwargs)
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(RuntimeError, match=message):
        op.attention(q, q, q, None, 0.0, False, None, False, None, *args.values())
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        fargs = {n: (mode.from_tensor(a) if isinstance(a, torch.Tensor) else a) for n, a in args.items()}
        with pytest.raises(RuntimeError, match=message):
            op.attention(fq, fq, fq, None, 0.0, False, None, False, None, *fargs.values())
    with pytest.raises(ValueError, match="alignment must be 'top_left' or 'bottom_right'"):
        mha_ext.attention(q, q, q, alignment="bottom-right")


@pytest.fixture(scope="module")
def emul():
    from cuda_backends import _load_emulation

    return _load_emulation()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_variant_on_emulated_cuda_backend_matches_reference(emul, name, dtype):
    # the CUDA device code (csrc/cuda/attention_kernels.h) under the CPU
    # emulation; float16 / bfloat16 within twice eager torch's error
    check_against_reference(emul, name, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_variant_on_cuda_matches_reference(name):
    from cuda_backends import OnCuda

    check_against_reference(OnCuda(), name, torch.float16)


def test_export_variants():
    slopes = _slopes(2)

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return mha_ext.attention(q, k, v, causal=True, alignment="bottom_right", window=(8, -1), softcap=4.0,
                                     alibi_slopes=slopes)

    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    ep = torch.export.export(M(), (q, k, v))
    assert any("mha_ext.attention" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(q, k, v), M()(q, k, v))


BIG = 2 ** 63 - 1


def test_windows_wider_than_the_sequence_change_nothing():
    # windows up to 2^63 - 1 (i + offset + window must not overflow): the same as no window
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for kw in (dict(window=(-1, BIG)), dict(window=(BIG, BIG)), dict(causal=True, window=(BIG, -1)),
               dict(causal=True, alignment="bottom_right", window=(BIG, BIG))):
        out = mha_ext.attention(q, k, v, **kw)
        plain = mha_ext.attention(q, k, v, causal=kw.get("causal", False))
        torch.testing.assert_close(out, plain)
        ga = torch.autograd.grad(out.sum(), (q, k, v))
        gb = torch.autograd.grad(plain.sum(), (q, k, v))
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b)


def test_alibi_slopes_that_require_grad_are_refused():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"alibi_slopes must not require grad"):
        mha_ext.attention(q, q, q, alibi_slopes=torch.ones(2, requires_grad=True))
