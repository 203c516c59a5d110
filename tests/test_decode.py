"""The decode path of the CPU forward (few query rows per key/value head, no
dropout: decode_cpu.cpp's attention_decode_kernel): each K/V tile read once
for a GQA group's rows, keys split into runs of tiles merged by their
logsumexp. Outputs and logsumexp against the float64 reference for shapes
that take it (splits, ragged tiles, masks, variants, NaN and empty rows), in
every dtype, and bit-identical results for any thread count."""
import pytest
import torch

import mha_ext
import reference as R

op = torch.ops.mha_ext

# (N, Hq, Hkv, L, S, E, Ev): L * Hq / Hkv <= 16 rows per key/value head, or up to 64 with S >= 8 of them
SHAPES = [
    (1, 1, 1, 1, 1, 8, 8),
    (1, 8, 2, 1, 3000, 64, 64),     # one batch, 2 heads: 16 splits of 1 tile (of 12)
    (2, 4, 4, 3, 257, 16, 24),      # a ragged last tile
    (1, 32, 8, 1, 2049, 128, 128),  # 4 query heads a group
    (3, 16, 2, 2, 700, 32, 16),     # 16 rows a group
    (1, 2, 2, 4, 256, 17, 5),       # odd head dims
    (2, 4, 4, 1, 700, 64, 72),      # one row a head: V widened in registers, 64 + 8 columns
    (1, 2, 2, 1, 300, 128, 128),    # one row a head, two 64-column pieces
    (1, 6, 2, 1, 500, 40, 300),     # 3 rows (score blocks of 2 and 1), value columns in 256 + 44
    (1, 5, 1, 1, 333, 96, 192),     # 5 rows (4 + 1), 192 value columns in one 256-column block
    (2, 14, 2, 2, 100, 48, 80),     # 14 rows (4 + 4 + 4 + 2), 80 value columns two rows at a time
    (8, 16, 8, 2, 300, 32, 24),     # 64 key/value heads: one split each, rows written by their item
    (4, 16, 16, 16, 40, 32, 32),    # an encoder's 16-row heads (64 of them), 8 rows at a time
    # 16 rows a group, float32: one row a lane (score_block_t, value_rows_t) with
    (1, 32, 8, 4, 1000, 37, 40),    # 4 x 8 + 5 key columns, 16 + 16 + 8 value columns, ragged tiles
    (2, 8, 1, 2, 600, 128, 128),    # one key/value head: its keys split across the threads
    (1, 16, 4, 4, 530, 64, 64),     # head dim 64: whole blocks of adjacent rows at constant offsets
    (4, 16, 4, 4, 1300, 64, 64),    # 16 key/value heads: splits of 2 tiles (the next fetched ahead), a last of 20 keys
    (1, 8, 1, 2, 300, 12, 4),       # 16 rows, 4 value columns: a partial vector a row (AVX2: passes of 8 rows)
    (1, 16, 2, 1, 200, 20, 13),     # 8 rows, 13 value columns: a whole vector and a partial one
    (1, 32, 8, 1, 8200, 128, 128),  # past 32 MiB of float32 K/V (bfloat16: 32.03): rows also fetched 24 KiB ahead
    (1, 12, 12, 1, 2900, 64, 64),   # 64-column rows past 4 MiB (float32 17 MiB, bfloat16 8.5): their far fetch
    # score passes of 4 rows (score_block's 4 x 4 sub-blocks), a partial last block
    (2, 8, 2, 1, 300, 64, 64),      # 4 rows of 64 columns
    (1, 12, 1, 1, 900, 128, 128),   # 12 rows (4 + 4 + 4): the second pass fetches the next block
    # 17-64 rows a key/value head against at least 8 keys a row (decode_cpu.cpp, kDecodeRowsLong)
    (1, 32, 8, 8, 300, 64, 64),     # 32 rows: two groups of 16 lanes
    (2, 16, 2, 5, 400, 48, 40),     # 40 rows: 16 + 16 + 8
    (1, 64, 8, 8, 600, 128, 128),   # 64 rows, a GQA group of 8
    (1, 14, 2, 3, 500, 32, 16),     # 21 rows
    (2, 8, 8, 24, 1000, 64, 64),    # 24 rows of one head (no GQA)
    (1, 4, 1, 16, 513, 16, 24),     # 64 rows, a ragged last tile of 1 key
]


