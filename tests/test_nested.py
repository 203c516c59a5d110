"""mha_ext.scaled_dot_product_attention on nested tensors of torch's jagged
layout: (B, H, j, E) inputs, each sequence attending to its own keys. Every
output and gradient against the float64 reference run on each sequence alone
(tests/reference.py), and against torch's own SDPA on the same nested tensors
where torch runs on this machine; dropout against the reference's keep mask;
views with holes; inputs ragged on dim 1; compile(fullgraph); the errors."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import mha_ext
import reference as R

sdpa = mha_ext.scaled_dot_product_attention

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")


def _nested(lengths, heads, dim, dtype, g):
    """A leaf nested tensor (B, j, heads * dim) and its SDPA view (B, heads, j, dim)."""
    leaf = torch.nested.nested_tensor(
        [torch.randn(n, heads * dim, generator=g, dtype=torch.float64).to(dtype) for n in lengths],
        layout=torch.jagged, requires_grad=True)
    return leaf, leaf.unflatten(-1, [heads, dim]).transpose(1, 2)


def _sequences(x):
    """The (H, n, D) sequences of an SDPA-shaped jagged tensor, as dense float64 leaves."""
    vals, off = x.transpose(1, 2).values().detach(), x.transpose(1, 2).offsets()
    lens = x.transpose(1, 2).lengths()
    lens = off[1:] - off[:-1] if lens is None else lens
    return [vals[int(a):int(a) + int(n)].transpose(0, 1).double().requires_grad_() for a, n in zip(off[:-1], lens)]


def _grads(leaves, out_nested, go_seqs):
    """Gradients of sum(out * go) w.r.t. the leaves' buffers."""
    go = torch.cat([g.transpose(0, 1) for g in go_seqs]).to(out_nested.dtype)
    return torch.autograd.grad(out_nested.transpose(1, 2).values(), leaves, go)


# name -> (query lengths, key lengths, Hq, Hkv, E, Ev, keywords)
CASES = {
    "self": ([5, 17, 1, 40], None, 2, 2, 16, 16, {}),
    "self causal": ([5, 17, 1, 40], None, 2, 2, 16, 16, {"is_causal": True}),
    "cross, causal top-left": ([30, 9, 4], [20, 40, 4], 2, 2, 16, 16, {"is_causal": True}),
    "gqa, E != Ev, scale": ([33, 2, 70], [33, 50, 70], 4, 2, 16, 8, {"enable_gqa": True, "scale": 0.3}),
    "long keys": ([3, 1], [700, 333], 4, 4, 32, 32, {}),
    "empty queries, empty keys": ([0, 0, 4], [5, 0, 0], 2, 1, 8, 16, {"enable_gqa": True, "is_causal": True}),
    "every query empty": ([0, 0], [4, 0], 2, 2, 8, 8, {}),
}


