"""Rows padded with finfo.min (the padding masks of Hugging Face and most
training scripts) and huge logits: forward AND backward against the float64
reference, on every dtype, in the functional and in the module.

A query row whose keys are all masked with finfo.min is a uniform average of
V in torch's float softmax (finfo.min + score rounds to finfo.min), so its
gradient is that of a uniform average, not zero and not S times too large."""
import pytest
import torch
import torch.nn.functional as F

import mha_ext
import reference as R

sdpa = mha_ext.scaled_dot_product_attention
LOW = (torch.float16, torch.bfloat16)


def _grads(fn, inputs, g):
    out = fn(*inputs)
    return (out,) + torch.autograd.grad(out, inputs, g)


def _padding_mask(dtype, N, L, S, kind, min_of):
    """A float mask in `dtype`, filled with finfo(min_of).min where padded."""
    lo = torch.finfo(min_of).min
    if kind == "key padding":  # (N, 1, 1, S): batch 1 has every key padded, batch 0 the last 3
        m = torch.zeros(N, 1, 1, S, dtype=dtype)
        m[0, ..., S - 3:] = lo
        m[1] = lo
    elif kind == "query rows":  # (L, S): rows 1 and L - 1 padded everywhere, key 0 padded for the rest
        m = torch.zeros(L, S, dtype=dtype)
        m[:, 0] = lo
        m[1] = lo
        m[L - 1] = lo
    else:  # "per batch": (N, 1, L, S), left padding as in generate(): batch 1's first 4 keys
        m = torch.zeros(N, 1, L, S, dtype=dtype)
        m[1, ..., :4] = lo
        m[1, :, :2, :] = lo  # and its first two query rows see only padding
    return m


CASES = [
    # (q shape, kv heads, S, Ev, kwargs)
    ((2, 2, 7, 8), 2, 9, 8, {}),
    ((2, 4, 70, 16), 2, 300, 24, {"enable_gqa": True}),  # several key tiles, ragged, GQA, Ev != E
    ((2, 2, 33, 8), 2, 40, 8, {"is_causal": True}),
]


@pytest.mark.parametrize("dtype,min_of", [(torch.float64, torch.float64), (torch.float64, torch.float32),
                                          (torch.float32, torch.float32)], ids=["f64", "f64 with f32 min", "f32"])
@pytest.mark.parametrize("kind", ["key padding", "query rows", "per batch"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_padding_rows_forward_and_backward_match_reference(dtype, min_of, kind, case):
    torch.manual_seed(case)
    qs, hkv, S, ev, kw = CASES[case]
    N, hq, L, E = qs
    q = torch.randn(qs, dtype=dtype, requires_grad=True)
    k = torch.randn(N, hkv, S, E, dtype=dtype, requires_grad=True)
    v = torch.randn(N, hkv, S, ev, dtype=dtype, requires_grad=True)
    m = _padding_mask(dtype, N, L, S, kind, min_of).requires_grad_()
    g = torch.randn(N, hq, L, ev, dtype=dtype)
    ours = _grads(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, **kw), (q, k, v, m), g)
    ref_in = tuple(t.detach().double().requires_grad_() for t in (q, k, v, m))
    ref = _grads(lambda q, k, v, m: R.attention(q, k, v, attn_mask=m, **kw), ref_in, g.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), ours, ref):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * scale, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", ["key padding", "query rows"])
def test_padding_rows_low_precision_no_worse_than_torch(dtype, kind):
    torch.manual_seed(1)
    N, H, L, S, E = 2, 2, 40, 70, 32
    q64, k64, v64 = torch.randn(N, H, L, E).double(), torch.randn(N, H, S, E).double(), torch.randn(N, H, S, E).double()
    g64 = torch.randn(N, H, L, E).double()
    m = _padding_mask(dtype, N, L, S, kind, dtype)

    def run(fn, dt):
        q, k, v = (t.to(dt).requires_grad_() for t in (q64, k64, v64))
        return _grads(lambda q, k, v: fn(q, k, v, m.to(dt)), (q, k, v), g64.to(dt))

    ref = run(lambda q, k, v, m: R.attention(q, k, v, attn_mask=m), torch.float64)
    ours = run(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), dtype)
    theirs = run(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), dtype)
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        eo, et = (o.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert eo <= 2.0 * et + 1e-3 * r.abs().max().item(), (name, eo, et)


def test_issue_reproducer_value_gradient():
    # the reproducer of the report: v.grad was 0.942 0.739 0.319
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 4, requires_grad=True) for _ in range(3))
    m = torch.zeros(3, 3)
    m[1] = torch.finfo(torch.float32).min
    sdpa(q, k, v, attn_mask=m).sum().backward()
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    (torch.softmax(q2 @ k2.transpose(-1, -2) / 2 + m.double(), -1) @ v2).sum().backward()
    torch.testing.assert_close(v.grad.double(), v2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.grad.double(), q2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.grad.double(), k2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_module_key_padding_mask_filled_with_finfo_min(dtype):
    # key_padding_mask as a float mask filled with finfo.min on every key of
    # batch element 1. The reference is torch's module on its math backend:
    # torch's fused CPU backward makes these rows' gradients S times too large
    # (it too recomputes P from a logsumexp that lost log S).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    E, H, N, L = 16, 2, 3, 6
    ours = mha_ext.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    kpm = torch.zeros(N, L, dtype=dtype)
    kpm[1] = torch.finfo(dtype).min
    kpm[2, 4:] = torch.finfo(dtype).min
    x = torch.randn(N, L, E, dtype=dtype)
    results = []
    for mod in (ours, theirs):
        xi = x.clone().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):
            y, _ = mod(xi, xi, xi, key_padding_mask=kpm, need_weights=False)
        y.pow(2).sum().backward()
        results.append((y, xi.grad, [p.grad for p in mod.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y0, y1, rtol=tol, atol=tol)
    assert gx1[1].abs().max() > 0.1  # a real gradient flows through the padded element
    torch.testing.assert_close(gx0, gx1, rtol=tol, atol=tol)
    for a, b in zip(gp0, gp1):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# Huge logits: where the forward is finite, the backward is too, and both are
# as close to the float64 reference as torch's own SDPA in the same dtype.
@pytest.mark.parametrize("dtype,mul", [(torch.float64, 1e100), (torch.float32, 1e36), (torch.float32, 1e20),
                                       (torch.float32, 1e4), (torch.float16, 250.0), (torch.float16, 1e4),
                                       (torch.bfloat16, 1e37)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_huge_logits_backward_is_finite_and_no_worse_than_torch(dtype, mul, is_causal):
    torch.manual_seed(3)
    q64 = torch.randn(2, 2, 37, 16, dtype=torch.float64) * mul
    k64, v64 = torch.randn(2, 2, 45, 16, dtype=torch.float64), torch.randn(2, 2, 45, 16, dtype=torch.float64)
    g64 = torch.randn(2, 2, 37, 16, dtype=torch.float64)

    def run(fn, dt):
        q, k, v = (t.to(dtype).to(dt).requires_grad_() for t in (q64, k64, v64))
        return _grads(lambda q, k, v: fn(q, k, v, is_causal=is_causal), (q, k, v), g64.to(dt))

    ours = run(sdpa, dtype)
    theirs = run(F.scaled_dot_product_attention, dtype)
    ref = run(R.attention, torch.float64)
    eps = torch.finfo(dtype).eps
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert torch.isfinite(o).all(), name
        eo, et = (o.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        floor = 4 * eps * max(1.0, r.abs().max().item())
        assert eo <= 2.0 * et + floor, (name, eo, et)