def _inputs(shape, dtype, seed=0):
    N, hq, hkv, L, S, E, Ev = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, hq, L, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(N, hkv, S, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(N, hkv, S, Ev, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _check(q, k, v, mask=None, **variant):
    w = variant.get("window", (-1, -1))
    slopes = variant.get("alibi_slopes")
    out, lse, _ = op.attention(q, k, v, mask, 0.0, variant.get("is_causal", False), None, q.shape[1] != k.shape[1],
                               None, w[0], w[1], variant.get("bottom_right", False), variant.get("softcap", 0.0),
                               slopes)
    gqa = q.shape[1] != k.shape[1]
    ref = R.attention(q, k, v, mask, enable_gqa=gqa, **variant)
    if q.dtype in (torch.float64, torch.float32):
        tol = 1e-10 if q.dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        ref_lse = R.logsumexp(q, k, mask, variant.get("is_causal", False), None, gqa,
                              **{k_: v_ for k_, v_ in variant.items() if k_ != "is_causal"})
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    else:  # within twice plain eager torch's error in the dtype
        eager = R.attention(q, k, v, mask, enable_gqa=gqa, compute_dtype=q.dtype, **variant)
        ea, ee = (out.double() - ref).abs().max().item(), (eager.double() - ref).abs().max().item()
        assert ea <= 2 * ee + 1e-3 * ref.abs().max().item(), (ea, ee)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_reference(shape, dtype):
    _check(*_inputs(shape, dtype))


@pytest.mark.parametrize("variant", [
    dict(is_causal=True, bottom_right=True),
    dict(window=(300, 0), bottom_right=True),
    dict(window=(5, -1), bottom_right=False),  # rows see only the first keys: later splits see none
    dict(softcap=2.0),
    dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01, 0.005])),
], ids=str)
@pytest.mark.parametrize("L", [2, 12], ids=["8 rows a group", "48 rows a group"])
def test_decode_variants_match_reference(variant, L):
    q, k, v = _inputs((1, 8, 2, L, 2000, 32, 32), torch.float32)
    _check(q, k, v, **variant)


@pytest.mark.parametrize("hq", [8, 16, 48], ids=["8 rows a group", "16 rows a group", "48 rows a group"])
@pytest.mark.parametrize("batch", [2, 32], ids=["split keys", "one split a head"])
def test_decode_masks_empty_rows_and_nan(batch, hq):
    q, k, v = _inputs((batch, hq, 2, 2, 1500, 16, 16), torch.float32)
    g = hq // 2  # query heads a group
    mask = torch.rand(batch, hq, 2, 1500, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[0, 1, 0] = False  # a row with no key: output 0, lse -inf
    mask[1, :, 1, :1200] = False  # keys only in the last tiles (with splits: the last split)
    out, lse = _check(q, k, v, mask)
    assert torch.equal(out[0, 1, 0], torch.zeros(16)) and lse[0, 1, 0] == float("-inf")
    k2 = k.clone()
    k2[1, 0, 900] = float("nan")  # NaN in one key: the rows of its group become NaN, no others
    out2, lse2 = op.attention(q, k2, v, None, 0.0, False, None, True)[:2]
    assert out2[1, :g].isnan().all() and lse2[1, :g].isnan().all()
    assert not out2[0].isnan().any() and not out2[1, g:].isnan().any()
    v2 = v.clone()
    v2[0, 0, 700, 0] = float("inf")  # an infinite value: NaN or inf in its column only, for every row of the group
    out3 = op.attention(q, k, v2, None, 0.0, False, None, True)[0]
    assert not out3[0, g:].isnan().any() and not out3[0, :g, :, 1:].isnan().any()
    assert not out3[0, :g, :, 0].isfinite().any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,L", [(8, 2, 1), (32, 8, 4), (4, 4, 2)],
                         ids=["4 rows a group", "16 rows a group", "2 rows a head"])
