"""torch.autocast around the ops, as around torch's SDPA: float32 query, key,
value and float masks on the autocast device are cast to the region's dtype
(bfloat16 or float16), float64 stays, mixed float32 / 16-bit inputs work, and
the output and gradients have torch's dtypes. Each against torch's own SDPA
under the same autocast region and the float64 reference."""
import pytest
import torch
import torch.nn.functional as F

import mha_ext
import reference as R

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


def _inputs(device, g, shape=(2, 4, 37, 16), s=45):
    N, H, L, E = shape
    q = torch.randn(N, H, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(N, H, s, E, generator=g, dtype=torch.float64)
    v = torch.randn(N, H, s, E, generator=g, dtype=torch.float64)
    mask = torch.randn(N, 1, L, s, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (q, k, v, mask)]


def _err(a, ref):
    return (a.double().cpu() - ref.cpu()).abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "query 16-bit, key/value float32"])
def test_sdpa_under_autocast_matches_torch(device, dtype, mixed):
    g = torch.Generator().manual_seed(0)
    q64, k64, v64, m64 = _inputs(device, g)
    leaves = [t.float().requires_grad_() for t in (q64, k64, v64)]
    mask = m64.float()
    go = torch.randn(q64.shape, generator=g, dtype=torch.float64).to(device)
    results = {}
    for name, fn in (("ours", mha_ext.scaled_dot_product_attention), ("torch", F.scaled_dot_product_attention)):
        with torch.autocast(device, dtype=dtype):
            q = leaves[0].to(dtype) if mixed else leaves[0]
            out = fn(q, leaves[1], leaves[2], attn_mask=mask)
        grads = torch.autograd.grad(out, leaves, go.to(out.dtype))
        results[name] = (out, grads)
    (out, grads), (t_out, t_grads) = results["ours"], results["torch"]
    assert out.dtype == t_out.dtype == dtype
    assert [g_.dtype for g_ in grads] == [g_.dtype for g_ in t_grads] == [torch.float32] * 3
    # against the float64 reference on the inputs autocast gives the kernels (rounded to the dtype)
    xs = [t.detach().to(dtype).double().requires_grad_() for t in leaves]
    ref = R.attention(*xs, attn_mask=m64.to(dtype).double())
    ref_grads = torch.autograd.grad(ref, xs, go)
    eo, et = _err(out, ref), _err(t_out, ref)
    assert eo <= 2.0 * et + 1e-3, (eo, et)
    for a, b, r in zip(grads, t_grads, ref_grads):
        ea, eb = _err(a, r), _err(b, r)
        assert ea <= 2.0 * eb + 1e-3 * max(1.0, r.abs().max().item()), (ea, eb)


