"""mha_ext.kvcache_attention / torch.ops.mha_ext.kvcache_attention: decoding
against a preallocated KV cache written in place (FlashAttention's
flash_attn_with_kvcache convention). Outputs and logsumexp against the float64
reference on each batch's keys (cache rows plus the new ones), the in-place
writes, a generation loop against the concatenating cache transformers'
DynamicCache uses, the variants, registration (opcheck, compile), the errors."""
import pytest
import torch
import torch.nn.functional as F

import mha_ext
import reference as R

op = torch.ops.mha_ext


def _make(B=3, S_max=300, hq=4, hkv=2, E=16, Ev=24, L=4, seqlens=(0, 100, 250), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return (r(B, L, hq, E), r(B, S_max, hkv, E), r(B, S_max, hkv, Ev), torch.tensor(seqlens, dtype=torch.int32),
            r(B, L, hkv, E), r(B, L, hkv, Ev))


def _reference(q, k_cache, v_cache, seqlens, k_new, v_new, compute_dtype=torch.float64, **variant):
    """Each batch alone: its cached keys, then the new ones, (H, L, D) layout."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        keys, vals = k_cache[b, :n], v_cache[b, :n]
        if k_new is not None:
            keys, vals = torch.cat([keys, k_new[b]]), torch.cat([vals, v_new[b]])
        qb, kb, vb = q[b].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
        sl = variant.get("alibi_slopes")
        var = dict(variant, alibi_slopes=None if sl is None else (sl if sl.dim() == 1 else sl[b]))
        gqa = qb.shape[0] != kb.shape[0]
        outs.append(R.attention(qb, kb, vb, enable_gqa=gqa, bottom_right=True, compute_dtype=compute_dtype,
                                **var).transpose(0, 1))
        causal = var.pop("is_causal", False)
        lses.append(R.logsumexp(qb, kb, None, causal, None, gqa, bottom_right=True, **var))
    return torch.stack(outs), torch.stack(lses)


def _run(q, k_cache, v_cache, seqlens, k_new, v_new, ops=op, **variant):
    w = variant.get("window", (-1, -1))
    return ops.kvcache_attention(q, k_cache, v_cache, seqlens, k_new, v_new, None, variant.get("is_causal", False),
                                w[0], w[1], variant.get("softcap", 0.0), variant.get("alibi_slopes"))


def _check_against_reference(out, lse, inputs, variant):
    """out, lse against the float64 reference on the inputs (the caches as they
    were before the call): float64 to 1e-10, float32 to 2e-5; bfloat16 and
    float16 within twice eager attention's error in that dtype."""
    dtype = inputs[0].dtype
    ref, ref_lse = _reference(*inputs, **variant)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    if dtype in (torch.float64, torch.float32):
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    else:
        eager, _ = _reference(*inputs, compute_dtype=dtype, **variant)
        ea, ee = (out.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
        assert ea <= 2 * ee + 1e-3 * ref.abs().max().item(), (ea, ee)


VARIANTS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, window=(50, -1)),
    "softcap": dict(softcap=1.5),
    "alibi (B, Hq)": dict(alibi_slopes=torch.tensor([[0.5, 0.25, 0.1, 0.05]]).expand(3, 4) * torch.tensor([[1.0], [0.5], [2.0]])),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("L", [1, 4, 12, 40])  # 2, 8, 24 (the decode kernel) and 80 rows a key/value head
def test_kvcache_matches_reference_and_writes_the_cache(name, dtype, L):
    variant = VARIANTS[name]
    q, kc, vc, sl, kn, vn = _make(L=L, dtype=dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = _run(q, kc, vc, sl, kn, vn, **variant)
    _check_against_reference(out, lse, (q, kc0, vc0, sl, kn, vn), variant)
    for b in range(3):  # the new rows written in place, nothing else touched
        n = int(sl[b])
        want_k, want_v = kc0[b].clone(), vc0[b].clone()
        want_k[n:n + L], want_v[n:n + L] = kn[b], vn[b]
        assert torch.equal(kc[b], want_k) and torch.equal(vc[b], want_v)


@pytest.mark.parametrize("name", ["plain", "causal", "window"])
def test_kvcache_sixteen_rows_a_group(name):
    # 16 query rows a key/value head (4 query heads a group, 4 new rows), float32:
    # the decode kernel's one-row-a-lane routines, reading key and value rows
    # Hkv D elements apart in the (B, S, Hkv, D) cache
    q, kc, vc, sl, kn, vn = _make(B=2, S_max=1100, hq=8, hkv=2, E=40, Ev=72, L=4, seqlens=(1030, 300))
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = _run(q, kc, vc, sl, kn, vn, **VARIANTS[name])
    ref, ref_lse = _reference(q, kc0, vc0, sl, kn, vn, **VARIANTS[name])
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("hkv,E", [(8, 128), (16, 64)], ids=["8 heads of 128", "16 heads of 64"])
def test_kvcache_sixteen_rows_with_key_rows_4_kib_apart(hkv, E):
    # float32 key rows a multiple of 4 KiB apart (Hkv E = 1024 elements): the
    # 16-row routine copies each block of 16 key rows into a dense block
    # before its scores (rows_lanes_cpu.cpp); a partial last block, a batch
    # of fewer keys, and the same bits on one thread
    q, kc, vc, sl, kn, vn = _make(B=2, S_max=700, hq=4 * hkv, hkv=hkv, E=E, Ev=E, L=4, seqlens=(650, 37))
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = _run(q, kc, vc, sl, kn, vn)
    ref, ref_lse = _reference(q, kc0, vc0, sl, kn, vn)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, kc0.clone(), vc0.clone(), sl, kn, vn)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, one[0]) and torch.equal(lse, one[1])


