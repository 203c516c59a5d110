"""mha_ext.varlen_attention / torch.ops.mha_ext.varlen_attention: sequences of
different lengths packed along the rows (FlashAttention's varlen convention).
Every result, the logsumexp and every gradient against the float64 reference
(tests/reference.py) run on each sequence alone; dropout against the
reference's keep mask; float64 gradcheck on the real kernels; registration
(opcheck, compile, export); results independent of the thread count; the
errors of bad cu_seqlens."""
import pytest
import torch

import mha_ext
import reference as R

op = torch.ops.mha_ext


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def _slopes(h, batch=None):
    s = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)
    return s if batch is None else s.expand(batch, h).clone() * torch.linspace(0.5, 1.5, batch)[:, None]


# name -> (query lengths, key lengths, Hq, Hkv, E, Ev, variant keywords)
CASES = {
    "plain": ([5, 17, 1, 40], [9, 17, 30, 70], 2, 2, 16, 16, dict()),
    "gqa, E != Ev": ([33, 2, 70], [33, 50, 70], 4, 2, 16, 8, dict()),
    "empty sequences": ([5, 0, 17, 3], [9, 3, 17, 0], 2, 1, 8, 8, dict()),
    "causal (bottom-right)": ([5, 17, 64, 1], [9, 17, 64, 130], 2, 2, 16, 16, dict(is_causal=True)),
    "causal top-left": ([30, 9], [20, 40], 2, 2, 16, 16, dict(is_causal=True, bottom_right=False)),
    "causal, L > S": ([40, 9], [20, 3], 2, 1, 16, 16, dict(is_causal=True)),
    "window": ([100, 130, 7], [100, 200, 60], 2, 2, 16, 16, dict(window=(20, 3))),
    "window + causal (Mistral)": ([140, 70], [140, 70], 4, 2, 16, 16, dict(window=(31, -1), is_causal=True)),
    "softcap": ([33, 10], [45, 80], 2, 2, 16, 24, dict(softcap=2.0)),
    "alibi (Hq,)": ([33, 20], [40, 60], 4, 4, 16, 16, dict(alibi="h", is_causal=True)),
    "alibi (B, Hq)": ([33, 20, 5], [40, 60, 5], 4, 2, 16, 16, dict(alibi="bh")),
    "everything": ([70, 3, 150], [300, 10, 150], 4, 2, 16, 24,
                   dict(is_causal=True, window=(100, -1), softcap=3.0, alibi="h")),
    "long keys, one query row each": ([1, 1, 1], [700, 1, 333], 4, 4, 32, 32, dict()),
    # at most 16 rows a key/value head (or 64 against 8 keys a row): the decode kernel, each
    # sequence's rows past its own length not rows of it
    "short sequences (decode kernel)": ([3, 0, 8, 1, 5], [3, 4, 8, 300, 0], 4, 2, 16, 8, dict(is_causal=True)),
    "short, top-left window, softcap, alibi (B, Hq)": ([8, 2, 6], [50, 2, 9], 2, 2, 16, 16,
                                                       dict(is_causal=True, bottom_right=False, window=(4, -1),
                                                            softcap=2.0, alibi="bh")),
    "short queries, long keys (64 rows a key/value head)": ([8, 3, 16], [600, 200, 900], 8, 2, 32, 32,
                                                             dict(is_causal=True)),
    # the second sequence's window starts in an earlier key tile than the longest's: two tiles
    # where the batch's longest lengths would give one
    "short, window across a key tile's edge": ([16, 16], [1000, 300], 1, 1, 16, 16,
                                               dict(is_causal=True, window=(100, -1))),
}


def _build(name, dtype, seed=0):
    lq, lk, hq, hkv, E, Ev, kw = CASES[name]
    kw = dict(kw)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lk), hkv, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lk), hkv, Ev, generator=g, dtype=torch.float64).to(dtype)
    alibi = kw.pop("alibi", None)
    slopes = None if alibi is None else (_slopes(hq) if alibi == "h" else _slopes(hq, len(lq)))
    return q, k, v, _cu(lq), _cu(lk), slopes, kw


def _op_args(kw, slopes):
    w = kw.get("window", (-1, -1))
    return (kw.get("is_causal", False), None, w[0], w[1], kw.get("bottom_right", True), kw.get("softcap", 0.0), slopes)