def _check_case(name, dtype, case=None, seed=0):
    lq, lk, hq, hkv, E, Ev, kw = CASES[name] if case is None else case
    g = torch.Generator().manual_seed(seed)
    qn, q = _nested(lq, hq, E, dtype, g)
    kn, k = _nested(lk or lq, hkv, E, dtype, g)
    vn, v = _nested(lk or lq, hkv, Ev, dtype, g)
    out = sdpa(q, k, v, **kw)
    assert out.is_nested and out.shape[0] == len(lq) and out.shape[1] == hq and out.shape[3] == Ev
    assert out.shape[2] == q.shape[2]  # the query's own ragged size
    qs, ks, vs = _sequences(q), _sequences(k), _sequences(v)
    gos = [torch.randn(hq, n, Ev, generator=g, dtype=torch.float64) for n in lq]
    got = out.transpose(1, 2).values()
    got_grads = _grads([qn, kn, vn], out, gos)

    def reference(compute_dtype):
        xs = [[t.detach().to(compute_dtype).requires_grad_() for t in seqs] for seqs in (qs, ks, vs)]
        outs = [R.attention(a, b, c, compute_dtype=compute_dtype, **kw) for a, b, c in zip(*xs)]
        grads = torch.autograd.grad(outs, [t for seqs in xs for t in seqs], [x.to(compute_dtype) for x in gos])
        n = len(lq)
        packed = [torch.cat([gr.transpose(0, 1) for gr in grads[i * n:(i + 1) * n]]).double() for i in range(3)]
        packed = [p.flatten(1) for p in packed]
        return torch.cat([o.transpose(0, 1) for o in outs]).double().detach(), packed

    ref, ref_grads = reference(torch.float64)
    mine = [gr.values().double() for gr in got_grads]
    if dtype in (torch.float64, torch.float32):
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        for what, a, r in zip(("out", "dq", "dk", "dv"), [got.double()] + mine, [ref] + ref_grads):
            scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
            torch.testing.assert_close(a, r, rtol=tol, atol=tol * scale, msg=lambda s: f"{what}: {s}")
    else:  # no worse than plain eager PyTorch in the dtype
        eager, eager_grads = reference(dtype)
        for what, a, r, e in zip(("out", "dq", "dk", "dv"), [got.double()] + mine, [ref] + ref_grads,
                                 [eager] + eager_grads):
            assert a.shape == r.shape, (what, a.shape, r.shape)
            if r.numel() == 0:  # (every sequence empty)
                continue
            ea, ee = (a - r).abs().max().item(), (e - r).abs().max().item()
            assert ea <= 2.0 * ee + 1e-3 * r.abs().max().item(), (what, ea, ee)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_jagged_sdpa_matches_reference(name, dtype):
    _check_case(name, dtype)


def _random_case(seed):
    """A seeded draw: 1-5 sequences of 0-80 query rows (key rows of their own
    for cross attention), GQA or not, E != Ev, causal or not, a scale."""
    g = torch.Generator().manual_seed(1000 + seed)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def length():  # empty a quarter of the time
        return 0 if ri(0, 3) == 0 else ri(1, 80)

    B = ri(1, 5)
    lq = [length() for _ in range(B)]
    lk = None if ri(0, 1) else [length() for _ in range(B)]
    hkv = ri(1, 3)
    hq = hkv * ri(1, 3)
    E, Ev = 8 * ri(1, 4), 8 * ri(1, 4)
    kw = {}
    if hq != hkv:
        kw["enable_gqa"] = True
    if ri(0, 1):
        kw["is_causal"] = True
    if ri(0, 1):
        kw["scale"] = 0.1 + ri(0, 10) / 10
    return lq, lk, hq, hkv, E, Ev, kw


@pytest.mark.parametrize("seed", range(32))
def test_jagged_sdpa_random_layouts_match_reference(seed):
    """Seeded random nested layouts (empty sequences a quarter of the time,
    cross attention, GQA, E != Ev, causal, scale) in float32, float64 and
    bfloat16 in turn: output and every gradient against the float64
    reference per sequence."""
    dtype = (torch.float32, torch.float64, torch.bfloat16)[seed % 3]
    _check_case(None, dtype, case=_random_case(seed), seed=seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_jagged_sdpa_matches_torch_on_the_same_nested_tensors(dtype):
    """torch's own SDPA on jagged inputs (its CPU path: each sequence copied
    into a strided nested tensor through its math kernel), output and the
    gradients of the nested leaves."""
    g = torch.Generator().manual_seed(1)
    lens = [7, 30, 1, 12]
    (qn, q), (kn, k), (vn, v) = (_nested(lens, 3, 8, dtype, g) for _ in range(3))
    ours, theirs = sdpa(q, k, v, scale=0.5), F.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert ours.shape == theirs.shape
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours.values(), theirs.values(), rtol=tol, atol=tol)
    go = torch.randn(ours.values().shape, generator=g, dtype=torch.float64).to(dtype)
    mine = torch.autograd.grad(ours.values(), [qn, kn, vn], go, retain_graph=True)  # (the views' graph is shared)
    ref = torch.autograd.grad(theirs.values(), [qn, kn, vn], go)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.values(), b.values(), rtol=tol, atol=tol)


