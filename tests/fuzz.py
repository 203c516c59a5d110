"""A seeded generator of attention cases and the check of one case against the
float64 reference, forward and backward. Used by tests/test_fuzz.py for the
CPU backend and for the emulated CUDA backend.

Every case is a pure function of its seed: `case(seed)` rebuilds it, so a
failure names the one seed that reproduces it.

Tolerances are per element and scaled by the magnitude of the summed terms
(`reference.magnitudes`): float64 and float32 must stay within a small multiple
of their epsilon times that magnitude; float16 / bfloat16 within twice the
error (max over the tensor) of plain eager PyTorch in that dtype, plus one
epsilon of the dtype times the magnitude (the rounding of the output that the
backward reads; see the README on low-precision gradients)."""
import dataclasses
import math
from typing import Optional

import torch

import reference as R

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
# per-element bound for float64 / float32: c * magnitude of the summed terms
REL = {torch.float64: 1e-12, torch.float32: 4e-6}


@dataclasses.dataclass
class Case:
    seed: int
    dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    dropout_p: float
    is_causal: bool
    scale: Optional[float]
    gqa: bool
    rng: torch.Tensor
    grad_out: torch.Tensor
    what: str  # a short description for failure messages
    window: tuple = (-1, -1)
    bottom_right: bool = False
    softcap: float = 0.0
    alibi: Optional[torch.Tensor] = None

    @property
    def variant(self) -> dict:  # the reference's keywords
        return dict(window=self.window, bottom_right=self.bottom_right, softcap=self.softcap, alibi_slopes=self.alibi)

    @property
    def mask_grad(self) -> bool:
        return self.mask is not None and self.mask.dtype != torch.bool


def _strided(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """t, or the same values in a non-contiguous layout (transposed storage or
    a column slice of a wider tensor)."""
    choice = int(torch.randint(0, 3, (1,), generator=g))
    if choice == 1:  # storage with L and E swapped, viewed back
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if choice == 2:  # every other column of a wider tensor
        wide = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


def case(seed: int, dtypes=DTYPES, max_len: int = 150) -> Case:
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    dtype = pick(dtypes)
    batch = pick([(), (1,), (2,), (2, 1), (1, 3)])
    hkv = pick([1, 2, 3])
    group = pick([1, 1, 2, 3])
    hq = hkv * group
    lengths = [1, 2, 7, 16, 31, 64, 65, 100, max_len]
    L, S = pick(lengths), pick(lengths)
    E = pick([4, 8, 16, 33, 64])
    Ev = pick([E, E, 8, 24])
    is_causal = pick([False, False, True])
    scale = pick([None, None, 0.3, 1.7])
    dropout_p = pick([0.0, 0.0, 0.0, 0.25])
    logit_scale = pick([1.0, 1.0, 1.0, 4.0])  # sharper softmax now and then
    q = _strided((randn(*batch, hq, L, E) * logit_scale).to(dtype), g)
    k = _strided(randn(*batch, hkv, S, E).to(dtype), g)
    v = _strided(randn(*batch, hkv, S, Ev).to(dtype), g)

    mask_kind = pick(["none", "none", "bool", "float", "padding", "neg-inf rows"])
    mask_shape = pick([(L, S), (1, S), (hq, L, S), tuple(batch) + (1, L, S), tuple(batch) + (hq, 1, S)])
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(mask_shape, generator=g) > 0.25
    elif mask_kind == "float":
        mask = randn(*mask_shape).to(dtype)
    elif mask_kind in ("padding", "neg-inf rows"):
        fill = torch.finfo(dtype).min if mask_kind == "padding" else float("-inf")
        mask = torch.zeros(mask_shape, dtype=torch.float64)
        cols = torch.rand(mask_shape[-1], generator=g) < 0.3
        mask[..., cols] = fill  # padded keys
        if mask_shape[-2] > 1:
            rows = torch.rand(mask_shape[-2], generator=g) < 0.3
            mask[..., rows, :] = fill  # query rows that see only padding
        mask = mask.to(dtype)
    rng = torch.randint(0, 2**62, (2,), generator=g, dtype=torch.int64)
    grad_out = randn(*batch, hq, L, Ev).to(dtype)
    # the variants (mha_ext.attention): alignment, windows, softcap, ALiBi
    bottom_right = pick([False, False, True])
    window = (pick([-1, -1, 0, 5, 40]), pick([-1, -1, 0, 3]))
    softcap = pick([0.0, 0.0, 0.0, 2.0, 30.0])
    alibi = None
    if pick([False, False, True]):
        alibi = torch.rand(tuple(batch) + (hq,) if pick([False, True]) else (hq,), generator=g) * 0.5
    what = (f"dtype={str(dtype)[6:]} batch={batch} Hq={hq} Hkv={hkv} L={L} S={S} E={E} Ev={Ev} causal={is_causal} "
            f"scale={scale} dropout={dropout_p} logits x{logit_scale} mask={mask_kind}"
            + (f" {tuple(mask.shape)}" if mask is not None else "")
            + f" window={window} bottom_right={bottom_right} softcap={softcap}"
            + (f" alibi {tuple(alibi.shape)}" if alibi is not None else ""))
    return Case(seed, dtype, q, k, v, mask, dropout_p, is_causal, scale, group > 1, rng, grad_out, what, window,
                bottom_right, softcap, alibi)


def _run(ops, c: Case):
    """Output and gradients (q, k, v, and the mask's when it is float) of the
    op namespace `ops` (torch.ops.mha_ext or the emulated CUDA backend)."""
    variant = (c.window[0], c.window[1], c.bottom_right, c.softcap, c.alibi)
    out, lse, rng = ops.attention(c.q, c.k, c.v, c.mask, c.dropout_p, c.is_causal, c.scale, c.gqa, c.rng, *variant)
    gq, gk, gv, gm = ops.attention_backward(c.grad_out, c.q, c.k, c.v, out, lse, c.mask, c.dropout_p, c.is_causal,
                                            c.scale, c.gqa, rng, c.mask_grad, *variant)
    return [out, gq, gk, gv] + ([gm] if c.mask_grad else [])


def _reference(c: Case, compute_dtype):
    keep = None
    if c.dropout_p > 0.0:
        keep = R.dropout_keep(int(c.rng[0]), int(c.rng[1]), tuple(c.grad_out.shape[:-1]) + (c.k.shape[-2],),
                              c.dropout_p)
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (c.q, c.k, c.v)]
    mask = c.mask
    if c.mask_grad:
        mask = c.mask.detach().to(compute_dtype).requires_grad_()
        leaves.append(mask)
    out = R.attention(*leaves[:3], attn_mask=mask, is_causal=c.is_causal, scale=c.scale, enable_gqa=c.gqa,
                      keep=keep, dropout_p=c.dropout_p, compute_dtype=compute_dtype, **c.variant)
    grads = torch.autograd.grad(out, leaves, c.grad_out.to(compute_dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, leaves)]
    return [out.detach()] + [gr.detach() for gr in grads], keep