def _run(q, k, v, cq, ck, slopes, kw, go, dropout_p=0.0, rng=None, max_q=None, max_k=None, ops=op):
    causal, scale, wl, wr, br, cap, sl = _op_args(kw, slopes)
    mq = max_q if max_q is not None else int((cq[1:] - cq[:-1]).max()) if cq.numel() > 1 else 0
    mk = max_k if max_k is not None else int((ck[1:] - ck[:-1]).max()) if ck.numel() > 1 else 0
    rng = torch.tensor([1234, 5]) if rng is None else rng
    out, lse, used = ops.varlen_attention(q, k, v, cq, ck, mq, mk, dropout_p, causal, scale, rng, wl, wr, br, cap, sl)
    grads = ops.varlen_attention_backward(go, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, causal, scale, used, wl,
                                         wr, br, cap, sl)
    return out, lse, list(grads)


def _reference(q, k, v, cq, ck, slopes, kw, go, dtype=torch.float64, keep=None, dropout_p=0.0):
    """Each sequence alone through the reference, as a batch of one (Hq, L, E)."""
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    hq, hkv, total_q = q.shape[1], k.shape[1], q.shape[0]
    outs, lses = [], []
    for b in range(cq.numel() - 1):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        qs, ks, vs = (x[a:e].transpose(0, 1) for x, a, e in ((xs[0], q0, q1), (xs[1], k0, k1), (xs[2], k0, k1)))
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        variant = dict(window=kw.get("window", (-1, -1)), bottom_right=kw.get("bottom_right", True),
                       softcap=kw.get("softcap", 0.0), alibi_slopes=sl)
        kb = None if keep is None else keep[:, q0:q1, : k1 - k0]
        o = R.attention(qs, ks, vs, is_causal=kw.get("is_causal", False), enable_gqa=hq != hkv, compute_dtype=dtype,
                        keep=kb, dropout_p=dropout_p, **variant)
        outs.append(o.transpose(0, 1))
        with torch.no_grad():
            lses.append(R.logsumexp(qs.double(), ks.double(), None, kw.get("is_causal", False), None, hq != hkv,
                                    **variant))
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, xs, go.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads)]
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(hq, total_q, dtype=torch.float64)
    return out.detach(), lse, [g.detach() for g in grads]


def check(name, dtype, dropout_p=0.0, ops=op):
    q, k, v, cq, ck, slopes, kw = _build(name, dtype)
    go = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=torch.Generator().manual_seed(9),
                     dtype=torch.float64).to(dtype)
    keep = None
    if dropout_p > 0.0:  # row ids of the contract: h * total_q + packed row
        max_k = int((ck[1:] - ck[:-1]).max())
        keep = R.dropout_keep(1234, 5, (q.shape[1], q.shape[0], max_k), dropout_p)
    out, lse, grads = _run(q, k, v, cq, ck, slopes, kw, go, dropout_p, ops=ops)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, cq, ck, slopes, kw, go, keep=keep, dropout_p=dropout_p)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    if dtype in (torch.float64, torch.float32):
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        for what, a, r in zip(("out", "dq", "dk", "dv"), [out] + grads, [ref_out] + ref_grads):
            torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol * max(1.0, r.abs().max().item()),
                                       msg=lambda s: f"{what}: {s}")
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    else:  # no worse than plain eager PyTorch in the dtype (every op rounding to it)
        _, _, eager_grads = _reference(q, k, v, cq, ck, slopes, kw, go, dtype=dtype, keep=keep, dropout_p=dropout_p)
        eager_out = _reference(q, k, v, cq, ck, slopes, kw, go, dtype=dtype, keep=keep, dropout_p=dropout_p)[0]
        for what, a, r, e in zip(("out", "dq", "dk", "dv"), [out] + grads, [ref_out] + ref_grads,
                                 [eager_out] + eager_grads):
            ea, ee = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
            assert ea <= 2.0 * ee + 1e-3 * r.abs().max().item(), (what, ea, ee)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_matches_reference(name, dtype):
    check(name, dtype)


@pytest.mark.parametrize("name", ["plain", "empty sequences", "everything"])
def test_varlen_dropout_matches_reference(name):
    check(name, torch.float64, dropout_p=0.3)