def test_jagged_output_adds_to_the_query_and_empty_sequences():
    g = torch.Generator().manual_seed(2)
    (qn, q), (kn, k), (vn, v) = (_nested([4, 0, 9], 2, 8, torch.float64, g) for _ in range(3))
    out = sdpa(q, k, v, is_causal=True)
    res = out + q  # the same ragged size j as the query
    assert res.shape == q.shape
    vals = out.transpose(1, 2).values()
    assert vals.shape == (13, 2, 8)
    for (a, e), qs, ks, vs in zip([(0, 4), (4, 13)], *[[s for s in _sequences(t) if s.shape[1]] for t in (q, k, v)]):
        torch.testing.assert_close(vals[a:e].transpose(0, 1), R.attention(qs, ks, vs, is_causal=True).detach(),
                                   rtol=1e-12, atol=1e-12)


def test_jagged_views_with_holes_match_reference():
    """torch.nested.narrow's views (offsets and lengths: rows between the
    sequences): the rows gathered, the output on the query's rows."""
    g = torch.Generator().manual_seed(3)
    B, T, H, E = 3, 12, 2, 8

    def narrowed(start, length):
        base = torch.randn(B, T, H * E, generator=g, dtype=torch.float64, requires_grad=True)
        nt = torch.nested.narrow(base.view(B, T, H, E), 1, torch.tensor(start), torch.tensor(length),
                                 layout=torch.jagged)
        return base, nt.transpose(1, 2)

    (qb, q), (kb, k), (vb, v) = narrowed([0, 2, 1], [5, 3, 7]), narrowed([1, 0, 4], [6, 2, 8]), \
        narrowed([1, 0, 4], [6, 2, 8])
    out = sdpa(q, k, v, is_causal=True)
    assert out.transpose(1, 2).lengths() is not None and out.shape[2] == q.shape[2]
    outs = out.transpose(1, 2)
    go = torch.randn(outs.values().shape, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(outs.values(), [qb, kb, vb], go, retain_graph=True)
    refs_q, refs_k, refs_v = ([b[i, s:s + n].view(n, H, E).transpose(0, 1) for i, (s, n) in enumerate(sl)]
                              for b, sl in ((qb, [(0, 5), (2, 3), (1, 7)]), (kb, [(1, 6), (0, 2), (4, 8)]),
                                            (vb, [(1, 6), (0, 2), (4, 8)])))
    ref_outs = [R.attention(a, b, c, is_causal=True) for a, b, c in zip(refs_q, refs_k, refs_v)]
    off = outs.offsets()
    gos = []
    for i, (r, n) in enumerate(zip(ref_outs, [5, 3, 7])):
        a = int(off[i])
        torch.testing.assert_close(outs.values()[a:a + n].transpose(0, 1), r.detach(), rtol=1e-12, atol=1e-12)
        gos.append(go[a:a + n].transpose(0, 1))
    ref = torch.autograd.grad(ref_outs, [qb, kb, vb], gos)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_jagged_dropout_matches_reference_keep_mask():
    g = torch.Generator().manual_seed(4)
    lens, H, E, p = [6, 20, 3], 2, 8, 0.3
    (_, q), (_, k), (_, v) = (_nested(lens, H, E, torch.float64, g) for _ in range(3))
    torch.manual_seed(123)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()  # what the call draws
    torch.manual_seed(123)
    out = sdpa(q, k, v, dropout_p=p).transpose(1, 2).values()
    keep = R.dropout_keep(seed, offset, (H, sum(lens), max(lens)), p)  # row ids: h * total + packed row
    a = 0
    for qs, ks, vs, n in zip(_sequences(q), _sequences(k), _sequences(v), lens):
        ref = R.attention(qs, ks, vs, keep=keep[:, a:a + n, :n], dropout_p=p)
        torch.testing.assert_close(out[a:a + n].transpose(0, 1), ref.detach(), rtol=1e-12, atol=1e-12)
        a += n
    zeros = sdpa(q, k, v, dropout_p=1.0)  # as torch: everything dropped
    assert zeros.is_nested and bool((zeros.values() == 0).all())


def test_jagged_on_dim_1_runs_each_item_dense():
    """(B, j, L, E), ragged on dim 1: B x j dense items of L rows, as torch's
    own path for such inputs."""
    g = torch.Generator().manual_seed(5)
    items = [3, 1, 4]

    def nested():
        return torch.nested.nested_tensor([torch.randn(n, 2, 6, 8, generator=g, dtype=torch.float64)[:, 0]
                                           for n in items], layout=torch.jagged, requires_grad=True)

    q, k, v = nested(), nested(), nested()
    out = sdpa(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.values(), ref.values(), rtol=1e-12, atol=1e-12)
    direct = R.attention(q.values(), k.values(), v.values(), is_causal=True)
    torch.testing.assert_close(out.values(), direct.detach(), rtol=1e-12, atol=1e-12)


def _compile_inputs(seed=6, lq=(5, 9, 3), lk=(7, 2, 12), H=4, E=16):
    """Dense leaves (total, H * E) and SDPA views of them as nested tensors;
    key and value share their offsets (as projections of one input do)."""
    g = torch.Generator().manual_seed(seed)
    off_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist())
    off_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist())
    leaves = [torch.randn(sum(n), H * E, generator=g, requires_grad=True) for n in (lq, lk, lk)]
    views = [torch.nested.nested_tensor_from_jagged(x, o).unflatten(-1, [H, E]).transpose(1, 2)
             for x, o in zip(leaves, (off_q, off_k, off_k))]
    return leaves, views


