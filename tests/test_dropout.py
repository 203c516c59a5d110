"""Dropout: the counter-based Philox contract, forward/backward agreement with
the reference under the same keep-mask, reproducibility, unbiasedness."""
import pytest
import torch

import mha_ext
import reference as R

sdpa = mha_ext.scaled_dot_product_attention


@pytest.mark.parametrize("seed,offset", [(0, 0), (123456789123, 77), (2**62 + 5, 2**33 + 3)])
# rows of 1-63, 64, 128-255 (two 64-column blocks at once, then one) and 256+
# columns: every branch of the vectorised Philox
@pytest.mark.parametrize("shape", [(2, 3, 5, 11), (1, 1, 1, 1), (3, 7, 64), (2, 130), (3, 192), (2, 200), (1, 255),
                                   (4, 257), (2, 3, 700)])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_matches_philox_reference(seed, offset, shape, p):
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    ours = torch.ops.mha_ext.dropout_mask(rng, list(shape), p)
    assert ours.dtype == torch.bool and ours.shape == shape
    assert torch.equal(ours, R.dropout_keep(seed, offset, shape, p))


# Known-answer vectors of Philox4x32-10 published with Random123 (Salmon et
# al., SC'11): (counter, key) -> the four output words.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,words", KAT)
def test_philox_reference_matches_published_vectors(counter, key, words):
    out = R.philox4x32_10(*counter, *key)
    assert tuple(int(w) for w in out) == words


def test_kernel_mask_matches_published_vectors():
    # seed (key) 0 and offset 0: element (row 0, column j) is kept iff word
    # j % 4 of Philox(counter = (j // 4, 0, 0, 0), key = (0, 0)) >= floor(p 2^32);
    # with p just above word w / 2^32 the kernel's mask reads back each word's
    # place in the first published vector
    words = KAT[0][2]
    for j, w in enumerate(words):
        for p, kept in ((w / 2**32 - 1e-7, True), ((w + 1) / 2**32 + 1e-9, False)):
            keep = torch.ops.mha_ext.dropout_mask(torch.tensor([0, 0], dtype=torch.int64), [1, 4], p)
            assert bool(keep[0, j]) == kept, (j, hex(w), p)