@pytest.fixture(scope="module", params=[
    "emul", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def device_backend(request):
    """The CUDA backend's varlen ops: emulated on the CPU, or on a GPU."""
    from cuda_backends import OnCuda, _load_emulation

    return _load_emulation() if request.param == "emul" else OnCuda()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["empty sequences", "causal (bottom-right)", "causal, L > S", "alibi (B, Hq)",
                                  "long keys, one query row each"])
def test_varlen_cuda_backend_matches_reference(device_backend, name, dtype):
    check(name, dtype, ops=device_backend)


@pytest.mark.parametrize("name", ["causal (bottom-right)", "causal, L > S", "empty sequences"])
def test_varlen_cuda_forward_warp_layouts_match_reference(device_backend, name, monkeypatch):
    # bfloat16 without a mask tensor: the plain forward kernel (32 query rows a
    # warp) by default, the general one (16) with MHA_EXT_CUDA_FWD_WARP_ROWS=16
    # (read from the emulation's launch log); each against the reference
    # (their last bits may differ: the plain kernel's edge tiles take the
    # one-FMA softmax, the general kernel's the exact path)
    from cuda_backends import OnCuda, forward_threads

    q, k, v, cq, ck, slopes, kw = _build(name, torch.bfloat16)
    monkeypatch.delenv("MHA_EXT_CUDA_FWD_ROWS", raising=False)
    monkeypatch.delenv("MHA_EXT_CUDA_OPERANDS", raising=False)
    max_q, d = int((cq[1:] - cq[:-1]).max()), max(q.shape[2], v.shape[2])
    for rows in ("16", "auto"):
        monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", rows)
        if not isinstance(device_backend, OnCuda):
            device_backend.launched_threads()
        check(name, torch.bfloat16, ops=device_backend)
        if not isinstance(device_backend, OnCuda):  # which forward kernel ran
            assert device_backend.launched_threads()[0] == forward_threads(d, max_q, rows == "auto"), rows


def test_varlen_cuda_backend_dropout_matches_reference(device_backend):
    check("empty sequences", torch.float32, dropout_p=0.3, ops=device_backend)


def test_varlen_cuda_backend_deterministic_dq_matches_reference(device_backend):
    torch.use_deterministic_algorithms(True)
    try:
        check("gqa, E != Ev", torch.float32, ops=device_backend)
    finally:
        torch.use_deterministic_algorithms(False)


def test_varlen_strided_inputs_and_larger_max_seqlen():
    # q, k, v as non-contiguous views; max_seqlen above the longest is allowed
    q, k, v, cq, ck, slopes, kw = _build("gqa, E != Ev", torch.float32)
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)
    kv = torch.cat([k, v], dim=-1)
    ks, vs = kv[..., : k.shape[2]], kv[..., k.shape[2]:]
    assert not qs.is_contiguous() and not ks.is_contiguous()
    go = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    out, lse, grads = _run(qs, ks, vs, cq, ck, slopes, kw, go, max_q=500, max_k=900)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, cq, ck, slopes, kw, go)
    for a, r in zip([out] + grads, [ref_out] + ref_grads):
        torch.testing.assert_close(a.double(), r, rtol=2e-5, atol=2e-5)


def test_varlen_functional_api_and_autograd():
    q, k, v, cq, ck, slopes, kw = _build("everything", torch.float64)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = mha_ext.varlen_attention(*xs, cq, ck, 150, 300, causal=True, window=(100, -1), softcap=3.0,
                                        alibi_slopes=slopes, return_lse=True)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, xs, go)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, cq, ck, slopes, kw, go)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_varlen_double_backward_matches_reference():
    q, k, v, cq, ck, slopes, kw = _build("causal (bottom-right)", torch.float64)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = mha_ext.varlen_attention(*xs, cq, ck, 64, 130, causal=True)
    (gq,) = torch.autograd.grad(out.square().sum(), xs[0], create_graph=True)
    (ggk,) = torch.autograd.grad(gq.sum(), xs[1])
    rs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference_graph(rs, cq, ck)
    (rgq,) = torch.autograd.grad(ref.square().sum(), rs[0], create_graph=True)
    (rggk,) = torch.autograd.grad(rgq.sum(), rs[1])
    torch.testing.assert_close(ggk, rggk, rtol=1e-9, atol=1e-9)


