"""Every CPU instruction-set path of the kernels is correct, not only the one
this machine picks: each runs in a fresh process with MHA_EXT_CPU_ISA set."""
import os
import subprocess
import sys

import pytest

CHECK = r"""
import torch, mha_ext, reference as R
assert mha_ext.ops.cpu_isa() == "{isa}", mha_ext.ops.cpu_isa()
torch.manual_seed(0)
rng = torch.tensor([1234, 7])
keep = R.dropout_keep(1234, 7, (2, 4, 77, 290), 0.2)
for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 6e-2)):
    for causal in (False, True):
        q = torch.randn(2, 4, 77, 40).to(dtype).requires_grad_()
        k = torch.randn(2, 2, 290, 40).to(dtype).requires_grad_()
        v = torch.randn(2, 2, 290, 24).to(dtype).requires_grad_()
        m = torch.randn(77, 290).to(dtype).requires_grad_()
        out = torch.ops.mha_ext.attention(q, k, v, m, 0.2, causal, None, True, rng)[0]
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, m), g)
        ref = R.attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=True, keep=keep, dropout_p=0.2)
        ref_grads = torch.autograd.grad(ref, (q, k, v, m), g.double())
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)
# no dropout and no float mask: on the bfloat16 pair products the scale rides in the exponential and
# P is written in bfloat16 by it (fold_scale, fuse_p); a bool mask with a row that sees no key; and
# the backward's D of a one-hot row (huge logits) against its dP, each summed in the product's own
# arithmetic (cpu::row_dots, row_dots_bf16_pairs): dK stays that of the reference (0), at head dims
# 16, 64 and 128 (D in one and two blocks of the AVX-512 GEMM's 128, and the pair products' passes);
# on the tile unit (amx) bfloat16 at 16 only, where the tile's sum and D's run in the same order
for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 6e-2)):
    for causal in (False, True):
        q = torch.randn(2, 4, 77, 40).to(dtype).requires_grad_()
        k = torch.randn(2, 2, 290, 40).to(dtype).requires_grad_()
        v = torch.randn(2, 2, 290, 24).to(dtype).requires_grad_()
        b = torch.rand(2, 1, 77, 290) > 0.3
        b[1, 0, 5] = False
        out = torch.ops.mha_ext.attention(q, k, v, b, 0.0, causal, None, True)[0]
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        ref = R.attention(q, k, v, attn_mask=b, is_causal=causal, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g.double())
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        for a, r in zip(grads, ref_grads):
            torch.testing.assert_close(a.double(), r.double(), rtol=tol, atol=tol)
for dtype, seed, E in [(d, s, E) for d in (torch.float32, torch.bfloat16) for s, E in ((0, 16), (1, 16), (0, 64), (1, 128))
                       if not ("{isa}" == "amx" and d == torch.bfloat16 and E > 16)]:
    torch.manual_seed(seed)
    mul = 1e37 if (dtype == torch.bfloat16 and E == 16) else 1e36  # (float scores stay finite)
    q = (torch.randn(1, 2, 37, E, dtype=torch.float64) * mul).to(dtype).requires_grad_()
    k, v = (torch.randn(1, 2, 45, E).to(dtype).requires_grad_() for _ in range(2))
    g = torch.randn(1, 2, 37, E).to(dtype)
    dk = torch.autograd.grad(torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, False)[0], k, g)[0]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    dk_ref = torch.autograd.grad(R.attention(qr, kr, vr), kr, g.double())[0]
    torch.testing.assert_close(dk.double(), dk_ref, rtol=0, atol=0.03)
# the decode path (few rows per key/value head, no dropout): dot_rows, acc_rows and the widening of
# bfloat16 / float16 rows; 8 and 16 rows a key/value head (16: one row a vector lane), 701 keys (a
# last tile of 189: a partial block of keys)
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
    for E, Ev in ((40, 24), (13, 5)):  # (value columns in whole vectors, and a partial one)
        for L in (2, 4):
            q = torch.randn(2, 8, L, E).to(dtype)
            k, v = torch.randn(2, 2, 701, E).to(dtype), torch.randn(2, 2, 701, Ev).to(dtype)
            out = torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, True)[0]
            torch.testing.assert_close(out.double(), R.attention(q, k, v, enable_gqa=True), rtol=tol, atol=tol)
# bfloat16 decode with 8-16 rows a key/value head and head dims that are multiples of 32 (on AMX the
# tile routines): ragged key counts, value dims below / above the key dim, K and V rows strided as in a
# (B, S, H, D) cache, a boolean mask with a row that sees no key, causal rows
for (G, L, E, Ev, S) in ((8, 2, 128, 128, 777), (4, 2, 64, 32, 33), (16, 1, 256, 256, 300), (4, 3, 96, 160, 520),
                         (8, 1, 32, 64, 95), (4, 4, 192, 96, 260)):
    q = torch.randn(2, 2 * G, L, E).bfloat16()
    k = torch.randn(2, S, 2, E).bfloat16().transpose(1, 2)
    v = torch.randn(2, 2, S, Ev).bfloat16()
    m = torch.rand(2, 1, L, S) > 0.3
    m[1, 0, L - 1] = False
    for mask, causal in ((None, False), (m, False), (None, True)):
        out = torch.ops.mha_ext.attention(q, k, v, mask, 0.0, causal, None, True)[0]
        ref = R.attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
# the decode rows' blocks with constant head dims (64, 128) and fetch forms: 1-4 query rows a
# key/value head (1, 2 and 4 a pass, and 3 = 2 + 1) and 32 (two groups of 16 lanes), adjacent rows
# and rows strided as in a (B, S, H, D) cache, values narrower than the keys; then K/V past 32 MiB
# (the far fetch) with one and four rows
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
    for E, Ev in ((64, 64), (128, 128), (128, 64)):
        for G, L in ((1, 1), (2, 1), (4, 1), (1, 3), (8, 4)):  # (8, 4): 32 rows against 300 keys
            q = torch.randn(2, 2 * G, L, E).to(dtype)
            for strided in (False, True):
                if strided:
                    k = torch.randn(2, 300, 2, E).to(dtype).transpose(1, 2)
                    v = torch.randn(2, 300, 2, Ev).to(dtype).transpose(1, 2)
                else:
                    k, v = torch.randn(2, 2, 300, E).to(dtype), torch.randn(2, 2, 300, Ev).to(dtype)
                out = torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, True)[0]
                ref = R.attention(q, k, v, enable_gqa=True)
                torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for G in (1, 4):
        q = torch.randn(1, 4 * G, 1, 64).to(dtype)
        k, v = torch.randn(1, 4, 40000, 64).to(dtype), torch.randn(1, 4, 40000, 64).to(dtype)
        out = torch.ops.mha_ext.attention(q, k, v, None, 0.0, False, None, True)[0]
        torch.testing.assert_close(out.double(), R.attention(q, k, v, enable_gqa=True), rtol=tol, atol=tol)
# masks applied in place on every path: bool and float (-inf, a row of -inf, finfo.min entries)
# with a row left with no key, on a ragged last column block (37 keys) and on the decode path's rows
for L, S in ((37, 37), (3, 300)):
    q, k, v = torch.randn(2, 4, L, 40), torch.randn(2, 4, S, 40), torch.randn(2, 4, S, 24)
    b = torch.rand(2, 1, L, S) > 0.3
    b[0, 0, 1] = False
    f = torch.randn(2, 1, L, S).masked_fill(torch.rand(2, 1, L, S) > 0.8, float("-inf"))
    f[1, 0, 2, ::3] = torch.finfo(torch.float32).min
    f[0, 0, 1] = float("-inf")  # no key left: 0, where a clamped -inf would give the mean of v
    for m in (b, f):
        out = torch.ops.mha_ext.attention(q, k, v, m, 0.0, False, None, False)[0]
        torch.testing.assert_close(out.double(), R.attention(q, k, v, attn_mask=m), rtol=2e-5, atol=2e-5)
# float masks of bfloat16 and float16 calls (widened by this path's vector routine): the same
# hostile entries and a ragged end, with its gradient; also a mask given as a transposed view
# (columns not contiguous: the per-element loop)
for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
    for L, S in ((37, 37), (3, 300), (5, 13)):
        q, k, v = (torch.randn(2, 4, L, 40).to(dtype), torch.randn(2, 4, S, 40).to(dtype),
                   torch.randn(2, 4, S, 24).to(dtype))
        f = (torch.randn(2, 1, L, S) * 3).masked_fill(torch.rand(2, 1, L, S) > 0.8, float("-inf"))
        f[1, 0, 2 % L, ::3] = torch.finfo(dtype).min
        f[0, 0, 1] = float("-inf")
        f = f.to(dtype)
        for m in (f, f.transpose(-1, -2).contiguous().transpose(-1, -2)):
            m = m.detach().requires_grad_()
            out = torch.ops.mha_ext.attention(q, k, v, m, 0.0, False, None, False)[0]
            g = torch.randn_like(out)
            dm = torch.autograd.grad(out, m, g)[0]
            mr = m.detach().double().requires_grad_()
            ref = R.attention(q, k, v, attn_mask=mr)
            dm_ref = torch.autograd.grad(ref, mr, g.double())[0]
            torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
            # dS in this dtype: within twice the error of eager ops rounding to it
            me = m.detach().requires_grad_()
            dm_eager = torch.autograd.grad(R.attention(q, k, v, attn_mask=me, compute_dtype=dtype), me, g)[0]
            err, eager_err = ((d.double() - dm_ref).abs().max().item() for d in (dm, dm_eager))
            assert err <= 2 * eager_err + 1e-3 * dm_ref.abs().max().item(), (err, eager_err)
# the softcap (its tanh by this path's vector routine, forward and backward) on the dense and the
# decode paths, scores from far below the cap to far beyond it; ALiBi (its distances by the vector
# routine) on the same shapes, bottom-right and not causal: distances on both sides of the diagonal
slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
for dtype in (torch.float32, torch.bfloat16):
    for L in (2, 77):
        k = torch.randn(2, 2, 301, 40).to(dtype).requires_grad_()
        v = torch.randn(2, 2, 301, 24).to(dtype).requires_grad_()
        for causal, variant in ((True, dict(softcap=3.0)), (False, dict(alibi_slopes=slopes))):
            q = torch.randn(2, 4, L, 40, dtype=torch.float64)
            if "softcap" in variant:
                q = q * torch.logspace(-5, 3, L, dtype=torch.float64).view(L, 1)
            q = q.to(dtype).requires_grad_()
            out = mha_ext.attention(q, k, v, causal=causal, alignment="bottom_right", enable_gqa=True, **variant)
            g = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), g)
            # against the float64 reference, relative to the largest entry: 1e-4 in float32 (the
            # softcap's query rows scaled up to 1e3 take dK there to 4e-5 on every path, the scalar
            # loop's included; eager float32 ops 3e-6), 2e-2 in bfloat16
            xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
            ref = R.attention(*xs, is_causal=causal, bottom_right=True, enable_gqa=True, **variant)
            ref_grads = torch.autograd.grad(ref, xs, g.double())
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            for a, r in zip((out,) + grads, (ref,) + ref_grads):
                torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
print("ok")
"""


