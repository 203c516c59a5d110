"""Backward of the fused op: float64 gradcheck on the real kernels, parity with
autograd through the float64 reference, mask gradients, determinism."""
import pytest
import torch

import mha_ext
import reference as R

sdpa = mha_ext.scaled_dot_product_attention


def leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


# name -> (q shape, k shape, v shape, kwargs builder)
CASES = {
    "plain": ((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 3), lambda: {}),
    "causal L<S": ((1, 2, 4, 4), (1, 2, 7, 4), (1, 2, 7, 4), lambda: {"is_causal": True}),
    "causal L>S": ((1, 2, 7, 4), (1, 2, 3, 4), (1, 2, 3, 5), lambda: {"is_causal": True}),
    "L=1": ((2, 1, 1, 4), (2, 1, 5, 4), (2, 1, 5, 4), lambda: {}),
    "gqa": ((1, 4, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), lambda: {"enable_gqa": True}),
    "scale": ((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4), lambda: {"scale": 0.7}),
    "bool mask": ((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 6, 4), lambda: {"attn_mask": torch.rand(5, 6) > 0.4}),
    "bool mask + fully masked row": ((1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4),
                                     lambda: {"attn_mask": torch.tensor([[1] * 6, [0] * 6, [1, 0] * 3, [0, 1] * 3, [1] * 6]).bool()}),
    "no batch dims": ((2, 5, 4), (2, 6, 4), (2, 6, 4), lambda: {}),
    "two batch dims": ((2, 1, 2, 3, 4), (2, 1, 2, 4, 4), (2, 1, 2, 4, 2), lambda: {"is_causal": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck(name):
    qs, ks, vs, kw = CASES[name]
    q, k, v = leaf(*qs), leaf(*ks), leaf(*vs)
    kwargs = kw()
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, **kwargs), (q, k, v))


@pytest.mark.parametrize("mask_shape", [(5, 6), (2, 1, 1, 6), (2, 2, 5, 6), (1, 6)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_float_mask(mask_shape, is_causal):
    q, k, v = leaf(2, 2, 5, 4), leaf(2, 2, 6, 4), leaf(2, 2, 6, 3)
    m = leaf(*mask_shape)
    assert torch.autograd.gradcheck(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, is_causal=is_causal), (q, k, v, m))


def test_gradcheck_dropout_fixed_seed():
    q, k, v = leaf(1, 2, 5, 4), leaf(1, 2, 7, 4), leaf(1, 2, 7, 3)
    m = leaf(5, 7)
    rng = torch.tensor([1234, 5], dtype=torch.int64)

    def f(q, k, v, m):
        return torch.ops.mha_ext.attention(q, k, v, m, 0.3, True, None, False, rng)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("mask_shape", [(1, 4, 150, 300), (150, 300)], ids=["per-head mask", "shared mask"])
def test_backward_matches_reference(dtype, is_causal, mask_shape):
    # several query and key tiles, GQA, E != Ev, strided grad_out
    q, k, v = leaf(2, 4, 150, 32, dtype=dtype), leaf(2, 2, 300, 32, dtype=dtype), leaf(2, 2, 300, 48, dtype=dtype)
    m = leaf(*mask_shape, dtype=dtype)
    g = torch.randn(2, 150, 4, 48, dtype=dtype).transpose(1, 2)
    out = sdpa(q, k, v, attn_mask=m, is_causal=is_causal, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v, m), g)
    ref = R.attention(q, k, v, attn_mask=m, is_causal=is_causal, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v, m), g.double())
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    for a, b in zip(grads, ref_grads):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def _tile_hiding_mask(B, L, S, per_head):
    """Bool masks that hide whole key tiles (256 keys) from whole row blocks (64 rows): batch 0 a
    causal mask given as a bool mask (the tiles above the diagonal), batch 1 a prefix of 300 keys
    (a StaticCache's written rows), batch 2 keys 300-599 only (hidden tiles on both sides) and a
    query row that sees none; per head (B, 2, L, S) the second head shows batch 1 one more tile."""
    m = torch.zeros(B, 2 if per_head else 1, L, S, dtype=torch.bool)
    m[0] = torch.ones(L, S, dtype=torch.bool).tril(S - L)
    m[1, :, :, :300] = True
    m[2, :, :, 300:600] = True
    m[2, :, 5] = False
    if per_head:
        m[1, 1, :, 300:560] = True
    return m


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True], ids=["(B, 1, L, S)", "(B, H, L, S)"])
def test_bool_mask_hiding_whole_tiles_matches_reference(dtype, per_head):
    # the kernels skip the tiles (forward) and row blocks (backward) a bool mask
    # hides from every row: outputs, logsumexp and gradients against the float64
    # reference; NaN keys and infinite values in the hidden tiles never reach
    # them (as in the tiles a window hides)
    B, L, S = 3, 200, 1100
    q, k, v = leaf(B, 2, L, 32, dtype=dtype), leaf(B, 2, S, 32, dtype=dtype), leaf(B, 2, S, 24, dtype=dtype)
    m = _tile_hiding_mask(B, L, S, per_head)
    g = torch.randn(B, 2, L, 24, dtype=dtype)
    out = sdpa(q, k, v, attn_mask=m)
    grads = torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = R.attention(qd, kd, vd, attn_mask=m)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), g.double())
    if dtype == torch.bfloat16:  # within twice plain eager torch's error in the dtype
        eager = R.attention(q.detach(), k.detach(), v.detach(), attn_mask=m, compute_dtype=dtype)
        ea, ee = (out.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
        assert ea <= 2 * ee + 1e-3, (ea, ee)
    else:
        tol = 1e-9 if dtype == torch.float64 else 2e-4
        torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)
    assert torch.equal(out[2, :, 5], torch.zeros_like(out[2, :, 5]))
    # poison keys and values in tiles hidden from every row of some batch
    k2, v2 = k.detach().clone(), v.detach().clone()
    for b, j in ((1, 800), (2, 100), (2, 900)):
        k2[b, :, j] = float("nan")
        v2[b, :, j] = float("inf")
    q2, k2, v2 = (t.requires_grad_() for t in (q.detach().clone(), k2, v2))
    out2 = sdpa(q2, k2, v2, attn_mask=m)
    grads2 = torch.autograd.grad(out2, (q2, k2, v2), g)
    assert torch.equal(out2, out) and torch.equal(grads2[0], grads[0])
    keep = torch.ones(S, dtype=torch.bool)
    keep[[100, 800, 900]] = False
    for a, b in zip(grads2[1:], grads[1:]):
        assert torch.equal(a[:, :, keep], b[:, :, keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_large_shared_mask_matches_reference(dtype, is_causal, mask_kind):
    # a mask shared by the heads and larger than L2 (700 x 800 elements, over
    # 2 MiB in float32) changes the order of work: the forward runs chunk-major
    # with heads inner, the backward runs heads in pairs
    q, k, v = leaf(1, 4, 700, 16, dtype=dtype), leaf(1, 4, 800, 16, dtype=dtype), leaf(1, 4, 800, 8, dtype=dtype)
    if mask_kind == "float":
        m = leaf(700, 800, dtype=dtype)
    else:
        m = torch.rand(700, 800) > 0.2
    g = torch.randn(1, 4, 700, 8, dtype=dtype)
    out = sdpa(q, k, v, attn_mask=m, is_causal=is_causal)
    ref = R.attention(q, k, v, attn_mask=m, is_causal=is_causal)
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol)
    inputs = (q, k, v, m) if mask_kind == "float" else (q, k, v)
    grads = torch.autograd.grad(out, inputs, g)
    ref_grads = torch.autograd.grad(ref, inputs, g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "shared mask"])