def _reference_graph(xs, cq, ck):
    outs = []
    for b in range(cq.numel() - 1):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        o = R.attention(xs[0][q0:q1].transpose(0, 1), xs[1][k0:k1].transpose(0, 1), xs[2][k0:k1].transpose(0, 1),
                        is_causal=True, bottom_right=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("name", ["plain", "empty sequences", "causal, L > S", "window", "alibi (B, Hq)"])
def test_varlen_gradcheck(name):
    lq, lk, hq, hkv, E, Ev, kw = CASES[name]
    small_q, small_k = [min(x, 5) for x in lq], [min(x, 6) for x in lk]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(small_q), hq, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(small_k), hkv, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(small_k), hkv, 3, generator=g, dtype=torch.float64, requires_grad=True)
    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    slopes = None if alibi is None else (_slopes(hq) if alibi == "h" else _slopes(hq, len(lq)))
    causal, scale, wl, wr, br, cap, sl = _op_args(kw, slopes)
    cq, ck = _cu(small_q), _cu(small_k)

    def f(q, k, v):
        return op.varlen_attention(q, k, v, cq, ck, 5, 6, 0.0, causal, scale, None, wl, wr, br, cap, sl)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("name,dropout_p", [("everything", 0.1), ("short queries, long keys (64 rows a key/value head)",
                                                                  0.0)])
def test_varlen_results_do_not_depend_on_the_thread_count(name, dropout_p):
    q, k, v, cq, ck, slopes, kw = _build(name, torch.float32)
    go = torch.randn(q.shape[0], q.shape[1], v.shape[2])
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_run(q, k, v, cq, ck, slopes, kw, go, dropout_p=dropout_p))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip([runs[0][0], runs[0][1]] + runs[0][2], [other[0], other[1]] + other[2]):
            assert torch.equal(a, b)


def test_varlen_opcheck():
    q, k, v, cq, ck, slopes, kw = _build("everything", torch.float64)
    causal, scale, wl, wr, br, cap, sl = _op_args(kw, slopes)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cq, ck, 150, 300, 0.0, causal, scale, None,
            wl, wr, br, cap, sl)
    torch.library.opcheck(op.varlen_attention, args)
    out, lse, used = op.varlen_attention(*args)
    torch.library.opcheck(op.varlen_attention_backward,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, cq, ck, 150,
                           300, 0.0, causal, scale, used, wl, wr, br, cap, sl))


def test_varlen_compile_fullgraph_and_export():
    q, k, v, cq, ck, slopes, kw = _build("gqa, E != Ev", torch.float32)

    def f(q, k, v, cq, ck):
        return mha_ext.varlen_attention(q, k, v, cq, ck, 70, 70, causal=True)

    want = f(q, k, v, cq, ck)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v, cq, ck), want, rtol=0, atol=0)

    class M(torch.nn.Module):
        def forward(self, q, k, v, cq, ck):
            return f(q, k, v, cq, ck)

    ep = torch.export.export(M(), (q, k, v, cq, ck))
    torch.testing.assert_close(ep.module()(q, k, v, cq, ck), want, rtol=0, atol=0)


def _errors():
    q, k, v = torch.randn(10, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 4)
    cq, ck = _cu([4, 6]), _cu([5, 7])
    good = dict(q=q, k=k, v=v, cq=cq, ck=ck, mq=6, mk=7)
    return good, {
        "cu_seqlens_q int64": (dict(cq=cq.long()), r"cu_seqlens_q must be an int32 tensor of shape \(batch \+ 1\), "
                                                   r"got torch.int64 of shape \(3\)"),
        "cu_seqlens_k 2-d": (dict(ck=ck[None]), r"cu_seqlens_k must be an int32 tensor .* got torch.int32 of shape "
                                               r"\(1, 3\)"),
        "cu_seqlens_k longer": (dict(ck=_cu([5, 7, 0])), r"cu_seqlens_k must have cu_seqlens_q's shape \(3\), got \(4\)"),
        "cu_seqlens_q not starting at 0": (dict(cq=torch.tensor([1, 4, 10], dtype=torch.int32)),
                                           r"cu_seqlens_q\[0\] must be 0, got 1"),
        "cu_seqlens_q decreasing": (dict(cq=torch.tensor([0, 11, 10], dtype=torch.int32), mq=20),
                                    r"cu_seqlens_q must not decrease, got cu_seqlens_q\[1\] = 11 > cu_seqlens_q\[2\] = 10"),
        "cu_seqlens_k past the keys": (dict(ck=torch.tensor([0, 5, 13], dtype=torch.int32), mk=20),
                                       r"cu_seqlens_k\[-1\] must equal the packed length 12, got 13"),
        "cu_seqlens_q short of the rows": (dict(cq=torch.tensor([0, 4, 9], dtype=torch.int32)),
                                           r"cu_seqlens_q\[-1\] must equal the packed length 10, got 9"),
        "max_seqlen_q too small": (dict(mq=5), r"max_seqlen_q must be at least the longest sequence \(6\), got 5"),
        "max_seqlen_k negative": (dict(mk=-1), r"max_seqlen_k must be >= 0, got -1"),
        "query 4-d": (dict(q=q[None]), r"query must have 3 dims \(total_seqlen, heads, head_dim\), got shape "
                                       r"\(1, 10, 2, 8\)"),
        "value rows": (dict(v=v[:11]), r"value must have key's \(total_seqlen, heads\) = \(12, 2\), got \(11, 2\)"),
        "heads not a multiple": (dict(q=torch.randn(10, 3, 8)), r"query heads \(3\) must be a multiple of key/value "
                                                                r"heads \(2\)"),
        "key dtype": (dict(k=k.double()), r"key must have the same dtype as query \(torch.float32\), got torch.float64"),
    }