@pytest.mark.parametrize("dtype,hq,L", [(torch.float32, 8, 1), (torch.float32, 16, 4), (torch.bfloat16, 8, 2),
                                        (torch.bfloat16, 16, 4), (torch.float16, 16, 4)],
                         ids=["float32, one row a head", "float32, 16 rows a head", "bfloat16, 4 rows a head",
                              "bfloat16, 16 rows a head", "float16, 16 rows a head"])
@pytest.mark.parametrize("name", ["plain", "causal", "softcap"])
def test_kvcache_past_the_caches(name, dtype, hq, L):
    # visible K/V past 32 MiB in a (B, S, H, D) cache: one tile a split, the
    # heads of a tile in turn (split-major items), a long cache beside a short one
    variant = VARIANTS[name]
    q, kc, vc, sl, kn, vn = _make(B=2, S_max=17000, hq=hq, hkv=4, E=64, Ev=64, L=L, seqlens=(16900, 3000), dtype=dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = _run(q, kc, vc, sl, kn, vn, **variant)
    _check_against_reference(out, lse, (q, kc0, vc0, sl, kn, vn), variant)
    threads = torch.get_num_threads()
    try:  # the same bits on one thread (the cache already holds the new rows: no new ones)
        again = _run(q, kc.clone(), vc.clone(), sl + L, None, None, **variant)
        torch.set_num_threads(1)
        one = _run(q, kc.clone(), vc.clone(), sl + L, None, None, **variant)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(again[0], one[0]) and torch.equal(again[1], one[1])


@pytest.fixture(scope="module", params=[
    "emul", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def device_backend(request):
    """The CUDA backend's KV-cache op: emulated on the CPU, or on a GPU."""
    from cuda_backends import OnCuda, _load_emulation

    return _load_emulation() if request.param == "emul" else OnCuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal", "window", "alibi (B, Hq)"])
@pytest.mark.parametrize("splits", ["auto", "1", "5"])
def test_kvcache_cuda_backend_matches_reference(device_backend, name, dtype, splits, monkeypatch):
    # splits: MHA_EXT_CUDA_KV_SPLITS, each batch's keys in that many runs
    # (batch 0 has no cached keys, so most of its runs are empty)
    monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
    _check_step_against_reference(device_backend, VARIANTS[name], dtype, L=3)


def _check_step_against_reference(ops, variant, dtype, L):
    """One step of L new rows by ops against the float64 reference (the
    eager bound in 16-bit types), and the new rows in the caches."""
    q, kc, vc, sl, kn, vn = _make(L=L, dtype=dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = _run(q, kc, vc, sl, kn, vn, ops=ops, **variant)
    _check_against_reference(out, lse, (q, kc0, vc0, sl, kn, vn), variant)
    assert torch.equal(kc[1, 100:100 + L], kn[1]) and torch.equal(vc[2, 250:250 + L], vn[2])


@pytest.mark.parametrize("name", ["causal", "window"])
def test_kvcache_cuda_forward_warp_layouts_match_reference(device_backend, name, monkeypatch):
    # bfloat16, 40 new rows a step (a chunked prefill): the plain forward
    # kernel (32 query rows a warp) by default, the general one (16) with
    # MHA_EXT_CUDA_FWD_WARP_ROWS=16 (read from the emulation's launch log),
    # each batch's keys from its own cache_seqlens; each against the
    # reference (their last bits may differ: the plain kernel's edge tiles
    # take the one-FMA softmax, the general kernel's the exact path)
    from cuda_backends import OnCuda, forward_threads

    variant = VARIANTS[name]
    for env in ("MHA_EXT_CUDA_FWD_ROWS", "MHA_EXT_CUDA_OPERANDS", "MHA_EXT_CUDA_KV_SPLITS"):
        monkeypatch.delenv(env, raising=False)
    for rows in ("16", "auto"):
        monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", rows)
        if not isinstance(device_backend, OnCuda):
            device_backend.launched_threads()
        _check_step_against_reference(device_backend, variant, torch.bfloat16, L=40)
        if not isinstance(device_backend, OnCuda):  # which forward kernel ran
            assert device_backend.launched_threads()[0] == forward_threads(24, 40, rows == "auto"), rows


def test_kvcache_without_new_keys_and_empty_batches():
    q, kc, vc, _, _, _ = _make(L=2)
    sl = torch.tensor([0, 7, 300], dtype=torch.int32)  # an empty cache: output 0, lse -inf
    out, lse = _run(q, kc, vc, sl, None, None, is_causal=True)
    ref, ref_lse = _reference(q, kc, vc, sl, None, None, is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and (lse[0] == float("-inf")).all()
    torch.testing.assert_close(lse[1:].double(), ref_lse[1:], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvcache_ragged_lengths_do_not_depend_on_the_thread_count(dtype):
    # One long cache among short and empty ones: the threads claim the
    # work items as they go, so which thread runs an item changes from run
    # to run; results bit-equal for 1, 2 and 3 threads, and the reference's
    # (split and unsplit heads: 4 x 2 and 16 x 4 key/value heads)
    for B, hkv, seqlens in ((4, 2, (3000, 9, 700, 0)), (16, 4, (1500,) + (40,) * 14 + (0,))):
        q, kc, vc, _, kn, vn = _make(B=B, S_max=3002, hq=2 * hkv, hkv=hkv, E=64, Ev=64, L=2, seqlens=seqlens,
                                     dtype=dtype)
        sl = torch.tensor(seqlens, dtype=torch.int32)
        threads = torch.get_num_threads()
        runs = []
        try:
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                kc_n, vc_n = kc.clone(), vc.clone()
                runs.append(_run(q, kc_n, vc_n, sl, kn, vn, is_causal=True))
        finally:
            torch.set_num_threads(threads)
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
        ref, ref_lse = _reference(q, kc, vc, sl, kn, vn, is_causal=True)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(runs[0][0].double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(runs[0][1].double(), ref_lse, rtol=tol, atol=tol)


def test_generation_loop_matches_a_concatenating_cache():
    # what transformers' DynamicCache does: the whole history concatenated every step, then SDPA
    torch.manual_seed(0)
    B, hq, hkv, E, prompt, steps = 2, 8, 2, 32, 37, 60
    kc, vc = torch.zeros(B, prompt + steps, hkv, E), torch.zeros(B, prompt + steps, hkv, E)
    sl = torch.zeros(B, dtype=torch.int32)
    hist_k, hist_v = torch.zeros(B, hkv, 0, E), torch.zeros(B, hkv, 0, E)
    for step in range(steps + 1):
        L = prompt if step == 0 else 1
        q, kn, vn = torch.randn(B, L, hq, E), torch.randn(B, L, hkv, E), torch.randn(B, L, hkv, E)
        out = mha_ext.kvcache_attention(q, kc, vc, sl, kn, vn, causal=True)
        sl += L
        hist_k, hist_v = torch.cat([hist_k, kn.transpose(1, 2)], 2), torch.cat([hist_v, vn.transpose(1, 2)], 2)
        causal = L > 1  # a prompt is causal; one new row sees everything
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), hist_k, hist_v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvcache_past_32_mib_of_keys(dtype):
    # K/V read past 32 MiB (each batch's own key count): the row routines also fetch
    # each row 24 KiB ahead into L2 (rows_avx512.h); head-major views so that a
    # head's rows are adjacent, one batch far shorter than the other
    q, kc, vc, sl, kn, vn = _make(B=2, L=1, hq=32, hkv=8, E=128, Ev=128, S_max=16400, seqlens=(16300, 40), dtype=dtype)
    kh, vh = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
    out, lse = _run(q, kh, vh, sl, kn, vn, is_causal=True)
    _check_against_reference(out, lse, (q, kc, vc, sl, kn, vn), {"is_causal": True})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvcache_head_major_cache_views(dtype):
    # caches stored (B, H, S, D) and passed as (B, S, H, D) views (the layout bench_kvcache.py
    # compares): each head's rows adjacent, the new rows written through the views
    q, kc, vc, sl, kn, vn = _make(L=1, hq=8, hkv=2, E=64, Ev=64, S_max=700, seqlens=(690, 3, 300), dtype=dtype)
    kh, vh = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
    assert kh.stride(2) > kh.stride(1) == 64
    out, lse = _run(q, kh, vh, sl, kn, vn, is_causal=True)
    _check_against_reference(out, lse, (q, kc, vc, sl, kn, vn), {"is_causal": True})
    for b in range(3):
        n = int(sl[b])
        assert torch.equal(kh[b, n], kn[b, 0]) and torch.equal(vh[b, n], vn[b, 0])


def test_kvcache_strided_query_and_cache_views():
    q, kc, vc, sl, kn, vn = _make(L=3)
    big = torch.zeros(3, 300, 2, 40)  # the caches as views into one buffer (K and V side by side)
    big[..., :16], big[..., 16:] = kc, vc
    kv, vv = big[..., :16], big[..., 16:]
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = _run(qs, kv, vv, sl, kn, vn, is_causal=True)
    ref, _ = _reference(q, kc, vc, sl, kn, vn, is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    assert torch.equal(big[1, 100:103, :, :16], kn[1]) and torch.equal(big[1, 100:103, :, 16:], vn[1])
    # every column strided: new rows and caches at a column stride of 2
    q, kc, vc, sl, kn, vn = _make(L=3, seed=1)
    wide = torch.zeros(3, 300, 2, 80)
    wide[..., 0:32:2], wide[..., 32:80:2] = kc, vc
    kv, vv = wide[..., 0:32:2], wide[..., 32:80:2]
    new = torch.zeros(3, 3, 2, 80)
    new[..., 1:33:2], new[..., 33:81:2] = kn, vn
    knew, vnew = new[..., 1:33:2], new[..., 33:81:2]
    assert kv.stride(-1) == vv.stride(-1) == knew.stride(-1) == vnew.stride(-1) == 2
    out, lse = _run(q, kv, vv, sl, knew, vnew, is_causal=True)
    ref, _ = _reference(q, kc, vc, sl, kn, vn, is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    for b in range(3):  # the new rows written, every other entry of the buffer as it was
        n = int(sl[b])
        want = torch.zeros(300, 2, 80)
        want[:, :, 0:32:2], want[:, :, 32:80:2] = kc[b], vc[b]
        want[n:n + 3, :, 0:32:2], want[n:n + 3, :, 32:80:2] = kn[b], vn[b]
        assert torch.equal(wide[b], want)


def test_kvcache_opcheck_and_compile():
    q, kc, vc, sl, kn, vn = _make(L=2, dtype=torch.float64)
    torch.library.opcheck(op.kvcache_attention, (q, kc.clone(), vc.clone(), sl, kn, vn, None, True, -1, -1, 0.0, None))

    def step(q, kc, vc, sl, kn, vn):
        return mha_ext.kvcache_attention(q, kc, vc, sl, kn, vn, causal=True)

    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want = step(q, kc1, vc1, sl, kn, vn)
    got = torch.compile(step, fullgraph=True)(q, kc2, vc2, sl, kn, vn)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)  # the mutation survives compilation


def _bad():
    q, kc, vc, sl, kn, vn = _make(L=2)
    good = dict(q=q, kc=kc, vc=vc, sl=sl, kn=kn, vn=vn)
    return good, {
        "cache_seqlens past the cache": (dict(sl=torch.tensor([0, 100, 299], dtype=torch.int32)),
                                         r"cache_seqlens\[2\] must be in \[0, 298\] \(S_max = 300 minus 2 new keys\), "
                                         r"got 299"),
        "cache_seqlens negative": (dict(sl=torch.tensor([0, -1, 5], dtype=torch.int32)),
                                   r"cache_seqlens\[1\] must be in \[0, 298\]"),
        "cache_seqlens int64": (dict(sl=sl.long()), r"cache_seqlens must be an int32 tensor of shape \(B\) = \(3\), got "
                                                    r"torch.int64 of shape \(3\)"),
        "cache_seqlens too short": (dict(sl=sl[:2]), r"cache_seqlens must be an int32 tensor of shape \(B\) = \(3\)"),
        "k_new without v_new": (dict(vn=None), r"k_new and v_new must be given together, got k_new only"),
        "k_new heads": (dict(kn=kn[:, :, :1]), r"k_new must have shape \(B, L_new, Hkv, E\) = \(3, 2, 2, 16\), got "
                                               r"\(3, 2, 1, 16\)"),
        "v_cache batch": (dict(vc=vc[:2]), r"v_cache must have shape \(B, S_max, Hkv, Ev\) = \(3, 300, 2, 24\)"),
        "query 3-d": (dict(q=q[0]), r"query must have 4 dims \(batch, seqlen, heads, head_dim\)"),
        "k_cache dtype": (dict(kc=kc.double()), r"k_cache must have the same dtype as query"),
        "heads not a multiple": (dict(q=torch.randn(3, 2, 3, 16)), r"query heads \(3\) must be a multiple of key/value "
                                                                   r"heads \(2\)"),
    }


@pytest.mark.parametrize("name", list(_bad()[1]))
def test_kvcache_bad_inputs_name_the_argument(name):
    good, cases = _bad()
    change, pattern = cases[name]
    a = {**good, **change}
    before = a["kc"].clone()
    with pytest.raises(RuntimeError, match=pattern):
        op.kvcache_attention(a["q"], a["kc"], a["vc"], a["sl"], a["kn"], a["vn"])
    assert torch.equal(a["kc"], before)  # nothing written


@pytest.mark.parametrize("name", [n for n in _bad()[1] if "cache_seqlens[" not in _bad()[1][n][1]
                                  and "past" not in n and "negative" not in n])
def test_kvcache_fake_kernel_says_the_same(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    good, cases = _bad()
    change, pattern = cases[name]
    a = {**good, **change}
    with FakeTensorMode() as mode:
        f = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        with pytest.raises(RuntimeError, match=pattern):
            op.kvcache_attention(f["q"], f["kc"], f["vc"], f["sl"], f["kn"], f["vn"])


def test_kvcache_writes_bump_versions_and_refuse_overlap():
    # as index_put_ (torch's own in-place write): each cache's version counter
    # moves, and new rows that are a view of the cache they go to are torch's
    # error, raised before anything is written
    q, kc, vc, sl, kn, vn = _make(B=1, L=1, seqlens=(100,))
    v0 = (kc._version, vc._version)
    _run(q, kc, vc, sl, kn, vn)
    assert kc._version > v0[0] and vc._version > v0[1]
    kc0, vc0 = kc.clone(), vc.clone()
    rows = (torch.tensor([[0]]), torch.tensor([[101]]))
    with pytest.raises(RuntimeError, match="refer to a single memory location") as theirs:
        kc.index_put_(rows, kc[:, 5:6])
    with pytest.raises(RuntimeError, match="refer to a single memory location") as ours:
        _run(q, kc, vc, sl + 1, kc[:, 5:6], vn)
    assert str(ours.value) == str(theirs.value)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_kvcache_is_forward_only():
    # the op has no backward: a call that asks for gradients is refused by name
    # (autograd's fallback would give the inputs none), on either call path
    q, kc, vc, sl, kn, vn = _make(L=2)
    for name in ("q", "kn", "vn"):
        a = dict(q=q, kn=kn, vn=vn)
        a[name] = a[name].clone().requires_grad_()
        arg = {"q": "query", "kn": "k_new", "vn": "v_new"}[name]
        with pytest.raises(RuntimeError, match=f"kvcache_attention is forward only \\(no backward\\): {arg} requires "
                                               "grad while grad mode is on"):
            mha_ext.kvcache_attention(a["q"], kc.clone(), vc.clone(), sl, a["kn"], a["vn"], causal=True)
        with pytest.raises(RuntimeError, match=f"{arg} requires grad"):
            op.kvcache_attention(a["q"], kc.clone(), vc.clone(), sl, a["kn"], a["vn"], None, True)
        with torch.no_grad():
            out = mha_ext.kvcache_attention(a["q"], kc.clone(), vc.clone(), sl, a["kn"], a["vn"], causal=True)
        ref, _ = _reference(q, kc, vc, sl, kn, vn, is_causal=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    # compiled, the fake kernel sees the call in grad mode and says the same
    step = torch.compile(lambda q, kc, vc: mha_ext.kvcache_attention(q, kc, vc, sl, kn, vn, causal=True),
                         fullgraph=True)
    with pytest.raises(Exception, match=r"kvcache_attention is forward only \(no backward\): query requires grad"):
        step(q.clone().requires_grad_(), kc.clone(), vc.clone())