def test_backward_low_precision_no_worse_than_torch(dtype, masked):
    import torch.nn.functional as F
    shape_q, shape_kv = (2, 4, 130, 64), (2, 4, 200, 64)
    q64, k64, v64 = torch.randn(shape_q).double(), torch.randn(shape_kv).double(), torch.randn(shape_kv).double()
    g64 = torch.randn(shape_q).double()
    m64 = torch.randn(130, 200).double() if masked else None

    def grads(fn, dt):
        q, k, v = (t.to(dt).requires_grad_() for t in (q64, k64, v64))
        m = None if m64 is None else m64.to(dt)
        return torch.autograd.grad(fn(q, k, v, m), (q, k, v), g64.to(dt))

    ref = grads(lambda q, k, v, m: R.attention(q, k, v, attn_mask=m), torch.float64)
    ours = grads(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), dtype)
    theirs = grads(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), dtype)
    for o, t, r in zip(ours, theirs, ref):
        assert o.dtype == dtype
        eo, et = (o.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert eo <= 2.0 * et + 1e-6, (eo, et)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "float -inf"])
def test_fully_masked_row_gradients_match_reference(dtype, mask_kind):
    # rows 2 (every key masked) and, with causal, none else: output 0 and no
    # gradient from them; every gradient (q, k, v and a float mask's) against
    # the float64 reference, GQA, several key tiles
    g = torch.Generator().manual_seed(5)
    q64, k64 = torch.randn(2, 4, 9, 8, generator=g).double(), torch.randn(2, 2, 300, 8, generator=g).double()
    v64, go64 = torch.randn(2, 2, 300, 6, generator=g).double(), torch.randn(2, 4, 9, 6, generator=g).double()
    allowed = torch.rand(9, 300, generator=g) > 0.3
    allowed[2] = False
    mask = allowed if mask_kind == "bool" else torch.zeros(9, 300).masked_fill(~allowed, float("-inf"))

    def run(fn, dt):
        xs = [t.to(dtype).to(dt).requires_grad_() for t in (q64, k64, v64)]
        m = mask if mask.dtype == torch.bool else mask.to(dt).requires_grad_()
        wrt = xs + ([m] if m.dtype != torch.bool else [])
        out = fn(*xs, attn_mask=m, enable_gqa=True)
        return [out] + list(torch.autograd.grad(out, wrt, go64.to(dtype).to(dt)))

    ours = run(sdpa, dtype)
    ref = run(R.attention, torch.float64)
    eager = run(lambda *a, **kw: R.attention(*a, **kw, compute_dtype=dtype), dtype)
    assert torch.all(ours[0][..., 2, :] == 0) and torch.all(ours[1][..., 2, :] == 0)
    for o, r, e in zip(ours, ref, eager):
        assert torch.isfinite(o).all()
        if dtype in (torch.float64, torch.float32):
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            torch.testing.assert_close(o.double(), r, rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
        else:
            eo, ee = (o.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
            assert eo <= 2.0 * ee + 1e-3 * r.abs().max().item(), (eo, ee)


@pytest.mark.parametrize("B,Hkv,L,S", [(2, 2, 200, 260), (1, 4, 700, 800)], ids=["small mask", "mask over L2"])
def test_backward_independent_of_thread_count(B, Hkv, L, S):
    # with the mask over L2 (2.2 MB), 1 and 2 threads run the backward's heads
    # in pairs and 3 threads one by one: the results must not differ by a bit
    q, k, v = (leaf(B, 4, L, 32, dtype=torch.float32), leaf(B, Hkv, S, 32, dtype=torch.float32),
               leaf(B, Hkv, S, 32, dtype=torch.float32))
    m = leaf(L, S, dtype=torch.float32)
    g = torch.randn(B, 4, L, 32)
    results = []
    old = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            out = sdpa(q, k, v, attn_mask=m, enable_gqa=True)
            results.append(torch.autograd.grad(out, (q, k, v, m), g))
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_concurrent_callers_get_bit_equal_results():
    # four Python threads calling forward and backward at once (the op runs
    # without the GIL), on different inputs, dtypes and masks: each result
    # equals the one computed alone
    import threading

    def work(i):
        g = torch.Generator().manual_seed(i)
        dtype = (torch.float32, torch.float64, torch.bfloat16, torch.float32)[i]
        q, k, v = (torch.randn(2, 4, 150 + 10 * i, 32, generator=g).to(dtype).requires_grad_() for _ in range(3))
        m = torch.randn(150 + 10 * i, 150 + 10 * i, generator=g).to(dtype)
        rng = torch.tensor([100 + i, 7])
        out = torch.ops.mha_ext.attention(q, k, v, m, 0.1 * (i % 2), i == 3, None, False, rng)[0]
        return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    alone = [work(i) for i in range(4)]
    together = [None] * 4

    def run(i):
        for _ in range(3):
            together[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# Second order: backward(create_graph=True) takes its gradients from a
# differentiable composite of the forward, so gradgradcheck runs through it.
GRADGRAD_CASES = {
    "plain": ((1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 2), lambda: {}),
    "causal L>S": ((1, 1, 5, 3), (1, 1, 3, 3), (1, 1, 3, 3), lambda: {"is_causal": True}),
    "gqa": ((1, 4, 3, 3), (1, 2, 4, 3), (1, 2, 4, 3), lambda: {"enable_gqa": True}),
    "bool mask + fully masked row": ((1, 2, 3, 3), (1, 2, 4, 3), (1, 2, 4, 3),
                                     lambda: {"attn_mask": torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]]).bool()}),
    "bool mask broadcast + causal": ((2, 2, 4, 3), (2, 2, 4, 3), (2, 2, 4, 3),
                                     lambda: {"attn_mask": torch.tensor([[1, 1, 0, 1]]).bool(), "is_causal": True}),
    "two batch dims": ((2, 1, 1, 3, 3), (2, 1, 1, 4, 3), (2, 1, 1, 4, 2), lambda: {"scale": 0.7}),
}