def test_jagged_compile_fullgraph_matches_eager():
    """compile(fullgraph=True) against eager, bit-equal: one call (forward and
    gradients), and a chained call whose second takes the first's output (no
    cached length of its own) for query and key."""
    torch._dynamo.reset()

    def f(q, k, v):
        return sdpa(q, k, v, is_causal=True)

    def chained(q, k, v):
        o = mha_ext.attention(q, k, v, causal=True, alignment="bottom_right")
        return sdpa(o, o, o)

    for fn in (f, chained):
        leaves, (q, k, v) = _compile_inputs()
        compiled = torch.compile(fn, fullgraph=True)(q, k, v)
        leaves_e, (q, k, v) = _compile_inputs()
        eager = fn(q, k, v)
        torch.testing.assert_close(compiled.values(), eager.values(), rtol=0, atol=0)
        go = torch.randn(eager.values().shape, generator=torch.Generator().manual_seed(7))
        a = torch.autograd.grad(compiled.values(), leaves, go)
        b = torch.autograd.grad(eager.values(), leaves_e, go)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_jagged_compile_refuses_what_a_graph_cannot_read():
    """Under compile: a view with holes, and a value whose offsets are not the
    key's (eager compares their lengths' values), each a clear error."""
    torch._dynamo.reset()
    _, (q, k, v) = _compile_inputs()
    _, (_, k2, _) = _compile_inputs(seed=8)  # the same lengths, other offsets
    with pytest.raises(Exception, match="share their offsets"):
        torch.compile(lambda q, k, v: sdpa(q, k, v), fullgraph=True)(q, k, k2)
    base = torch.randn(3, 12, 4, 16)
    holes = torch.nested.narrow(base, 1, torch.tensor([0, 2, 1]), torch.tensor([5, 3, 7]),
                                layout=torch.jagged).transpose(1, 2)
    with pytest.raises(Exception, match="holes"):
        torch.compile(lambda q: sdpa(q, q, q), fullgraph=True)(holes)
    # eager takes both
    assert sdpa(q, k, k2).shape == q.shape and sdpa(holes, holes, holes).shape == holes.shape


