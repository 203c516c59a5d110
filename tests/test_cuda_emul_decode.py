"""Decode-like calls on the CUDA backend (emulated, and on a GPU where there
is one): few query rows against many keys. The key splits (flash-decoding:
runs of key tiles merged by their logsumexp, the count MHA_EXT_CUDA_KV_SPLITS
or the one-wave rule), a GQA group packed into one block, and the decode
kernel (attention_decode_kernel: at most 16 query rows a block, its warps
sharing each key tile), each held to the CPU backend and the float64
reference, on hostile rows too. The backends: cuda_backends.py."""
import pytest
import torch

import mha_ext  # noqa: F401  (registers torch.ops.mha_ext)
import reference as R
from cuda_backends import (DTYPES, OnCuda, assert_all_like_cpu, assert_like_cpu, attention_launches, backend,  # noqa: F401
                           make, references)


# Decode-like shapes (N, Hq, Hkv, L, S, E, Ev): few query rows against many keys.
SPLIT_SHAPES = [(1, 4, 2, 1, 300, 64, 64), (2, 2, 2, 3, 257, 40, 72), (1, 2, 1, 2, 150, 128, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SPLIT_SHAPES)
def test_emul_key_splits_match_the_reference(backend, dtype, shape, monkeypatch):
    # MHA_EXT_CUDA_KV_SPLITS: the keys each block's rows may see cut into
    # runs of whole tiles, a block each, merged by the combine kernel
    # (flash-decoding). Each count against the reference and the CPU's
    # logsumexp, with the variants that move a row's keys, a mask with a
    # fully masked row, dropout, GQA and E != Ev.
    torch.manual_seed(3)
    n, hq, hkv, L, S = shape[:5]
    q, k, v = make(shape, dtype)
    gqa = hq != hkv
    mask = torch.rand(n, 1, L, S) > 0.3
    mask[0, 0, 0] = False  # a row that may see no key: 0, lse -inf
    slopes = torch.rand(hq, dtype=torch.float32) * 0.1
    rng = torch.tensor([1234567, 89], dtype=torch.long)
    cases = {"plain": {}, "causal": dict(is_causal=True), "window": dict(window=(90, 0)),
             "softcap and alibi": dict(softcap=3.0, alibi_slopes=slopes), "mask": dict(attn_mask=mask),
             "dropout": dict(dropout_p=0.2)}
    for name, case in cases.items():
        win = case.get("window", (-1, -1))
        args = (q, k, v, case.get("attn_mask"), case.get("dropout_p", 0.0), case.get("is_causal", False), None, gqa,
                rng, win[0], win[1], True, case.get("softcap", 0.0), case.get("alibi_slopes"))
        kw = dict(enable_gqa=gqa, bottom_right=True, mask=case.get("attn_mask"), is_causal=case.get("is_causal", False),
                  window=win, softcap=case.get("softcap", 0.0), alibi_slopes=case.get("alibi_slopes"))
        if "dropout_p" in case:
            kw.update(keep=R.dropout_keep(1234567, 89, (n, hq, L, S), 0.2), dropout_p=0.2)
        cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(*args)
        refs = references(q, k, v, **kw)
        elem, d = torch.empty(0, dtype=dtype).element_size(), max(shape[5], shape[6])
        tile = {2: 64 if d <= 128 else 32, 4: 32 if d <= 128 else 16, 8: 16}[elem]  # TileConfig::kFwdBlockN
        for splits in ("1", "3", "7"):
            monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
            if isinstance(backend, OnCuda):
                out, lse, _ = backend.attention(*args)
            else:
                attention_launches(backend)
                out, lse, _ = backend.attention(*args)
                grids = attention_launches(backend)[0]
                # one query block, times the splits (at most one a key tile) on grid x, then the combine
                want = min(int(splits), -(-S // tile))
                assert grids[0] == want and len(grids) == (3 if want == 1 else 6), (name, splits, grids)
            assert_all_like_cpu(out, cpu_out, refs, dtype)
            assert torch.equal(torch.isinf(lse), torch.isinf(cpu_lse)), (name, splits)
            torch.testing.assert_close(lse, cpu_lse, rtol=1e-5 if dtype != torch.float64 else 1e-12, atol=1e-5)


def test_emul_key_splits_auto_fills_the_gpu(backend, monkeypatch):
    # "auto" (the default): a decode step of 2 x 4 heads makes 8 blocks for
    # 132 multiprocessors (the emulation's H100): the keys split into runs of
    # at least 4 tiles, toward one wave of blocks (as many as the
    # multiprocessors hold at once by shared memory, 228 KiB each: 4 blocks
    # of 64 rows at head dim 64, 46 KiB each, 2 at 128, 86 KiB) and never
    # more; keys of fewer than 8 tiles are not split.
    if isinstance(backend, OnCuda):
        pytest.skip("reads the emulation's launch log")
    for name in ("MHA_EXT_CUDA_KV_SPLITS", "MHA_EXT_CUDA_FWD_ROWS", "MHA_EXT_CUDA_FWD_WARP_ROWS", "MHA_EXT_CUDA_OPERANDS"):
        monkeypatch.delenv(name, raising=False)
    q, k, v = make((2, 4, 4, 1, 2048, 64, 64), torch.float16)
    backend.launched_grids()
    out = backend.attention(q, k, v, None, 0.0, False, None, False)[0]
    grids = backend.launched_grids()
    assert grids[:3] == [min(4 * 132 // 8, 2048 // 64 // 4), 3, 3] and len(grids) == 6, grids
    assert_like_cpu(out, torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, False)[0],
                    R.attention(q, k, v), R.attention(q, k, v, compute_dtype=torch.float16), torch.float16)
    # where the rule differs from rounding up to twice the multiprocessors:
    # 150 one-row blocks at head dim 64 take 3 splits (450 blocks of the 528
    # that fit; 12 key tiles allow 3); 20 blocks of 17 rows (the
    # plain kernel's) at head dim 128 13 (260 of 264: 14 would start 16 of 280
    # blocks in a second wave); 40 one-row blocks (the decode kernel's, 74 KiB:
    # 3 a multiprocessor) at head dim 128 9 (360 of 396)
    for shape, splits, threads in (((1, 150, 150, 1, 768, 64, 64), 3, 128), ((1, 20, 20, 17, 3584, 128, 128), 13, 64),
                                   ((1, 40, 40, 1, 2304, 128, 128), 9, 128)):
        q, k, v = make(shape, torch.float16)
        backend.launched_grids(), backend.launched_threads()
        out = backend.attention(q, k, v, None, 0.0, False, None, False)[0]
        grids, launched = backend.launched_grids(), backend.launched_threads()
        assert grids[0] == splits and len(grids) == 6, (shape, grids)  # the query block x splits on x
        assert launched[0] == threads, (shape, launched)
        assert_like_cpu(out, torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, False)[0],
                        R.attention(q, k, v), R.attention(q, k, v, compute_dtype=torch.float16), torch.float16)
    q, k, v = make((1, 1, 1, 300, 300, 64, 64), torch.float16)
    backend.attention(q, k, v, None, 0.0, False, None, False)
    assert backend.launched_grids() == [3, 1, 1]  # the plain kernel's 128-row blocks, 5 key tiles, one launch
    monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", "16")
    backend.attention(q, k, v, None, 0.0, False, None, False)
    assert backend.launched_grids() == [5, 1, 1]  # the general kernel's 64-row blocks at head dim 64
    monkeypatch.setenv("MHA_EXT_CUDA_FWD_WARP_ROWS", "auto")
    monkeypatch.setenv("MHA_EXT_CUDA_OPERANDS", "scalar")  # plain loads: the general kernel has them
    backend.attention(q, k, v, None, 0.0, False, None, False)
    assert backend.launched_grids() == [5, 1, 1]


def test_emul_key_splits_setting_is_checked(backend, monkeypatch):
    q, k, v = make((1, 1, 1, 1, 8, 16, 16), torch.float16)
    for bad in ("0", "65", "two"):
        monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", bad)
        with pytest.raises((RuntimeError, ValueError),
                           match=f'MHA_EXT_CUDA_KV_SPLITS must be "auto" or a number from 1 to 64, got "{bad}"'):
            backend.attention(q, k, v, None, 0.0, False, None, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emul_decode_packs_a_gqa_group_into_one_block(backend, dtype, monkeypatch):
    # One query row a head: the G query heads of a key/value head run as the
    # rows of one block (the grid covers batch x key/value heads), with the
    # bits of the unpacked call on K/V repeated per query head and the
    # reference's values; causal aligned bottom-right (what a KV cache step
    # passes) bounds nothing there and packs too; a window, ALiBi or dropout
    # keep a block a query head.
    monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", "1")
    torch.manual_seed(5)
    B, hq, hkv, S = 2, 8, 2, 150
    q, k, v = make((B, hq, hkv, 1, S, 64, 48), dtype)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    mask = torch.rand(B, hq, 1, S) > 0.2
    mask[1, 5] = False  # a row that may see no key
    cases = {"plain": ({}, True), "causal": (dict(is_causal=True), True),
             "mask and softcap": (dict(mask=mask, softcap=2.0), True), "window": (dict(window=(60, 0)), False),
             "alibi": (dict(alibi_slopes=torch.linspace(0.05, 0.4, hq)), False),
             "dropout": (dict(dropout_p=0.3), False)}
    rng = torch.tensor([4321, 7], dtype=torch.long)
    for name, (case, packs) in cases.items():
        win = case.get("window", (-1, -1))

        def call(kk, vv, gqa):
            args = (q, kk, vv, case.get("mask"), case.get("dropout_p", 0.0), case.get("is_causal", False), None, gqa,
                    rng, win[0], win[1], True, case.get("softcap", 0.0), case.get("alibi_slopes"))
            if isinstance(backend, OnCuda):
                return backend.attention(*args)[:2], None
            attention_launches(backend)
            result = backend.attention(*args)[:2]
            return result, attention_launches(backend)[0]

        (out, lse), grids = call(k, v, True)
        (out_u, lse_u), grids_u = call(kr, vr, False)
        if grids is not None:  # one query block; (batch, head) pairs over y (at most 3 here) and z
            assert grids == ([1, 3, 2] if packs else [1, 3, 6]) and grids_u == [1, 3, 6], (name, grids, grids_u)
        assert torch.equal(out, out_u) and torch.equal(lse, lse_u), name
        kw = dict(enable_gqa=True, bottom_right=True, mask=case.get("mask"), is_causal=case.get("is_causal", False),
                  window=win, softcap=case.get("softcap", 0.0), alibi_slopes=case.get("alibi_slopes"))
        if "dropout_p" in case:
            kw.update(keep=R.dropout_keep(4321, 7, (B, hq, 1, S), 0.3), dropout_p=0.3)
        cpu_out = torch.ops.mha_ext.attention(q, k, v, case.get("mask"), case.get("dropout_p", 0.0),
                                              case.get("is_causal", False), None, True, rng, win[0], win[1], True,
                                              case.get("softcap", 0.0), case.get("alibi_slopes"))[0]
        assert_all_like_cpu(out, cpu_out, references(q, k, v, **kw), dtype)


# (N, Hq, Hkv, L, S, E, Ev) and dtype: at most 16 query rows a block, the
# decode kernel's calls (one instantiation a dtype and head dim; each dtype
# at both head dims)
DECODE_SHAPES = [((2, 4, 4, 1, 300, 64, 64), torch.float16),  # one row a head, a partial last key tile
                 ((1, 16, 1, 1, 257, 128, 128), torch.bfloat16),  # a GQA group of 16 packed into one block
                 ((2, 6, 2, 5, 190, 40, 72), torch.bfloat16),  # 5 rows (a chunked KV-cache step), E != Ev, GQA
                 ((1, 2, 2, 16, 129, 128, 96), torch.float16),  # 16 rows
                 ((1, 8, 2, 1, 200, 256, 256), torch.float16)]  # head dim 256: 32-key tiles, 2 warps


def decode_shared_bytes(d):
    """The decode kernel's shared bytes (launch.h): a 16-row Q tile and two
    stages of K and V tiles (64 keys, 32 at head dim 256), rows padded by 8
    elements; d: max(E, Ev)."""
    padded = 64 if d <= 64 else 128 if d <= 128 else 256
    return 2 * (16 + 4 * (64 if padded <= 128 else 32)) * (padded + 8)


@pytest.mark.parametrize("shape,dtype", DECODE_SHAPES)
def test_emul_decode_kernel_warps_share_the_key_tiles(backend, shape, dtype, monkeypatch):
    # At most 16 query rows: the decode kernel, whose 4 warps take 16 keys of
    # each tile each and merge their (max, sum, O) in shared memory. Against
    # the float64 reference and the CPU's logsumexp: causal aligned
    # bottom-right (each of several rows ends at another key, so the band cuts
    # a warp's keys differently per row), a window, a bool mask with a fully
    # masked row, a float mask with softcap, ALiBi; one key split and three;
    # MHA_EXT_CUDA_DECODE=off runs the plain or general kernel to the same
    # bounds (the launch log's shared bytes say which ran; their key splits
    # have tests of their own).
    for name in ("MHA_EXT_CUDA_KV_SPLITS", "MHA_EXT_CUDA_FWD_ROWS", "MHA_EXT_CUDA_FWD_WARP_ROWS",
                 "MHA_EXT_CUDA_OPERANDS"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(7)
    n, hq, hkv, L, S = shape[:5]
    q, k, v = make(shape, dtype)
    gqa = hq != hkv
    rng = torch.tensor([99, 1], dtype=torch.long)
    bool_mask = torch.rand(n, hq, L, S) > 0.25
    bool_mask[0, -1, L - 1] = False  # a row that sees no key: 0, lse -inf
    float_mask = torch.randn(n, 1, L, S).to(dtype)
    cases = {"plain": {}, "causal": dict(is_causal=True), "window": dict(window=(70, 0)),
             "bool mask": dict(mask=bool_mask), "float mask and softcap": dict(mask=float_mask, softcap=4.0),
             "alibi": dict(alibi_slopes=torch.linspace(0.05, 0.5, hq))}
    for name, case in cases.items():
        win = case.get("window", (-1, -1))
        args = (q, k, v, case.get("mask"), 0.0, case.get("is_causal", False), None, gqa, rng, win[0], win[1], True,
                case.get("softcap", 0.0), case.get("alibi_slopes"))
        cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(*args)
        refs = references(q, k, v, enable_gqa=gqa, bottom_right=True, is_causal=case.get("is_causal", False),
                          window=win, mask=case.get("mask"), softcap=case.get("softcap", 0.0),
                          alibi_slopes=case.get("alibi_slopes"))
        for decode, splits in (("auto", "1"), ("auto", "3"), ("off", "1")):
            monkeypatch.setenv("MHA_EXT_CUDA_DECODE", decode)
            monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
            if isinstance(backend, OnCuda):
                out, lse, _ = backend.attention(*args)
            else:
                attention_launches(backend)
                out, lse, _ = backend.attention(*args)
                grids, shared = attention_launches(backend)
                ran_decode = shared[0] == decode_shared_bytes(max(shape[5], shape[6]))
                assert ran_decode == (decode == "auto") and grids[0] == int(splits), (name, decode, splits, grids)
            assert_all_like_cpu(out, cpu_out, refs, dtype)
            assert torch.equal(torch.isinf(lse), torch.isinf(cpu_lse)), (name, decode, splits)
            torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,dtype", [((3, 8, 2, 1, 600, 64, 64), torch.float16),
                                         ((3, 2, 2, 3, 600, 128, 96), torch.bfloat16)],
                         ids=["a GQA group packed", "3 rows a head"])
def test_emul_decode_kernel_reads_only_the_keys_a_bool_mask_shows(backend, shape, dtype, monkeypatch):
    # transformers' StaticCache: a (N, 1, L, S_max) bool mask hides the rows past
    # each batch's length; a left-padded batch's mask hides its first keys. The
    # decode kernel reads keys only from the first to the last one the mask
    # shows its rows (bool_mask_keys_range), split over by the key splits: NaN
    # keys and infinite values outside them change nothing (the CPU kernels
    # skip them too). Against the CPU backend and the float64 reference.
    for name in ("MHA_EXT_CUDA_DECODE", "MHA_EXT_CUDA_FWD_WARP_ROWS", "MHA_EXT_CUDA_FWD_ROWS"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(17)
    n, hq, hkv, L, S = shape[:5]
    q, k, v = make(shape, dtype)
    mask = torch.zeros(n, 1, L, S, dtype=torch.bool)
    for i in range(L):
        mask[0, 0, i, :130 + 40 * i] = True  # a prefix a row, the last row's the longest
    mask[2, 0, :, 200:330] = True  # batch 1 sees no key: 0, lse -inf
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 400:] = float("nan")  # past the last shown key of every batch
    v2[:, :, 400:] = float("inf")
    k2[2, :, :192] = float("nan")  # the tiles before batch 2's first shown key (200)
    v2[2, :, :192] = float("inf")
    args = (q, k, v, mask, 0.0, False, None, hq != hkv)
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(*args)
    refs = references(q, k, v, enable_gqa=hq != hkv, mask=mask)
    for splits in ("1", "3", "auto"):
        monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
        if not isinstance(backend, OnCuda):
            backend.launched_shared()
        out, lse, _ = backend.attention(*args)
        if not isinstance(backend, OnCuda):
            assert backend.launched_shared()[0] == decode_shared_bytes(max(shape[5], shape[6]))
        assert_all_like_cpu(out, cpu_out, refs, dtype)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == float("-inf")).all()
        torch.testing.assert_close(lse, cpu_lse, rtol=1e-5, atol=1e-5)
        out2, lse2, _ = backend.attention(q, k2, v2, mask, 0.0, False, None, hq != hkv)
        assert torch.equal(out2, out) and torch.equal(lse2, lse), splits


@pytest.mark.parametrize("splits", ["1", "3"])
def test_emul_decode_kernel_hostile_rows(backend, splits, monkeypatch):
    # The decode kernel (float16, a GQA group of 8 packed): logits of about
    # 1e2 stay finite, a NaN in one query head makes that row (only) NaN
    # through the warps' merge, and a row whose query is zero averages V.
    # Against the CPU backend and the float64 reference.
    for name in ("MHA_EXT_CUDA_DECODE", "MHA_EXT_CUDA_FWD_WARP_ROWS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
    torch.manual_seed(13)
    q, k, v = make((2, 8, 1, 1, 300, 128, 128), torch.float16, scale=8.0)
    q[0, 3] = 0
    q[1, 6, 0, 17] = float("nan")
    nan_rows = torch.zeros(2, 8, 1, dtype=torch.bool)
    nan_rows[1, 6, 0] = True
    if not isinstance(backend, OnCuda):
        backend.launched_shared()
    out, lse, _ = backend.attention(q, k, v, None, 0.0, False, None, True)
    if not isinstance(backend, OnCuda):
        assert backend.launched_shared()[0] == decode_shared_bytes(128)
    assert torch.isnan(out).any(-1).equal(nan_rows) and torch.isnan(lse).equal(nan_rows)
    q_ok = q.clone()
    q_ok[1, 6, 0, 17] = 0
    cpu_out, cpu_lse, _ = torch.ops.mha_ext.attention(q_ok, k, v, None, 0.0, False, None, True)
    fin = ~nan_rows
    (ref, _), (eager, _) = references(q_ok, k, v, enable_gqa=True)
    assert_like_cpu(out[fin], cpu_out[fin], ref[fin], eager[fin], torch.float16)
    torch.testing.assert_close(lse[fin], cpu_lse[fin], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out[0, 3, 0].double(), v[0, 0].double().mean(0), rtol=0, atol=2e-3)


def test_emul_decode_setting_is_checked(backend, monkeypatch):
    q, k, v = make((1, 1, 1, 1, 8, 16, 16), torch.float16)
    monkeypatch.setenv("MHA_EXT_CUDA_DECODE", "on")
    with pytest.raises((RuntimeError, ValueError), match='MHA_EXT_CUDA_DECODE must be "auto" or "off", got "on"'):
        backend.attention(q, k, v, None, 0.0, False, None, False)


@pytest.mark.parametrize("hkv,splits", [(1, "1"), (4, "1"), (1, "3")])
def test_emul_decode_step_hostile_rows(backend, hkv, splits, monkeypatch):
    # One query row a head (a GQA group packed into 4 of a warp's 16 rows,
    # or a head a block): the rows past the query are zero padding, so whole
    # key tiles take the interior path; huge logits stay finite, a NaN in one
    # head's query makes that head's row (only) NaN, against the float64
    # reference on the rest (full tiles and a partial last one; one key
    # split, or three merged)
    monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
    torch.manual_seed(11)
    B, hq, S, E = 2, 4, 150, 64
    q, k, v = make((B, hq, hkv, 1, S, E, E), torch.float32, scale=40.0)
    q[1, 2, 0, 5] = float("nan")
    nan_rows = torch.zeros(B, hq, 1, dtype=torch.bool)
    nan_rows[1, 2, 0] = True
    out, lse, _ = backend.attention(q, k, v, None, 0.0, False, None, hkv != hq)
    assert torch.isnan(out).any(-1).equal(nan_rows) and torch.isnan(lse).equal(nan_rows)
    q_ok = q.clone()
    q_ok[1, 2, 0, 5] = 0
    gqa = dict(enable_gqa=hkv != hq)
    ref = R.attention(q_ok.double(), k.double(), v.double(), **gqa)
    ref_lse = R.logsumexp(q_ok.double(), k.double(), **gqa)
    # logits ~ 1e2: exp(score - lse) in float carries eps * |lse| relative error
    spread = 1.0 + ref_lse.abs().max().item()
    fin = ~nan_rows
    torch.testing.assert_close(out[fin].double(), ref[fin], rtol=0, atol=1e-6 * spread * max(1.0, ref.abs().max().item()))
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], rtol=0, atol=1e-6 * spread)


def test_emul_key_splits_keep_a_nan_behind_masked_scores(backend, monkeypatch):
    # A NaN value row at a masked key reaches its row (P = 0, 0 x NaN), in the
    # unsplit kernel and on the CPU; with the keys split, the run holding it
    # saw no key at all and weighs 0 in the merge, and its NaN still arrives.
    q, k, v = make((1, 2, 2, 1, 300, 64, 64), torch.float32)
    v[0, 0, 100] = float("nan")
    mask = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    mask[..., 64:200] = False
    args = (q, k, v, mask, 0.0, False, None, False)
    cpu = torch.ops.mha_ext.attention(*args)[0]
    assert torch.isnan(cpu[0, 0]).all() and not torch.isnan(cpu[0, 1]).any()
    for splits in ("1", "3", "5"):
        monkeypatch.setenv("MHA_EXT_CUDA_KV_SPLITS", splits)
        out = backend.attention(*args)[0]
        assert torch.equal(torch.isnan(out), torch.isnan(cpu)), splits
        torch.testing.assert_close(out[0, 1], cpu[0, 1], rtol=1e-5, atol=1e-5)
