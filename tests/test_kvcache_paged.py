"""Paged KV caches (block_table, the layout of vLLM and FlashAttention's
flash_attn_with_kvcache): the caches are a pool of fixed-size blocks and
batch b's key j is row j % block_size of block block_table[b, j // block_size].
Outputs and logsumexp against the float64 reference on each batch's keys laid
out contiguously, the in-place writes (into the right blocks, nothing else
touched), decode steps (read in place) and longer chunks, the emulated CUDA
kernels, registration, and the errors (an index out of the pool among them),
which write nothing."""
import pytest
import torch

import mha_ext
from test_kvcache import VARIANTS, _make, _reference

op = torch.ops.mha_ext
BS = 256  # rows per block


def _paged(kc, vc, n_blocks=10, seed=1):
    """A pool holding the dense caches (B, S_max, Hkv, D) block by block at
    shuffled places, the block_table, and the dense -> pool mapping."""
    B, S, hkv, E = kc.shape
    per = S // BS
    g = torch.Generator().manual_seed(seed)
    places = torch.randperm(n_blocks, generator=g)[:B * per].view(B, per)
    pool_k = torch.randn(n_blocks, BS, hkv, E, generator=g, dtype=torch.float64).to(kc.dtype)
    pool_v = torch.randn(n_blocks, BS, hkv, vc.shape[-1], generator=g, dtype=torch.float64).to(vc.dtype)
    for b in range(B):
        for i in range(per):
            pool_k[places[b, i]] = kc[b, i * BS:(i + 1) * BS]
            pool_v[places[b, i]] = vc[b, i * BS:(i + 1) * BS]
    return pool_k, pool_v, places.to(torch.int32)


def _run(q, kc, vc, sl, kn, vn, table, ops=op, **variant):
    w = variant.get("window", (-1, -1))
    return ops.kvcache_attention(q, kc, vc, sl, kn, vn, None, variant.get("is_causal", False), w[0], w[1],
                                 variant.get("softcap", 0.0), variant.get("alibi_slopes"), table)