def _errors():
    g = torch.Generator().manual_seed(7)
    _, q = _nested([3, 5], 2, 8, torch.float32, g)
    _, k = _nested([4, 6], 2, 8, torch.float32, g)
    _, k1 = _nested([4, 6], 1, 8, torch.float32, g)
    _, v_other = _nested([6, 4], 2, 8, torch.float32, g)
    _, q3 = _nested([3, 5, 2], 2, 8, torch.float32, g)
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 4, 8)])
    dense = torch.randn(2, 2, 5, 8)
    return {
        "a mask": ((q, k, k), {"attn_mask": torch.ones(2, 2, dtype=torch.bool)}, "attn_mask"),
        "dense key": ((q, dense, dense), {}, "key must be a nested tensor"),
        "dense query": ((dense, k, k), {}, "query must be a nested tensor as the other inputs are"),
        "strided layout": ((strided, strided, strided), {}, "layout torch.jagged"),
        "GQA not enabled": ((q, k1, k1), {}, "enable_gqa"),
        "value lengths": ((q, k, v_other), {}, "value must have key's sequence lengths"),
        "batch": ((q3, k, k), {}, "key must have query's batch size (3)"),
        "ragged dims": ((q, k.transpose(1, 2), k), {}, "ragged on dim 2"),
    }


