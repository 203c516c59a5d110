"""torch.func transforms (grad, vmap, jacrev, functional_call ensembles)
through mha_ext's functional API and module, as through torch's SDPA: each
result against torch's SDPA / module under the same transform in float64
and against the float64 reference run per item."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap

import mha_ext
import reference as R

sdpa = mha_ext.scaled_dot_product_attention


def _t(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@contextlib.contextmanager
def _no_vmap_fallback():
    """vmap's per-item loop for ops without a batching rule turned into an
    error (the op's own call under vmap raises then: checked below)."""
    was = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(was)


def test_the_fallback_switch_catches_an_op_without_a_rule():
    q = torch.randn(2, 3, 4, 8)
    with _no_vmap_fallback(), pytest.raises(RuntimeError):
        vmap(lambda q: torch.ops.mha_ext.attention(q, q, q)[0])(q)


@pytest.mark.parametrize("argnums", [0, (0, 1, 2), 3])
def test_grad_matches_torch(argnums):
    """torch.func.grad of a loss through the drop-in (GQA, a float mask
    whose gradient is asked for with argnums=3) against torch's SDPA."""
    g = torch.Generator().manual_seed(0)
    q, k, v, m = _t(g, 2, 4, 9, 8), _t(g, 2, 2, 11, 8), _t(g, 2, 2, 11, 8), _t(g, 2, 1, 9, 11)

    def loss(fn):
        return lambda q, k, v, m: (fn(q, k, v, attn_mask=m, enable_gqa=True) ** 2).sum()

    ours = grad(loss(sdpa), argnums=argnums)(q, k, v, m)
    theirs = grad(loss(F.scaled_dot_product_attention), argnums=argnums)(q, k, v, m)
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), theirs if isinstance(theirs, tuple) else (theirs,)):
        _close(a, b)


@pytest.mark.parametrize("in_dims", [(0, 0, 0, None), (0, None, None, None), (None, 1, 1, 0), (2, 0, 0, 0)],
                         ids=["all", "query only", "key/value on dim 1, mask", "query on dim 2, mask"])
def test_vmap_uses_the_batch_and_matches_per_item(in_dims):
    """vmap over the drop-in with inputs vmapped on different dims or not at
    all: every item against the reference run alone, and no per-item loop
    (torch warns when it falls back to one: the test turns that into an error)."""
    g = torch.Generator().manual_seed(1)
    B = 3
    shapes = [(4, 9, 8), (2, 11, 8), (2, 11, 6), (9, 11)]  # query (H, L, E), key, value, a bool mask (L, S)
    xs = []
    for shape, d in zip(shapes, in_dims):
        full = shape if d is None else shape[:d] + (B,) + shape[d:]
        xs.append(_t(g, *full) if len(shape) == 3 else torch.rand(*full, generator=g) > 0.3)
    fn = vmap(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, enable_gqa=True), in_dims=in_dims)
    with _no_vmap_fallback():
        out = fn(*xs)
    assert out.shape == (B, 4, 9, 6)
    for i in range(B):
        item = [x if d is None else x.select(d, i) for x, d in zip(xs, in_dims)]
        _close(out[i], R.attention(item[0], item[1], item[2], attn_mask=item[3], enable_gqa=True))