def _check(dtype, L, name, ops=op):
    variant = VARIANTS[name]
    q, kc, vc, sl, kn, vn = _make(S_max=3 * BS, L=L, seqlens=(0, 300, 700), dtype=dtype)
    pk, pv, table = _paged(kc, vc)
    pk0, pv0 = pk.clone(), pv.clone()
    out, lse = _run(q, pk, pv, sl, kn, vn, table, ops=ops, **variant)
    ref, ref_lse = _reference(q, kc, vc, sl, kn, vn, **variant)
    if dtype in (torch.float64, torch.float32):
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    else:
        eager, _ = _reference(q, kc, vc, sl, kn, vn, compute_dtype=dtype, **variant)
        ea, ee = (out.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
        assert ea <= 2 * ee + 1e-3 * ref.abs().max().item(), (ea, ee)
    # the new rows went to their blocks, and nothing else moved
    want_k, want_v = pk0.clone(), pv0.clone()
    for b in range(3):
        for t in range(L):
            j = int(sl[b]) + t
            want_k[table[b, j // BS], j % BS] = kn[b, t]
            want_v[table[b, j // BS], j % BS] = vn[b, t]
    assert torch.equal(pk, want_k) and torch.equal(pv, want_v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["plain", "causal", "window", "alibi (B, Hq)"])
@pytest.mark.parametrize("L", [1, 4, 12, 40])  # 2, 8 and 24 rows per key/value head: decode in place; 80: gathered
def test_paged_kvcache_matches_reference(dtype, name, L):
    _check(dtype, L, name)


@pytest.fixture(scope="module", params=[
    "emul", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def device_backend(request):
    """The CUDA backend's KV-cache op: emulated on the CPU, or on a GPU."""
    from cuda_backends import OnCuda, _load_emulation

    return _load_emulation() if request.param == "emul" else OnCuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 9])
def test_paged_kvcache_cuda_backend_matches_reference(device_backend, dtype, L):
    _check(dtype, L, "causal", ops=device_backend)


def test_paged_unused_entries_are_never_read():
    # entries past a batch's keys may hold anything (-1 here), as serving engines leave them
    q, kc, vc, sl, kn, vn = _make(S_max=3 * BS, L=5, seqlens=(0, 300, 10))
    pk, pv, table = _paged(kc, vc)
    table[0, 1:] = -1
    table[2, 1:] = 10**6
    for L in (5, 1):  # the gathered path and the decode kernel
        out, lse = _run(q[:, :L], pk.clone(), pv.clone(), sl, kn[:, :L], vn[:, :L], table, is_causal=True)
        ref, ref_lse = _reference(q[:, :L], kc, vc, sl, kn[:, :L], vn[:, :L], is_causal=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-5, atol=2e-5)


def test_paged_generation_loop_matches_reference():
    # prompt, then one row per step, the blocks handed out as the sequence grows
    torch.manual_seed(0)
    B, hq, hkv, E, prompt, steps = 2, 8, 2, 32, 200, 70
    pk, pv = torch.zeros(8, BS, hkv, E), torch.zeros(8, BS, hkv, E)
    table = torch.tensor([[5, 2], [0, 7]], dtype=torch.int32)
    sl = torch.zeros(B, dtype=torch.int32)
    keys, vals = torch.zeros(B, 0, hkv, E), torch.zeros(B, 0, hkv, E)
    for step in range(steps + 1):
        L = prompt if step == 0 else 1
        q, kn, vn = torch.randn(B, L, hq, E), torch.randn(B, L, hkv, E), torch.randn(B, L, hkv, E)
        out = mha_ext.kvcache_attention(q, pk, pv, sl, kn, vn, causal=True, block_table=table)
        keys, vals = torch.cat([keys, kn], 1), torch.cat([vals, vn], 1)
        ref, _ = _reference(q, keys, vals, sl + L, None, None, is_causal=True)
        sl += L
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    assert int(sl[0]) > BS  # the loop crossed into a second block


def test_paged_kvcache_opcheck_and_compile():
    q, kc, vc, sl, kn, vn = _make(S_max=2 * BS, L=2, seqlens=(0, 300, 10), dtype=torch.float64)
    pk, pv, table = _paged(kc, vc, n_blocks=7)
    torch.library.opcheck(op.kvcache_attention,
                          (q, pk.clone(), pv.clone(), sl, kn, vn, None, True, -1, -1, 0.0, None, table))

    def step(q, pk, pv, sl, kn, vn, table):
        return mha_ext.kvcache_attention(q, pk, pv, sl, kn, vn, causal=True, block_table=table)

    a, b = (pk.clone(), pv.clone()), (pk.clone(), pv.clone())
    want = step(q, *a, sl, kn, vn, table)
    got = torch.compile(step, fullgraph=True)(q, *b, sl, kn, vn, table)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _bad():
    q, kc, vc, sl, kn, vn = _make(S_max=2 * BS, L=2, seqlens=(0, 300, 10))
    pk, pv, table = _paged(kc, vc, n_blocks=7)
    good = dict(q=q, kc=pk, vc=pv, sl=sl, kn=kn, vn=vn, table=table)
    out_of_pool = table.clone()
    out_of_pool[1, 1] = 7
    negative = table.clone()
    negative[0, 0] = -2
    return good, {
        "index past the pool": (dict(table=out_of_pool), r"block_table\[1, 1\] must be in \[0, num_blocks\) = "
                                                         r"\[0, 7\), got 7"),
        "index negative": (dict(table=negative), r"block_table\[0, 0\] must be in \[0, num_blocks\) = \[0, 7\), got -2"),
        "table int64": (dict(table=table.long()), r"block_table must be an int32 tensor of shape \(B, max_blocks\) "
                                                  r"with B = 3, got torch.int64 of shape \(3, 2\)"),
        "table batch": (dict(table=table[:2]), r"block_table must be an int32 tensor of shape \(B, max_blocks\) with "
                                               r"B = 3, got torch.int32 of shape \(2, 2\)"),
        "block size": (dict(kc=pk[:, :128], vc=pv[:, :128]), r"with a block_table, the cache blocks \(k_cache dim 1\) "
                                                             r"must hold a multiple of 256 rows, got 128"),
        "v pool shape": (dict(vc=pv[:5]), r"v_cache must have shape \(num_blocks, block_size, Hkv, Ev\) = "
                                          r"\(7, 256, 2, 24\), got \(5, 256, 2, 24\)"),
        "past the table": (dict(sl=torch.tensor([0, 511, 3], dtype=torch.int32)),
                           r"cache_seqlens\[1\] must be in \[0, 510\] \(S_max = 512 \(max_blocks x block_size\) "
                           r"minus 2 new keys\), got 511"),
    }


@pytest.mark.parametrize("name", list(_bad()[1]))
def test_paged_bad_inputs_name_the_argument(name):
    good, cases = _bad()
    change, pattern = cases[name]
    a = {**good, **change}
    before = a["kc"].clone()
    with pytest.raises(RuntimeError, match=pattern):
        op.kvcache_attention(a["q"], a["kc"], a["vc"], a["sl"], a["kn"], a["vn"], None, False, -1, -1, 0.0, None,
                             a["table"])
    assert torch.equal(a["kc"], before)  # nothing written


@pytest.mark.parametrize("name", ["table int64", "table batch", "block size", "v pool shape"])
def test_paged_fake_kernel_says_the_same(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    good, cases = _bad()
    change, pattern = cases[name]
    a = {**good, **change}
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v) for k, v in a.items()}
        with pytest.raises(RuntimeError, match=pattern):
            op.kvcache_attention(f["q"], f["kc"], f["vc"], f["sl"], f["kn"], f["vn"], None, False, -1, -1, 0.0, None,
                                 f["table"])