def test_float64_stays_float64_under_autocast():
    g = torch.Generator().manual_seed(1)
    q, k, v, m = _inputs("cpu", g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert out.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(out, R.attention(q, k, v, attn_mask=m, is_causal=True), rtol=1e-10, atol=1e-10)


def test_attention_variants_under_autocast_keep_the_slopes():
    """mha_ext.attention: query, key, value cast, the ALiBi slopes (float32)
    not: the same as the call on the cast inputs outside autocast, which
    tests/test_variants.py holds to the reference; and within the dtype's
    error of the float64 reference with the exact slopes."""
    g = torch.Generator().manual_seed(2)
    q, k, v, _ = _inputs("cpu", g, s=200)
    slopes = torch.rand(4, generator=g) * 0.3 + 0.2
    kw = dict(causal=True, alignment="bottom_right", window=(150, -1), softcap=5.0, alibi_slopes=slopes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha_ext.attention(q.float(), k.float(), v.float(), **kw)
    direct = mha_ext.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    ref = R.attention(*(t.bfloat16().double() for t in (q, k, v)), is_causal=True, window=(150, -1),
                      bottom_right=True, softcap=5.0, alibi_slopes=slopes.double())
    eager = R.attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True, window=(150, -1), bottom_right=True,
                        softcap=5.0, alibi_slopes=slopes, compute_dtype=torch.bfloat16)
    assert _err(out, ref) <= 2.0 * _err(eager, ref) + 1e-3


def test_varlen_under_autocast():
    g = torch.Generator().manual_seed(3)
    lens = [5, 40, 17]
    cu = torch.tensor([0, 5, 45, 62], dtype=torch.int32)
    q, k, v = (torch.randn(62, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha_ext.varlen_attention(q.float(), k.float(), v.bfloat16(), cu, cu, 40, 40, causal=True)
    assert out.dtype == torch.bfloat16
    a = 0
    for n in lens:
        qs, ks, vs = (t[a:a + n].bfloat16().double().transpose(0, 1) for t in (q, k, v))
        ref = R.attention(qs, ks, vs, is_causal=True)
        eager = R.attention(*(t.bfloat16() for t in (qs, ks, vs)), is_causal=True, compute_dtype=torch.bfloat16)
        assert _err(out[a:a + n].transpose(0, 1), ref) <= 2.0 * _err(eager, ref) + 1e-3
        a += n


def test_compiled_under_autocast_matches_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    q, k, v, m = (t.float() for t in _inputs("cpu", g))

    def f(q, k, v, m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=m)

    compiled = torch.compile(f, fullgraph=True)(q, k, v, m)
    eager = f(q, k, v, m)
    assert compiled.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_module_under_autocast_matches_torch():
    torch.manual_seed(5)
    ours = mha_ext.MultiheadAttention(32, 4, batch_first=True)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 30, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, wa = ours(x, x, x)
        b, wb = theirs(x, x, x)
    assert a.dtype == b.dtype and wa.dtype == wb.dtype
    with torch.no_grad():
        ref = theirs.double()(x.double(), x.double(), x.double())[0]
    assert _err(a, ref) <= 2.0 * _err(b, ref) + 1e-3


def test_other_16_bit_inputs_take_the_autocast_dtype_as_torch():
    """float16 query and mask with float32 key / value under a bfloat16
    region: everything but float64 is cast, as torch's SDPA does."""
    g = torch.Generator().manual_seed(6)
    q64, k64, v64, m64 = _inputs("cpu", g)
    args = (q64.half(), k64.float(), v64.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha_ext.scaled_dot_product_attention(*args, attn_mask=m64.half())
        theirs = F.scaled_dot_product_attention(*args, attn_mask=m64.half())
    assert out.dtype == theirs.dtype == torch.bfloat16
    ref = R.attention(*(t.bfloat16().double() for t in (q64.half(), k64, v64)),
                      attn_mask=m64.half().bfloat16().double())
    assert _err(out, ref) <= 2.0 * _err(theirs, ref) + 1e-3


@pytest.mark.parametrize("cache_dtype,input_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_kvcache_under_autocast_takes_the_caches_dtype(cache_dtype, input_dtype):
    """The caches are written in place, so never cast: the query and new rows
    take their dtype (a bfloat16 query from an autocast projection against
    float32 caches, or the other way round). The output against the float64
    reference on each batch's keys after the write, the written rows equal to
    the new rows in the caches' dtype, nothing else in the caches moved."""
    g = torch.Generator().manual_seed(7)
    B, S_max, Hq, Hkv, E = 2, 64, 4, 2, 16
    k_cache = torch.randn(B, S_max, Hkv, E, generator=g).to(cache_dtype)
    v_cache = torch.randn(B, S_max, Hkv, E, generator=g).to(cache_dtype)
    before = (k_cache.clone(), v_cache.clone())
    seqlens = torch.tensor([10, 31], dtype=torch.int32)
    q = torch.randn(B, 3, Hq, E, generator=g).to(input_dtype)
    k_new = torch.randn(B, 3, Hkv, E, generator=g).to(input_dtype)
    v_new = torch.randn(B, 3, Hkv, E, generator=g).to(input_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha_ext.kvcache_attention(q, k_cache, v_cache, seqlens, k_new, v_new, causal=True)
    assert out.dtype == cache_dtype
    for b, n in enumerate(seqlens.tolist()):
        torch.testing.assert_close(k_cache[b, n:n + 3], k_new[b].to(cache_dtype), rtol=0, atol=0)
        torch.testing.assert_close(v_cache[b, n:n + 3], v_new[b].to(cache_dtype), rtol=0, atol=0)
        for c, old in zip((k_cache, v_cache), before):
            assert torch.equal(torch.cat([c[b, :n], c[b, n + 3:]]), torch.cat([old[b, :n], old[b, n + 3:]]))
        keys, vals = (c[b, :n + 3].double().transpose(0, 1) for c in (k_cache, v_cache))
        qb = q[b].to(cache_dtype).double().transpose(0, 1)
        ref = R.attention(qb, keys, vals, is_causal=True, bottom_right=True, enable_gqa=True)
        eager = R.attention(*(t.to(cache_dtype) for t in (qb, keys, vals)), is_causal=True, bottom_right=True,
                            enable_gqa=True, compute_dtype=cache_dtype)
        assert _err(out[b].transpose(0, 1), ref) <= 2.0 * _err(eager, ref) + 1e-5