def test_decode_skips_the_key_tiles_a_bool_mask_hides(dtype, hq, hkv, L):
    # a static KV cache as transformers masks it, (N, 1, L, S_max) bool: the key
    # tiles a bool mask hides from every row of a group are not read, and the
    # keys past the last tile it shows are not split over (decode_cpu.cpp)
    N, S = 4, 2000
    q, k, v = _inputs((N, hq, hkv, L, S, 64, 64), dtype)
    mask = torch.zeros(N, 1, L, S, dtype=torch.bool)
    for i in range(L):
        mask[0, :, i, :300 + 100 * i] = True  # a prefix per row, ending in the second or third tile
    mask[2, :, :, 700:1100] = True  # hidden tiles before its keys (left padding) and after them
    mask[3, :, :, :1] = True  # one key; batch 1: none (output 0, logsumexp -inf)
    out, lse = _check(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == float("-inf")).all()
    # NaN keys and infinite values in tiles hidden from every row never reach the
    # output (as in the tiles a window hides); everything else is bit-identical
    k2, v2 = k.clone(), v.clone()
    for b, j in ((0, 1500), (2, 100), (2, 1800), (3, 600)):
        k2[b, :, j] = float("nan")
        v2[b, :, j] = float("inf")
    out2, lse2 = op.attention(q, k2, v2, mask, 0.0, False, None, hq != hkv)[:2]
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op.attention(q, k, v, mask, 0.0, False, None, hq != hkv)[:2]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], out) and torch.equal(one[1], lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 8])
def test_decode_results_do_not_depend_on_the_thread_count(dtype, L):
    q, k, v = _inputs((1, 32, 8, L, 5000, 64, 64), dtype)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(op.attention(q, k, v, None, 0.0, False, None, True)[:2])
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert torch.equal(runs[0][0], other[0]) and torch.equal(runs[0][1], other[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True], ids=["rows in place", "strided K/V columns"])
def test_decode_after_a_larger_call_of_nan(dtype, strided):
    # Each thread keeps its buffers (rows of Q, scores, O, strided K / V rows)
    # from call to call: a call that fills them with NaN, then smaller calls
    # of other shapes, each against the reference (a buffer element read
    # before this call wrote it would be NaN here)
    def make(shape, seed):
        q, k, v = _inputs(shape, dtype, seed)
        if strided:  # column stride S: K / V rows gathered into the kernel's buffers
            k, v = k.transpose(-1, -2).contiguous().transpose(-1, -2), v.transpose(-1, -2).contiguous().transpose(-1, -2)
        return q, k, v

    for shape in [(2, 32, 8, 4, 3000, 128, 96), (8, 32, 8, 4, 300, 128, 96)]:  # keys split; one split a head
        q, k, v = make(shape, 0)
        out = op.attention(q.fill_(float("nan")), k.fill_(float("nan")), v.fill_(float("nan")), None, 0.0, False,
                           None, True)[0]
        assert out.isnan().all()
    for shape in [(1, 8, 2, 1, 700, 64, 64), (2, 4, 4, 3, 257, 16, 24), (8, 16, 8, 2, 300, 32, 24),
                  (4, 16, 16, 16, 40, 32, 32), (1, 32, 8, 4, 1000, 37, 40)]:
        _check(*make(shape, 1))


# bfloat16 with 4 to 16 rows a key/value head: on a CPU with AMX both products
# on the tile unit (amx_cpu.cpp; value rows read in place as B tiles, O's
# columns in the routine's even / odd order until the item's end), elsewhere
# the AVX512-BF16, AVX2 or portable rows; every shape against the reference
TILE_ROW_SHAPES = [
    (1, 32, 8, 1, 2049, 128, 128),  # 4 rows a group, a ragged last tile of one key
    (2, 12, 12, 4, 700, 64, 64),    # 4 query rows a head, head dim 64
    (2, 16, 2, 1, 300, 64, 96),     # 8 rows, 96 value columns (64 + a last 32)
    (1, 16, 1, 1, 1000, 128, 256),  # 16 rows, 256 value columns, keys split
    (1, 6, 1, 1, 333, 32, 32),      # 6 rows, head dim 32
    (3, 32, 8, 4, 257, 128, 160),   # 16 rows, 1 key in the last tile, 160 value columns
    (1, 8, 1, 2, 40, 256, 64),      # 16 rows, head dim 256 (Q^T's pieces loaded at each step), 40 keys
]