# the values of cu_seqlens are read by the kernels' host code; a fake tensor has none
_VALUE_CASES = {"cu_seqlens_q not starting at 0", "cu_seqlens_q decreasing", "cu_seqlens_k past the keys",
                "cu_seqlens_q short of the rows", "max_seqlen_q too small"}


def _args(name):
    good, cases = _errors()
    change, pattern = cases[name]
    a = {**good, **change}
    return (a["q"], a["k"], a["v"], a["cq"], a["ck"], a["mq"], a["mk"]), pattern


@pytest.mark.parametrize("name", list(_errors()[1]))
def test_varlen_bad_inputs_name_the_argument(name):
    args, pattern = _args(name)
    with pytest.raises(RuntimeError, match=pattern):
        op.varlen_attention(*args)
    q, v = args[0], args[2]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1]) if q.dim() == 3 else torch.zeros(1)
    lse = torch.zeros(q.shape[1], q.shape[0]) if q.dim() == 3 else torch.zeros(1)
    with pytest.raises(RuntimeError, match=pattern):
        op.varlen_attention_backward(out, *args[:3], out, lse, *args[3:], 0.0, False, None, torch.zeros(2).long())


@pytest.mark.parametrize("name", [n for n in _errors()[1] if n not in _VALUE_CASES])
def test_varlen_fake_kernel_says_the_same(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, pattern = _args(name)
    with FakeTensorMode() as mode:
        fake = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args)
        with pytest.raises(RuntimeError, match=pattern):
            op.varlen_attention(*fake)


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the names of the ops that run."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("need_weights", [False, True])
def test_module_skips_padded_keys_and_matches_torch(need_weights):
    # lengths uniform over 25-100% of the longest, as a padded encoder batch
    torch.manual_seed(0)
    N, S, E, H = 6, 40, 32, 4
    lengths = [40, 10, 25, 33, 18, 40]
    pad = torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]
    ours = mha_ext.MultiheadAttention(E, H, batch_first=True).double()
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(N, S, E, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with _OpNames() as seen:
        out, w = ours(xa, xa, xa, key_padding_mask=pad, need_weights=need_weights)
    assert "mha_ext.varlen_attention.default" in seen.names and "mha_ext.attention.default" not in seen.names
    ref, ref_w = theirs(xb, xb, xb, key_padding_mask=pad, need_weights=need_weights)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    if need_weights:
        torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-10)
    go = torch.randn_like(out)
    g = torch.autograd.grad(out, [xa] + list(ours.parameters()), go)
    rg = torch.autograd.grad(ref, [xb] + list(theirs.parameters()), go)
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_module_dropout_with_key_padding_keeps_the_expected_mean():
    # training with dropout on the unpadded path: E[out] over many draws is the no-dropout output
    torch.manual_seed(0)
    m = mha_ext.MultiheadAttention(16, 2, dropout=0.3, batch_first=True).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    pad = torch.arange(12)[None, :] >= torch.tensor([12, 5])[:, None]
    m.eval()
    want, _ = m(x, x, x, key_padding_mask=pad, need_weights=False)
    m.train()
    draws = torch.stack([m(x, x, x, key_padding_mask=pad, need_weights=False)[0] for _ in range(3000)])
    assert not torch.equal(draws[0], draws[1])
    err = (draws.mean(0) - want).abs().max().item()
    spread = draws.std(0).max().item() / 3000 ** 0.5
    assert err < 6 * spread, (err, spread)