def test_per_sample_gradients_match_torch():
    """vmap(grad(...)): per-item gradients of query, key and value, causal,
    against torch's SDPA under the same transforms."""
    g = torch.Generator().manual_seed(2)
    q, k, v = _t(g, 5, 2, 7, 8), _t(g, 5, 2, 7, 8), _t(g, 5, 2, 7, 8)

    def loss(fn):
        return lambda q, k, v: fn(q, k, v, is_causal=True).tanh().sum()

    ours = vmap(grad(loss(sdpa), argnums=(0, 1, 2)))(q, k, v)
    theirs = vmap(grad(loss(F.scaled_dot_product_attention), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(ours, theirs):
        _close(a, b)


def test_jacrev_matches_torch():
    g = torch.Generator().manual_seed(3)
    q, k, v = _t(g, 1, 3, 4), _t(g, 1, 5, 4), _t(g, 1, 5, 4)
    for argnum in range(3):
        a = jacrev(lambda *x: sdpa(*x), argnums=argnum)(q, k, v)
        b = jacrev(lambda *x: F.scaled_dot_product_attention(*x), argnums=argnum)(q, k, v)
        _close(a, b)


def test_attention_variants_under_vmap_match_reference():
    """mha_ext.attention with a window, softcap and ALiBi slopes (not vmapped)
    over a vmapped query, key and value."""
    g = torch.Generator().manual_seed(4)
    q, k, v = _t(g, 3, 2, 4, 6, 8), _t(g, 3, 2, 4, 20, 8), _t(g, 3, 2, 4, 20, 8)
    slopes = torch.rand(4, generator=g, dtype=torch.float64)
    kw = dict(causal=True, alignment="bottom_right", window=(9, -1), softcap=3.0)
    with _no_vmap_fallback():
        out = vmap(lambda q, k, v: mha_ext.attention(q, k, v, alibi_slopes=slopes, **kw))(q, k, v)
    for i in range(3):
        ref = R.attention(q[i], k[i], v[i], is_causal=True, bottom_right=True, window=(9, -1), softcap=3.0,
                          alibi_slopes=slopes)
        _close(out[i], ref)


def test_module_ensemble_by_functional_call_matches_each_module():
    """The torch.func ensembling recipe: stack_module_state of three modules,
    vmap over functional_call, forward and a gradient of every stacked
    parameter, against each of torch's modules with the same weights."""
    torch.manual_seed(5)
    ours = [mha_ext.MultiheadAttention(16, 4, batch_first=True).double() for _ in range(3)]
    theirs = [torch.nn.MultiheadAttention(16, 4, batch_first=True).double() for _ in range(3)]
    for a, b in zip(ours, theirs):
        b.load_state_dict(a.state_dict())
    params, buffers = stack_module_state(ours)
    x = torch.randn(2, 7, 16, dtype=torch.float64)

    def run(p, b, x):
        return functional_call(ours[0], (p, b), (x, x, x), {"need_weights": False})[0]

    out = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    grads = vmap(grad(lambda p, b, x: run(p, b, x).pow(2).sum()), in_dims=(0, 0, None))(params, buffers, x)
    for i, m in enumerate(theirs):
        ref = m(x, x, x, need_weights=False)[0]
        _close(out[i], ref)
        ref_grads = torch.autograd.grad(ref.pow(2).sum(), list(m.parameters()))
        for (name, _), rg in zip(m.named_parameters(), ref_grads):
            _close(grads[name][i], rg)


def test_dropout_under_vmap_follows_its_randomness_flag():
    """'error' raises as torch's random ops do; 'different' gives each item its
    own mask, 'same' every item one mask: each against the reference with the
    keep mask of the dropout contract for the draw vmap made."""
    g = torch.Generator().manual_seed(6)
    q = _t(g, 3, 2, 5, 8)
    p = 0.4

    def f(q):
        return sdpa(q, q, q, dropout_p=p)

    with pytest.raises(RuntimeError, match="randomness"):
        vmap(f)(q)
    torch.manual_seed(7)
    different = vmap(f, randomness="different")(q)
    torch.manual_seed(7)
    seed, offset = torch.randint(0, 2**62, (3, 2))[0].tolist()  # the first item's draw serves the batch
    keep = R.dropout_keep(seed, offset, (3, 2, 5, 5), p)
    for i in range(3):
        _close(different[i], R.attention(q[i], q[i], q[i], keep=keep[i], dropout_p=p))
    same_q = q[:1].expand(3, 2, 5, 8)
    torch.manual_seed(8)
    same = vmap(f, randomness="same")(same_q)
    torch.manual_seed(8)
    seed, offset = torch.randint(0, 2**62, (2,)).tolist()
    ref = R.attention(q[0], q[0], q[0], keep=R.dropout_keep(seed, offset, (2, 5, 5), p), dropout_p=p)
    for i in range(3):
        _close(same[i], ref)


def test_forward_mode_matches_reference():
    """jvp and jacfwd (forward-mode AD, which torch's fused CPU kernel lacks),
    with a float mask's tangent too, against the float64 reference's."""
    g = torch.Generator().manual_seed(9)
    q, k, v, m = _t(g, 2, 4, 8), _t(g, 2, 6, 8), _t(g, 2, 6, 8), _t(g, 1, 4, 6)
    tans = [_t(g, *x.shape) for x in (q, k, v, m)]
    ours = torch.func.jvp(lambda *x: sdpa(*x[:3], attn_mask=x[3]), (q, k, v, m), tuple(tans))
    # (torch's fused CPU kernel has no forward mode: the float64 reference's)
    theirs = torch.func.jvp(lambda *x: R.attention(*x[:3], attn_mask=x[3]), (q, k, v, m), tuple(tans))
    _close(ours[0], theirs[0])
    _close(ours[1], theirs[1])
    # (torch's fused CPU kernel has no forward mode: the float64 reference's jacobian)
    _close(torch.func.jacfwd(lambda q: sdpa(q, k, v, is_causal=True))(q),
           torch.func.jacfwd(lambda q: R.attention(q, k, v, is_causal=True))(q))


def test_functionalize_runs_the_op():
    g = torch.Generator().manual_seed(10)
    q = _t(g, 2, 5, 8)
    _close(torch.func.functionalize(lambda q: sdpa(q, q, q, is_causal=True))(q),
           F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_grad_under_autocast_is_the_backward_of_what_ran():
    """Under autocast the transform differentiates the bfloat16 computation
    that ran (the inputs cast before the Function saves them; saving the
    float32 inputs gave the float32 gradient): within twice torch's error
    under the same transform against the float64 reference on the cast
    inputs, as eager autograd's gradient is."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 20, 16, generator=g) for _ in range(3))

    def loss(fn):
        def f(q):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(q, k, v, is_causal=True).float().pow(2).sum()
        return f

    ours = grad(loss(sdpa))(q)
    theirs = grad(loss(F.scaled_dot_product_attention))(q)
    leaf = q.clone().requires_grad_()
    loss(sdpa)(leaf).backward()
    xs = [t.bfloat16().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(R.attention(*xs, is_causal=True).pow(2).sum(), xs[0])[0]
    bound = 2 * (theirs.double() - ref).abs().max() + 1e-3
    assert (ours.double() - ref).abs().max() <= bound
    assert (leaf.grad.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("vmapped_mask", [False, True])
def test_module_with_key_padding_under_transforms_matches_torch(vmapped_mask):
    """The module with a bool key_padding_mask under grad and vmap (the dense
    path there: the varlen op has no rules), against torch's module."""
    torch.manual_seed(12)
    ours = mha_ext.MultiheadAttention(16, 4, batch_first=True).double()
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 2, 7, 16, dtype=torch.float64)
    pad = torch.zeros(3, 2, 7, dtype=torch.bool)
    pad[:, 1, 5:] = True
    pad[1, 0, 3:] = True
    in_dims = (0, 0) if vmapped_mask else (0, None)
    masks = pad if vmapped_mask else pad[0]

    def run(m):
        return lambda x, kpm: m(x, x, x, key_padding_mask=kpm)[0].tanh().sum()

    a = vmap(grad(run(ours)), in_dims=in_dims)(x, masks)
    b = vmap(grad(run(theirs)), in_dims=in_dims)(x, masks)
    _close(a, b)


def test_varlen_under_a_transform_says_so():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    x = torch.randn(5, 2, 8)
    with pytest.raises(RuntimeError, match="varlen_attention does not support torch.func transforms"):
        grad(lambda x: mha_ext.varlen_attention(x, x, x, cu, cu, 3, 3).sum())(x)