@pytest.mark.parametrize("name", list(_errors()))
def test_jagged_bad_inputs_name_the_argument(name):
    args, kw, words = _errors()[name]
    with pytest.raises(RuntimeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        sdpa(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_jagged_attention_variants_and_logsumexp_match_reference(dtype):
    """mha_ext.attention on jagged inputs: the variants per sequence (bottom-right
    causal with a window, softcap, ALiBi slopes (B, Hq)), GQA, the logsumexp
    nested like the output, and the gradients, against each sequence alone."""
    g = torch.Generator().manual_seed(8)
    lq, lk, hq, hkv, E = [9, 40, 3], [30, 40, 50], 4, 2, 16
    (qn, q), (kn, k), (vn, v) = (_nested(lq, hq, E, dtype, g), _nested(lk, hkv, E, dtype, g),
                                 _nested(lk, hkv, E, dtype, g))
    slopes = torch.rand(len(lq), hq, generator=g)
    kw = dict(causal=True, alignment="bottom_right", window=(12, -1), softcap=2.5)
    out, lse = mha_ext.attention(q, k, v, alibi_slopes=slopes, enable_gqa=True, return_lse=True, **kw)
    assert lse.is_nested and lse.shape[:2] == (len(lq), hq) and lse.shape[2] == q.shape[2]
    vals, lse_vals = out.transpose(1, 2).values(), lse.transpose(1, 2).values()  # (total, H, Ev), (total, H)
    go = torch.randn(vals.shape, generator=g, dtype=torch.float64).to(dtype)
    mine = torch.autograd.grad(vals, [qn, kn, vn], go)
    seqs = [_sequences(t) for t in (q, k, v)]
    variant = dict(window=(12, -1), bottom_right=True, softcap=2.5)
    refs, a = [], 0
    for b, (qs, ks, vs) in enumerate(zip(*seqs)):
        n = qs.shape[1]
        ref = R.attention(qs, ks, vs, is_causal=True, enable_gqa=True, alibi_slopes=slopes[b], **variant)
        ref_lse = R.logsumexp(qs.detach(), ks.detach(), None, True, None, True, alibi_slopes=slopes[b], **variant)
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(vals[a:a + n].transpose(0, 1).double(), ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse_vals[a:a + n].t().double(), ref_lse, rtol=tol, atol=tol)
        refs.append((ref, go[a:a + n].transpose(0, 1).double()))
        a += n
    ref_grads = torch.autograd.grad([r for r, _ in refs], [t for s in seqs for t in s], [g_ for _, g_ in refs])
    B = len(lq)
    for i, m in enumerate(mine):
        r = torch.cat([x.transpose(0, 1) for x in ref_grads[i * B:(i + 1) * B]]).flatten(1)
        tol = 1e-10 if dtype == torch.float64 else 5e-5
        torch.testing.assert_close(m.values().double(), r, rtol=tol, atol=tol * max(1.0, r.abs().max().item()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_jagged_sdpa_on_cuda_matches_reference(dtype):
    """The same nested call on a GPU (the varlen op's CUDA kernels): the output
    within twice plain eager PyTorch's error in the dtype, the gradients
    within 5% of their largest magnitude of the float64 reference."""
    g = torch.Generator().manual_seed(9)
    lens = [70, 3, 129]
    leaves = [torch.nested.nested_tensor([torch.randn(n, 4 * 64, generator=g, dtype=torch.float64).to(dtype)
                                          for n in lens], layout=torch.jagged, device="cuda", requires_grad=True)
              for _ in range(3)]
    q, k, v = (t.unflatten(-1, [4, 64]).transpose(1, 2) for t in leaves)
    out = sdpa(q, k, v, is_causal=True).transpose(1, 2).values()
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype).cuda()
    grads = torch.autograd.grad(out, leaves, go)
    seqs = [_sequences(t) for t in (q, k, v)]
    a = 0
    for qs, ks, vs in zip(*seqs):
        n = qs.shape[1]
        gs = go[a:a + n].transpose(0, 1).double().cpu()
        ref = R.attention(qs.cpu(), ks.cpu(), vs.cpu(), is_causal=True)
        eager = R.attention(*(t.detach().cpu().to(dtype) for t in (qs, ks, vs)), is_causal=True, compute_dtype=dtype)
        ea = (out[a:a + n].transpose(0, 1).double().cpu() - ref).abs().max().item()
        assert ea <= 2.0 * (eager.double() - ref).abs().max().item() + 1e-3, ea
        ref_grads = torch.autograd.grad(ref, [qs, ks, vs], gs)  # (ref on the CPU, the leaves on the GPU)
        for i, rg in enumerate(ref_grads):
            mine = grads[i].values()[a:a + n].view(n, 4, 64).transpose(0, 1).double().cpu()
            assert (mine - rg.cpu()).abs().max().item() <= 0.05 * max(1.0, rg.abs().max().item())
        a += n


# ---------------------------------------------------------------------------
# mha_ext.MultiheadAttention on nested (N, j, E) inputs


def _module_pair(kdim=None, **kw):
    torch.manual_seed(10)
    ours = mha_ext.MultiheadAttention(32, 4, batch_first=True, kdim=kdim, vdim=kdim, **kw).double()
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True, kdim=kdim, vdim=kdim, **kw).double()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("kind", ["self", "cross, kdim != embed_dim"])
@pytest.mark.parametrize("average", [True, False])
def test_module_on_nested_inputs_matches_torch_per_sequence(kind, average):
    """Output, weights (zero-padded to the longest sequences, as torch's module
    returns them for nested inputs in inference), and the gradients of the
    inputs and of every parameter, against torch's module run on each
    sequence alone (in training: torch's module takes no nested input there)."""
    kdim = None if kind == "self" else 24
    ours, theirs = _module_pair(kdim)
    g = torch.Generator().manual_seed(11)
    lq, lk = [5, 9, 1], ([5, 9, 1] if kind == "self" else [7, 2, 12])
    x = torch.nested.nested_tensor([torch.randn(n, 32, generator=g, dtype=torch.float64) for n in lq],
                                   layout=torch.jagged, requires_grad=True)
    kv = x if kind == "self" else torch.nested.nested_tensor(
        [torch.randn(n, kdim, generator=g, dtype=torch.float64) for n in lk], layout=torch.jagged, requires_grad=True)
    out, w = ours(x, kv, kv, average_attn_weights=average)
    assert out.is_nested and out.shape[2] == 32 and w.shape[:1] == (3,)
    go = torch.randn(out.values().shape, generator=g, dtype=torch.float64)
    leaves = [x] + ([] if kind == "self" else [kv])
    mine = torch.autograd.grad(out.values(), leaves + list(ours.parameters()), go)
    grads_ref = [torch.zeros_like(t.values()) for t in leaves] + [torch.zeros_like(p) for p in theirs.parameters()]
    a = b_ = 0
    for i, (n, s) in enumerate(zip(lq, lk)):
        xs = x.values()[a:a + n].detach().unsqueeze(0).requires_grad_()
        ks = xs if kind == "self" else kv.values()[b_:b_ + s].detach().unsqueeze(0).requires_grad_()
        ref, wref = theirs(xs, ks, ks, average_attn_weights=average)
        torch.testing.assert_close(out.values()[a:a + n], ref[0], rtol=1e-12, atol=1e-12)
        wi = w[i, :n, :s] if average else w[i, :, :n, :s]
        torch.testing.assert_close(wi, wref[0], rtol=1e-12, atol=1e-12)
        assert bool((w[i] == 0).sum() == w[i].numel() - wi.numel())  # zeros past the sequence
        ins = [xs] + ([] if kind == "self" else [ks])
        gr = torch.autograd.grad(ref[0], ins + list(theirs.parameters()), go[a:a + n])
        grads_ref[0][a:a + n] += gr[0][0]
        if kind != "self":
            grads_ref[1][b_:b_ + s] += gr[1][0]
        for j, p in enumerate(gr[len(ins):]):
            grads_ref[len(leaves) + j] += p
        a, b_ = a + n, b_ + s
    for j, (m, r) in enumerate(zip(mine, grads_ref)):
        m = m.values() if m.is_nested else m
        torch.testing.assert_close(m, r, rtol=1e-10, atol=1e-10, msg=lambda s: f"gradient {j}: {s}")


def test_module_with_nested_inputs_inside_a_transformer_encoder_layer_trains():
    """torch's TransformerEncoderLayer with the module as self_attn takes nested
    inputs in training (torch's own module refuses them there): the output and
    the input gradient against torch's layer on each sequence alone."""
    torch.manual_seed(12)
    ref = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0).double()
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0).double()
    layer.load_state_dict(ref.state_dict())
    layer.self_attn = mha_ext.MultiheadAttention(32, 4, batch_first=True).double()
    layer.self_attn.load_state_dict(ref.self_attn.state_dict())
    g = torch.Generator().manual_seed(13)
    lens = [6, 1, 11]
    x = torch.nested.nested_tensor([torch.randn(n, 32, generator=g, dtype=torch.float64) for n in lens],
                                   layout=torch.jagged, requires_grad=True)
    out = layer(x)
    gx = torch.autograd.grad(out.values().sum(), x)[0].values()
    a = 0
    for n in lens:
        xs = x.values()[a:a + n].detach().unsqueeze(0).requires_grad_()
        r = ref(xs)
        torch.testing.assert_close(out.values()[a:a + n], r[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx[a:a + n], torch.autograd.grad(r.sum(), xs)[0][0], rtol=1e-10, atol=1e-10)
        a += n


def _module_errors():
    g = torch.Generator().manual_seed(14)
    x = torch.nested.nested_tensor([torch.randn(n, 32, generator=g) for n in (3, 5)], layout=torch.jagged)
    dense = torch.randn(2, 5, 32)
    return {
        "key_padding_mask": (dict(), (x, x, x), dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
                             "key_padding_mask and attn_mask are not supported"),
        "dense key": (dict(), (x, dense, dense), dict(), "layout torch.jagged, got key dense"),
        "kdim": (dict(kdim=16, vdim=16), (x, x, x), dict(), r"key's last dim must be kdim \(16\), got 32"),
        "batch_first": (dict(batch_first=False), (x, x, x), dict(), "batch_first must be True"),
        "need_weights with dropout": (dict(dropout=0.5), (x, x, x), dict(), "need_weights=False"),
        "add_bias_kv": (dict(add_bias_kv=True), (x, x, x), dict(), "add_bias_kv"),
    }


@pytest.mark.parametrize("name", list(_module_errors()))
def test_module_nested_bad_inputs_name_the_argument(name):
    ctor, args, kw, words = _module_errors()[name]
    ctor = dict(batch_first=True, **ctor) if "batch_first" not in ctor else ctor
    m = mha_ext.MultiheadAttention(32, 4, **ctor)
    with pytest.raises(RuntimeError, match=words):
        m(*args, **kw)


def test_jagged_offsets_not_from_zero_match_reference():
    """A nested tensor over part of a buffer (offsets from 3, rows past the
    last sequence): the rows gathered, the output on the query's rows."""
    g = torch.Generator().manual_seed(15)
    buf = torch.randn(20, 2 * 8, generator=g, dtype=torch.float64, requires_grad=True)
    off = torch.tensor([3, 8, 10, 16])
    x = torch.nested.nested_tensor_from_jagged(buf, off).unflatten(-1, [2, 8]).transpose(1, 2)
    out = sdpa(x, x, x, is_causal=True).transpose(1, 2)
    go = torch.randn(20, 2, 8, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(out.values(), buf, go, retain_graph=True)[0]
    refs = [R.attention(*(buf[a:e].view(e - a, 2, 8).transpose(0, 1),) * 3, is_causal=True) for a, e in
            ((3, 8), (8, 10), (10, 16))]
    for (a, e), r in zip(((3, 8), (8, 10), (10, 16)), refs):
        torch.testing.assert_close(out.values()[a:e].transpose(0, 1), r.detach(), rtol=1e-12, atol=1e-12)
    ref = torch.autograd.grad(refs, buf, [go[a:e].transpose(0, 1) for a, e in ((3, 8), (8, 10), (10, 16))])[0]
    torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)


def test_module_is_causal_on_nested_inputs_trains_a_decoder_layer():
    """is_causal with nested inputs (no mask to say it with): causal per
    sequence. torch's TransformerDecoderLayer with the module as its self
    attention, nested targets and memories, tgt_is_causal=True, in training:
    the output and the gradients of the targets and memories against torch's
    layer run on each sequence alone with its causal tgt_mask; and the
    module's causal weights against torch's module with the causal mask."""
    torch.manual_seed(16)
    ref = torch.nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0).double()
    layer = torch.nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0).double()
    layer.load_state_dict(ref.state_dict())
    for name in ("self_attn", "multihead_attn"):
        mod = mha_ext.MultiheadAttention(32, 4, batch_first=True).double()
        mod.load_state_dict(getattr(ref, name).state_dict())
        setattr(layer, name, mod)
    g = torch.Generator().manual_seed(17)
    lt, lm = [6, 1, 11], [4, 9, 2]
    tgt, mem = (torch.nested.nested_tensor([torch.randn(n, 32, generator=g, dtype=torch.float64) for n in ls],
                                           layout=torch.jagged, requires_grad=True) for ls in (lt, lm))
    out = layer(tgt, mem, tgt_is_causal=True)
    go = torch.randn(out.values().shape, generator=g, dtype=torch.float64)
    gt, gm = torch.autograd.grad(out.values(), [tgt, mem], go)
    a = c = 0
    for n, s_ in zip(lt, lm):
        t = tgt.values()[a:a + n].detach().unsqueeze(0).requires_grad_()
        m_ = mem.values()[c:c + s_].detach().unsqueeze(0).requires_grad_()
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)
        r = ref(t, m_, tgt_mask=mask, tgt_is_causal=True)
        _close_all = dict(rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.values()[a:a + n], r[0], **_close_all)
        rt, rm = torch.autograd.grad(r[0], [t, m_], go[a:a + n])
        torch.testing.assert_close(gt.values()[a:a + n], rt[0], **_close_all)
        torch.testing.assert_close(gm.values()[c:c + s_], rm[0], **_close_all)
        a, c = a + n, c + s_
    # the weights: (N, L, S) padded, causal per sequence
    mod = layer.self_attn
    w = mod(tgt, tgt, tgt, is_causal=True, need_weights=True)[1]
    a = 0
    for i, n in enumerate(lt):
        x = tgt.values()[a:a + n].detach().unsqueeze(0)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)
        wr = ref.self_attn(x, x, x, attn_mask=mask, is_causal=True, need_weights=True)[1]
        torch.testing.assert_close(w[i, :n, :n], wr[0], rtol=1e-12, atol=1e-12)
        a += n


def test_module_nested_takes_any_truth_value_for_is_causal():
    """As torch's module (is_causal=None, 0, 1): the same as False / True."""
    torch.manual_seed(18)
    m = mha_ext.MultiheadAttention(16, 2, batch_first=True)
    x = torch.nested.nested_tensor([torch.randn(n, 16) for n in (3, 5)], layout=torch.jagged)
    for flag, same_as in ((None, False), (0, False), (1, True)):
        a = m(x, x, x, is_causal=flag, need_weights=False)[0]
        b = m(x, x, x, is_causal=same_as, need_weights=False)[0]
        assert torch.equal(a.values(), b.values())