NAMES = ("out", "dq", "dk", "dv", "dmask")


def check(ops, c: Case) -> None:
    """Raises AssertionError naming the seed if `ops` disagrees with the float64 reference."""
    ours = _run(ops, c)
    ref, keep = _reference(c, torch.float64)
    mags = R.magnitudes(c.q, c.k, c.v, c.grad_out, attn_mask=c.mask, is_causal=c.is_causal, scale=c.scale,
                        enable_gqa=c.gqa, keep=keep, dropout_p=c.dropout_p, **c.variant)
    if c.mask_grad:
        mags["dmask"] = R.sum_to(mags["dmask"], c.mask.shape)
    # exp(score - lse) in float carries an error of eps * |lse| relative to P
    # (the kernels switch to exact row statistics at |lse| >= 256)
    lse = R.logsumexp(c.q, c.k, c.mask, c.is_causal, c.scale, c.gqa, **c.variant).abs()
    spread = 1.0 + (lse[torch.isfinite(lse)].clamp(max=256.0).max().item() if torch.isfinite(lse).any() else 0.0)
    eager = None
    if c.dtype in (torch.float16, torch.bfloat16):
        eager, _ = _reference(c, c.dtype)
    for i, (name, a, r) in enumerate(zip(NAMES, ours, ref)):
        assert a.shape == r.shape and a.dtype == c.q.dtype, (name, a.shape, r.shape, a.dtype)
        mag = mags[name]
        err = (a.double() - r).abs()
        if eager is None:
            bound = REL[c.dtype] * spread * mag + 1e3 * torch.finfo(c.dtype).tiny  # + underflow near zero
        else:
            eps = torch.finfo(c.dtype).eps
            yard = (eager[i].double() - r).abs().max().item()
            bound = 2.0 * yard + eps * mag + 1e-6
        bad = ~(err <= bound)
        if bad.any():
            idx = tuple(int(x) for x in bad.nonzero()[0])
            raise AssertionError(
                f"seed {c.seed} ({c.what}): {name} off at {idx}: ours {a[idx].item():.6g}, float64 reference "
                f"{r[idx].item():.6g}, error {err[idx].item():.3g} > bound {float(bound[idx]) if torch.is_tensor(bound) else bound:.3g} "
                f"(magnitude of the summed terms {mag[idx].item():.3g}); {int(bad.sum())} of {bad.numel()} elements"
            )