@pytest.mark.parametrize("name", list(GRADGRAD_CASES))
def test_gradgradcheck(name):
    qs, ks, vs, kw = GRADGRAD_CASES[name]
    q, k, v = leaf(*qs), leaf(*ks), leaf(*vs)
    kwargs = kw()
    assert torch.autograd.gradgradcheck(lambda q, k, v: sdpa(q, k, v, **kwargs), (q, k, v))


@pytest.mark.parametrize("mask_shape", [(3, 4), (2, 1, 1, 4), (2, 2, 3, 4)])
def test_gradgradcheck_float_mask(mask_shape):
    q, k, v, m = leaf(2, 2, 3, 3), leaf(2, 2, 4, 3), leaf(2, 2, 4, 3), leaf(*mask_shape)
    assert torch.autograd.gradgradcheck(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, is_causal=True), (q, k, v, m))


def test_gradgradcheck_dropout_fixed_seed():
    q, k, v, m = leaf(1, 2, 3, 3), leaf(1, 2, 4, 3), leaf(1, 2, 4, 2), leaf(3, 4)
    rng = torch.tensor([1234, 5], dtype=torch.int64)

    def f(q, k, v, m):
        return torch.ops.mha_ext.attention(q, k, v, m, 0.3, True, None, False, rng)[0]

    assert torch.autograd.gradgradcheck(f, (q, k, v, m))