@pytest.mark.parametrize("shape", TILE_ROW_SHAPES, ids=str)
def test_decode_bfloat16_tile_rows(shape):
    _check(*_inputs(shape, torch.bfloat16))


@pytest.mark.parametrize("column", [0, 5, 31, 32, 63], ids=lambda c: f"column {c}")
@pytest.mark.parametrize("hq,L", [(32, 1), (32, 4)], ids=["4 rows a group", "16 rows a group"])
def test_decode_bfloat16_tile_rows_with_an_infinite_value(hq, L, column):
    # The tile routine pairs each value column with its neighbour (one of them
    # times zero): an infinite value must stay in its own column, every other
    # column of every row finite and equal to the reference
    q, k, v = _inputs((1, hq, 8, L, 600, 128, 64), torch.bfloat16)
    v[0, 1, 300, column] = float("inf")
    out = op.attention(q, k, v, None, 0.0, False, None, True)[0]
    g = hq // 8  # query heads of key/value head 1
    others = [c for c in range(64) if c != column]
    assert not out[0, g:2 * g, :, column].isfinite().any()
    assert out[0, :, :, others].isfinite().all() and out[0, :g].isfinite().all() and out[0, 2 * g:].isfinite().all()
    v_fin = v.clone()
    v_fin[0, 1, 300, column] = 0
    ref = R.attention(q, k, v_fin, None, enable_gqa=True)
    eager = R.attention(q, k, v_fin, None, enable_gqa=True, compute_dtype=torch.bfloat16)
    ea = (out[..., others].double() - ref[..., others]).abs().max().item()
    ee = (eager[..., others].double() - ref[..., others]).abs().max().item()
    assert ea <= 2 * ee + 1e-3 * ref.abs().max().item(), (ea, ee)


# (N, Hq, Hkv, L, S, dtype, the decode kernel?): MHA_EXT_CPU_DECODE=off gives every call to the
# dense kernel, whose sums run in another order: a call the decode kernel takes comes out
# different in its last bits, one the dense kernel takes bit-equal
ROUTES = [
    (1, 32, 8, 4, 600, torch.float32, True),    # 16 rows a key/value head
    (1, 32, 8, 8, 600, torch.float32, True),    # 32 rows against 600 keys (8 x 32 = 256 or more)
    (1, 32, 8, 16, 600, torch.float32, True),   # 64 rows
    (1, 32, 8, 16, 400, torch.float32, False),  # 64 rows against fewer than 8 x 64 keys
    (1, 32, 8, 20, 4000, torch.float32, False),  # 80 rows
    (4, 12, 12, 64, 64, torch.float32, False),  # an encoder's square heads
    (1, 64, 8, 8, 600, torch.bfloat16, True),   # 64 rows of bfloat16 (16 on AMX: dense there)
]


@pytest.mark.parametrize("route", ROUTES, ids=str)
def test_decode_kernel_takes_the_calls_its_rule_says(route, monkeypatch):
    import mha_ext.ops
    N, hq, hkv, L, S, dtype, decode = route
    if decode and dtype == torch.bfloat16 and mha_ext.ops.cpu_isa() == "amx" and L * hq // hkv > 16:
        decode = False
    q, k, v = _inputs((N, hq, hkv, L, S, 64, 64), dtype)
    run = lambda: op.attention(q, k, v, None, 0.0, True, None, hq != hkv, None, -1, -1, True)[0]  # noqa: E731
    monkeypatch.setenv("MHA_EXT_CPU_DECODE", "auto")
    auto = run()
    monkeypatch.setenv("MHA_EXT_CPU_DECODE", "off")
    dense = run()
    assert torch.equal(auto, dense) != decode
    ref = R.attention(q, k, v, is_causal=True, bottom_right=True, enable_gqa=hq != hkv)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(dense.double(), ref, rtol=tol, atol=tol)  # (the dense kernel is right too)


def test_decode_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("MHA_EXT_CPU_DECODE", "fast")
    q, k, v = _inputs((1, 4, 4, 1, 50, 16, 16), torch.float32)
    with pytest.raises(RuntimeError, match=r'MHA_EXT_CPU_DECODE must be "auto" or "off", got "fast"'):
        op.attention(q, k, v, None, 0.0, False, None, False)
