"""The CUDA backends the emulated tests run on, and what they are held to.

- emul: tests/emul/attention_emul.cpp compiles the CUDA backend (csrc/cuda:
  host functions, launchers and the device code of attention_kernels.h)
  against the CPU emulation of the CUDA primitives (csrc/cuda/simt_emul.h:
  32-lane warps, real block and warp barriers, shared memory per block, the
  documented mma.sync m16n8k16 register layout) as torch.ops.mha_ext_emul.*;
- cuda: the real CUDA kernels on a GPU (OnCuda; skipped without one).

The `backend` fixture gives each in turn; `references` and the assertions
hold a result to the float64 reference, the CPU backend and eager PyTorch.
Used by test_cuda_emul.py, test_cuda_emul_decode.py, test_cuda_emul_settings.py
and the emulated cases of the other test files."""
import glob
import hashlib
import os

import pytest
import torch

import mha_ext  # noqa: F401  (registers torch.ops.mha_ext)
import reference as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
NO_RNG = torch.zeros(2, dtype=torch.long)


def _load_emulation(build=os.path.join(ROOT, "build", "emul_ext"), opt="-O2"):
    """torch.ops.mha_ext_emul, built (where its sources changed) into build,
    at `opt` (the emulated tests' -O2 ran them 1.25x faster than -O1)."""
    from torch.utils.cpp_extension import load

    from mha_ext._cxx_runtime import link_flags

    os.makedirs(build, exist_ok=True)
    # load() rebuilds when sources or flags change; the headers are the code
    # under test, so their digest goes into the flags.
    digest = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)):
        digest.update(open(path, "rb").read())
    load(name="mha_ext_emul",
         sources=[os.path.join(ROOT, "tests", "emul", "attention_emul.cpp"), os.path.join(ROOT, "csrc", "checks.cpp")],
         extra_cflags=[opt, "-std=c++20", "-DMHA_SIMT_EMULATION", "-Wall", "-Werror",
                       f"-DMHA_EMUL_HEADERS={digest.hexdigest()[:12]}"],
         # the shared C++ runtime, as the library's own link line names it: with a
         # static copy (a GPU image's compiler) the emulation's checks crashed
         extra_ldflags=link_flags(),
         build_directory=build, is_python_module=False, verbose=False)
    return torch.ops.mha_ext_emul


class OnCuda:
    """torch.ops.mha_ext on the GPU, with CPU tensors in and out (rng_state,
    a CPU tensor by contract, stays where it is)."""

    @staticmethod
    def _call(op, rng_index, args):
        moved = [a.cuda() if isinstance(a, torch.Tensor) and i != rng_index else a for i, a in enumerate(args)]
        return tuple(r.cpu() for r in op(*moved))

    def attention(self, *args):
        return self._call(torch.ops.mha_ext.attention, 8, args)

    def attention_backward(self, *args):
        return self._call(torch.ops.mha_ext.attention_backward, 11, args)

    def varlen_attention(self, *args):
        return self._call(torch.ops.mha_ext.varlen_attention, 10, args)

    def draw_rng_state(self, like, len_kv):
        return torch.ops.mha_ext.draw_rng_state(like.cuda(), len_kv).cpu()

    def varlen_attention_backward(self, *args):
        return self._call(torch.ops.mha_ext.varlen_attention_backward, 13, args)

    def kvcache_attention(self, q, k_cache, v_cache, *args):
        # the caches are written in place on the GPU; copied back into the CPU ones
        kc, vc = k_cache.cuda(), v_cache.cuda()
        out = self._call(lambda *a: torch.ops.mha_ext.kvcache_attention(a[0], kc, vc, *a[1:]), -1, (q,) + args)
        k_cache.copy_(kc.cpu())
        v_cache.copy_(vc.cpu())
        return out