def test_second_order_matches_reference():
    # a gradient penalty: d/dq of |dL/dk|^2, against autograd through the reference
    q, k, v = leaf(2, 4, 6, 5), leaf(2, 2, 7, 5), leaf(2, 2, 7, 4)
    m = torch.rand(6, 7) > 0.3
    results = []
    for fn in (sdpa, R.attention):
        out = fn(q, k, v, attn_mask=m, is_causal=True, enable_gqa=True)
        (gk,) = torch.autograd.grad(out.pow(2).sum(), k, create_graph=True)
        results.append(torch.autograd.grad(gk.pow(2).sum(), (q, k, v)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_create_graph_first_order_equals_fused():
    q, k, v = leaf(1, 2, 9, 4, dtype=torch.float32), leaf(1, 2, 11, 4, dtype=torch.float32), leaf(1, 2, 11, 4, dtype=torch.float32)
    out = sdpa(q, k, v, is_causal=True)
    g = torch.randn_like(out)
    fused = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    composite = torch.autograd.grad(out, (q, k, v), g, create_graph=True)
    for a, b in zip(fused, composite):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)


def test_gradient_of_a_direct_backward_call_is_refused_not_silently_zero():
    q = leaf(1, 1, 3, 4)
    out, lse, rng = torch.ops.mha_ext.attention(q, q, q)
    gq, _, _, _ = torch.ops.mha_ext.attention_backward(torch.ones_like(out), q, q, q, out, lse, None, 0.0, False,
                                                       None, False, rng, False)
    with pytest.raises(RuntimeError, match="attention_backward is not differentiable"):
        torch.autograd.grad(gq.sum(), q)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.6, 3.0])
def test_sharp_softmax_gradient_error_is_that_of_the_rounded_output(dtype, scale):
    # With a sharp softmax (L = 1, large scale) dq and dk are small and their
    # error is dominated by D = rowsum(dO * O) taken from the output as
    # rounded to the dtype: dq's error is scale * dO.(O_rounded - O) * P K.
    # torch's fused CPU backward reads the rounded output too (its errors
    # come and go with its last-bit roundings of O). The floor is the float64
    # gradient with D from the correctly rounded output; ours stays within
    # 1.5x of it (+ an ulp-sized term), case by case.
    worst = 0.0
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64).to(dtype).double() for n in (1, 32, 32))
        go = torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64).to(dtype).double()
        p = torch.softmax(q @ k.transpose(-1, -2) * scale, -1)
        o = p @ v
        dp = go @ v.transpose(-1, -2)

        def grads(d):  # dq, dk of softmax attention given D
            ds = p * (dp - d)
            return scale * ds @ k, scale * ds.transpose(-1, -2) @ q

        d = (go * o).sum(-1, keepdim=True)
        exact = grads(d)
        floor = grads((go * o.to(dtype).double()).sum(-1, keepdim=True))
        # magnitude of the summed terms, for the float32 arithmetic inside
        mag_ds = p * (dp.abs() + d.abs())
        mags = (scale * mag_ds @ k.abs(), scale * mag_ds.transpose(-1, -2) @ q.abs())
        qs, ks, vs = (t.to(dtype).requires_grad_() for t in (q, k, v))
        out = sdpa(qs, ks, vs, scale=scale)
        ours = torch.autograd.grad(out, (qs, ks), go.to(dtype))
        for a, f, e, mag in zip(ours, floor, exact, mags):
            err, err_floor = (a.double() - e).abs().max().item(), (f - e).abs().max().item()
            # + the rounding of the result to the dtype and float32 rounding of the sums
            allowed = 1.5 * err_floor + torch.finfo(dtype).eps * e.abs().max().item() + 1e-5 * mag.max().item()
            assert err <= allowed, (seed, err, err_floor)
            worst = max(worst, err / allowed)
    assert worst > 0.0