def _supported():
    """The paths this CPU can run, from /proc/cpuinfo's flags, as the library
    decides them (gemm_cpu.cpp, detect_isa): each needs the one before it."""
    text = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    flags = set(text.split())
    has = {"generic": True}
    has["avx2"] = {"avx2", "fma"} <= flags
    has["avx512"] = has["avx2"] and {"avx512f", "avx512bw", "bmi2"} <= flags
    has["avx512bf16"] = has["avx512"] and {"avx512_bf16", "avx512vl"} <= flags
    has["amx"] = has["avx512bf16"] and {"amx_bf16", "amx_tile"} <= flags
    return has


def test_unset_the_best_path_the_cpu_has_is_taken():
    sup = _supported()
    want = next(isa for isa in ("amx", "avx512bf16", "avx512", "avx2", "generic") if sup[isa])
    # AMX also needs the kernel's leave to use the tile state (arch_prctl, Linux 5.16 on); where it
    # is refused the library takes the path below
    accept = {"amx", "avx512bf16"} if want == "amx" else {want}
    env = {k: v for k, v in os.environ.items() if k != "MHA_EXT_CPU_ISA"}
    res = subprocess.run([sys.executable, "-c", "import mha_ext; print(mha_ext.ops.cpu_isa())"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() in accept, (res.stdout, accept)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512bf16", "amx"])
def test_isa_path(isa):
    if not _supported()[isa]:
        pytest.skip(f"this CPU has no {isa}: its kernels cannot run here (an instruction set is not emulated)")
    env = dict(os.environ, MHA_EXT_CPU_ISA=isa)
    here = os.path.dirname(os.path.abspath(__file__))
    res = subprocess.run([sys.executable, "-c", CHECK.format(isa=isa)], cwd=here, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok"