@pytest.fixture(scope="module", params=[
    "emul", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def backend(request):
    """The CUDA backend under test: emulated on the CPU, or on a GPU."""
    return _load_emulation() if request.param == "emul" else OnCuda()


# The dynamic shared bytes of the bool mask's range scan (launch.h's
# launch_mask_ranges: 2 ints for each of its 4 warps and 2 more), which no
# attention kernel has: how the launch log tells its launches from theirs.
MASK_SCAN_SHARED = (2 * 4 + 2) * 4


def attention_launches(backend):
    """(grids, shared bytes) of the emulated launches since the last call,
    without the bool mask's range scans that come before the forward and
    backward kernels: grids flat, (x, y, z) a launch, as launched_grids."""
    grids, shared = backend.launched_grids(), backend.launched_shared()
    keep = [i for i, s in enumerate(shared) if s != MASK_SCAN_SHARED]
    return [g for i in keep for g in grids[3 * i:3 * i + 3]], [shared[i] for i in keep]


def forward_block(d, len_q, plain, rows="auto"):
    """(query rows, threads) of a 16-bit forward block (launch.h) under
    MHA_EXT_CUDA_FWD_ROWS=rows: the plain kernel's warps take 32 rows, the
    general kernel's 16; d: max(E, Ev)."""
    wide = rows == "128" or (rows == "auto" and len_q > 64 and (plain or d > 64))
    block = 128 if wide else 64
    return block, block if plain else 2 * block


def forward_threads(d, len_q, plain):
    """Threads per block of a 16-bit forward launch with the block size "auto" picks."""
    return forward_block(d, len_q, plain)[1]


def make(shape, dtype, scale=1.0):
    """q (N, Hq, L, E), k (N, Hkv, S, E), v (N, Hkv, S, Ev)."""
    n, hq, hkv, L, S, E, Ev = shape
    q = torch.randn(n, hq, L, E, dtype=torch.float64) * scale
    k = torch.randn(n, hkv, S, E, dtype=torch.float64)
    v = torch.randn(n, hkv, S, Ev, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# (N, Hq, Hkv, L, S, E, Ev): length 1, odd lengths, L != S, E != Ev, GQA, and
# each tile configuration (padded head dim 64, 128, 256).
SHAPES = [
    (1, 1, 1, 1, 1, 8, 8),
    (2, 2, 2, 37, 29, 16, 16),
    (1, 4, 2, 70, 45, 40, 72),
    (1, 2, 1, 33, 80, 128, 128),
    (1, 1, 1, 20, 35, 256, 160),
]


def _err(a, ref):
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def references(q, k, v, go=None, mask=None, **kw):
    """Output and (given go) gradients of q, k, v (and a floating mask) from
    the float64 reference and from plain eager PyTorch in the inputs' dtype."""
    result = []
    for dtype in (torch.float64, q.dtype):
        xs = [x.to(dtype).requires_grad_(go is not None) for x in (q, k, v)]
        m = mask
        if mask is not None and mask.dtype != torch.bool:
            m = mask.to(dtype).requires_grad_(go is not None)
        out = R.attention(*xs, attn_mask=m, compute_dtype=dtype, **kw)
        grads = []
        if go is not None:
            wrt = xs + ([m] if m is not None and m.dtype != torch.bool else [])
            grads = list(torch.autograd.grad(out, wrt, go.to(dtype)))
        result.append((out.detach(), grads))
    return result


def assert_like_cpu(ours, cpu, ref, eager, dtype):
    """float64 / float32: equal to the float64 reference up to rounding
    (1e-10 / 1e-5 of the reference's largest magnitude). half / bfloat16:
    error against the float64 reference at most twice the larger of the CPU
    backend's and plain eager PyTorch's in the same dtype (the CUDA path
    rounds P and dS to the input dtype before their products, as
    FlashAttention does; the CPU backend keeps them in float)."""
    assert ours.shape == cpu.shape and ours.dtype == cpu.dtype
    if dtype in (torch.float64, torch.float32):
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
        torch.testing.assert_close(ours.double(), ref.double(), rtol=tol, atol=tol * scale)
    else:
        bound = 2.0 * max(_err(cpu, ref), _err(eager, ref)) + 1e-6
        assert _err(ours, ref) <= bound, (_err(ours, ref), _err(cpu, ref), _err(eager, ref))


def assert_all_like_cpu(ours, cpu, refs, dtype):
    (ref_out, ref_grads), (eager_out, eager_grads) = refs
    if ref_grads:
        for a, c, r, e in zip(ours, cpu, ref_grads, eager_grads):
            assert_like_cpu(a, c, r, e, dtype)
    else:
        assert_like_cpu(ours, cpu, ref_out, eager_out, dtype)


def run_backward(ops, q, k, v, out, lse, go, mask=None, dropout_p=0.0, is_causal=False, scale=None, gqa=False,
              rng=NO_RNG, mask_grad=False):
    return ops.attention_backward(go, q, k, v, out, lse, mask, dropout_p, is_causal, scale, gqa, rng, mask_grad)


def assert_near_reference(ours, ref, eager, dtype):
    """float64 / float32 against the float64 reference (1e-10 / 2e-5 relative
    to the largest reference value); half / bfloat16 within twice plain eager
    PyTorch's error in that dtype."""
    for a, r, e in zip(ours, ref, eager):
        if dtype in (torch.float64, torch.float32):
            tol = 1e-10 if dtype == torch.float64 else 2e-5
            torch.testing.assert_close(a.double(), r.double(), rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
        else:
            assert _err(a, r) <= 2.0 * _err(e, r) + 1e-3 * r.abs().max().item(), (_err(a, r), _err(e, r))