def test_keep_fraction():
    rng = torch.tensor([42, 0], dtype=torch.int64)
    keep = torch.ops.mha_ext.dropout_mask(rng, [8, 16, 128, 128], 0.3)
    n = keep.numel()
    # 6 sigma of a binomial proportion
    assert abs(keep.float().mean().item() - 0.7) < 6 * (0.3 * 0.7 / n) ** 0.5


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_and_backward_match_reference_with_same_mask(is_causal):
    q = torch.randn(2, 4, 70, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 300, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 300, 24, dtype=torch.float64, requires_grad=True)
    m = torch.randn(70, 300, dtype=torch.float64, requires_grad=True)
    p = 0.25
    rng = torch.tensor([987654321, 12], dtype=torch.int64)
    out, _, used = torch.ops.mha_ext.attention(q, k, v, m, p, is_causal, None, True, rng)
    assert torch.equal(used, rng)
    keep = R.dropout_keep(987654321, 12, (2, 4, 70, 300), p)
    ref = R.attention(q, k, v, attn_mask=m, is_causal=is_causal, enable_gqa=True, keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, m), g)
    theirs = torch.autograd.grad(ref, (q, k, v, m), g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_reproducible_with_manual_seed_and_fresh_otherwise():
    q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
    torch.manual_seed(7)
    a = sdpa(q, k, v, dropout_p=0.3)
    b = sdpa(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    c = sdpa(q, k, v, dropout_p=0.3)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_op_draws_rng_state_when_none_given():
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    torch.manual_seed(3)
    out1, _, rng1 = torch.ops.mha_ext.attention(q, k, v, None, 0.4)
    out2, _, _ = torch.ops.mha_ext.attention(q, k, v, None, 0.4, False, None, False, rng1)
    assert torch.equal(out1, out2)
    torch.manual_seed(3)
    assert torch.equal(torch.ops.mha_ext.attention(q, k, v, None, 0.4)[2], rng1)


def test_unbiased():
    # E[dropout output] = no-dropout output; judged against the standard error of the mean.
    q, k, v = (torch.randn(1, 2, 8, 8, dtype=torch.float64) for _ in range(3))
    exact = sdpa(q, k, v)
    draws = torch.stack([sdpa(q, k, v, dropout_p=0.4) for _ in range(2000)])
    mean, sem = draws.mean(0), draws.std(0) / 2000**0.5
    z = ((mean - exact).abs() / sem).max().item()
    assert z < 5.5, z


# A dropout frame (rng_state (seed, offset, rows, row0, col0)): the call's
# scores are a block of a larger attention and draw that block of its mask.
# col0 = 7 and 6 start the block off the Philox groups of 4 columns.
@pytest.mark.parametrize("row0,col0", [(0, 0), (13, 7), (40, 6)])
def test_dropout_frame_draws_the_block_of_the_whole_mask(row0, col0):
    seed, offset, rows, cols, p = 2**40 + 9, 31, 90, 400, 0.3
    whole = R.dropout_keep(seed, offset, (2, 4, rows, cols), p)
    L, S = 50, 150
    rng = torch.tensor([seed, offset, rows, row0, col0], dtype=torch.int64)
    keep = whole[..., row0:row0 + L, col0:col0 + S]
    assert torch.equal(torch.ops.mha_ext.dropout_mask(rng, [2, 4, L, S], p), keep)
    q = torch.randn(2, 4, L, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, S, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, S, 8, dtype=torch.float64, requires_grad=True)
    out, _, used = torch.ops.mha_ext.attention(q, k, v, None, p, True, None, True, rng)
    assert torch.equal(used, rng)
    ref = R.attention(q, k, v, is_causal=True, enable_gqa=True, keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_dropout_frame_errors():
    q = torch.randn(1, 2, 10, 8)
    for bad in ([1, 2, 9, 0, 0], [1, 2, 20, -1, 0], [1, 2, 20, 0, -3]):  # rows < row0 + L, negative offsets
        with pytest.raises(RuntimeError, match=r"rng_state's dropout frame \(rows, row0, col0\) must have row0 >= 0, "
                                               r"col0 >= 0 and rows >= row0 \+ 10 \(the query length\)"):
            torch.ops.mha_ext.attention(q, q, q, None, 0.2, False, None, False, torch.tensor(bad))
    # the varlen ops take (seed, offset) only: their rows are packed sequences
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"rng_state must be an int64 tensor of shape \(2\) holding \(seed, offset\) "
                                           r"on the CPU, got torch.int64 of shape \(5\)"):
        torch.ops.mha_ext.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), cu, cu,
                                           10, 10, 0.2, False, None, torch.tensor([1, 2, 20, 0, 0]))


def test_draw_rng_state_is_what_the_op_draws():
    # the (seed, offset) of a call with dropout and no rng_state, and the generator advanced alike
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    torch.manual_seed(3)
    drawn = torch.ops.mha_ext.draw_rng_state(q, 9)
    after = torch.rand(4)
    torch.manual_seed(3)
    _, _, used = torch.ops.mha_ext.attention(q, k, v, None, 0.4)
    assert torch.equal(drawn, used) and torch.equal(torch.rand(4), after)
    with pytest.raises(RuntimeError, match=r"len_kv must be >= 0, got -1"):
        torch.ops.mha_ext.draw_rng_state(q, -1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.mha_ext.draw_rng_state(mode.from_tensor(q), 2**40)  # no length limit
        assert fake.shape == (2,) and fake.dtype == torch.int64


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_mask(reentrant):
    """torch.utils.checkpoint reruns the forward in the backward: the rerun
    must draw the very mask the first run used (torch restores its generator
    around it, and the op draws its seed from that generator), or the
    gradients are silently those of another mask. Output and gradient
    against the reference under the contract's keep mask for the draw."""
    from torch.utils.checkpoint import checkpoint
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    p = 0.3
    q = q0.clone().requires_grad_()
    torch.manual_seed(5)
    out = checkpoint(lambda q: sdpa(q, q, q, dropout_p=p, is_causal=True), q, use_reentrant=reentrant)
    torch.manual_seed(99)  # (the generator moves on before the backward's rerun)
    out.pow(2).sum().backward()
    torch.manual_seed(5)
    seed, offset = torch.randint(0, 2**62, (2,)).tolist()
    keep = R.dropout_keep(seed, offset, (2, 4, 16, 16), p)
    x = q0.clone().requires_grad_()
    ref = R.attention(x, x, x, is_causal=True, keep=keep, dropout_p=p)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q.grad, x.grad, rtol=1e-10, atol=1e-10)
