"""Fake kernels, autograd and the functional API of the varlen ops.

FlashAttention's varlen convention: B sequences of different lengths packed
along the rows, query (total_q, Hq, E), key (total_k, Hkv, E), value
(total_k, Hkv, Ev), int32 cumulative lengths cu_seqlens_q / cu_seqlens_k of
shape (B + 1). mha_ext.ops registers the fake kernels and autograd below.
Their checks mirror check_varlen_inputs (csrc/checks.cpp) as far as shapes
go; the values of cu_seqlens are checked by the kernels' host code, which
reads them (a fake tensor has none).
"""
from typing import Optional

import torch

from .checks import (_acc_dtype, _check, _check_qkv_common, _check_same_shape, _fmt, check_dropout_p, check_rng_state,
                     check_variant)
from .ops import _composite_attention, _variant_args, new_rng_state, run_op
from .transforms import transforms_active

__all__ = ["varlen_attention", "check_varlen_inputs"]


def _check_packed(name, t, query):
    _check_qkv_common(name, t, query, t.dim() == 3, "3 dims (total_seqlen, heads, head_dim)")


def check_varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p):
    """The Python twin of the shape checks of mha_ext::check_varlen_inputs.

    Returns (B, Hq, Hkv, total_q, total_k, E, Ev)."""
    _check_packed("query", query, query)
    _check_packed("key", key, query)
    _check_packed("value", value, query)
    total_q, hq, E = query.shape
    total_k, hkv = key.shape[0], key.shape[1]
    ev = value.shape[2]
    _check(key.shape[2] == E, lambda: f"key must have the same head_dim as query ({E}), got {key.shape[2]}")
    _check(
        value.shape[0] == total_k and value.shape[1] == hkv,
        lambda: f"value must have key's (total_seqlen, heads) = ({total_k}, {hkv}), got "
        f"({value.shape[0]}, {value.shape[1]})",
    )
    _check(
        hq == hkv or (hkv > 0 and hq % hkv == 0),
        lambda: f"query heads ({hq}) must be a multiple of key/value heads ({hkv})",
    )
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(
            c.dtype == torch.int32 and c.dim() == 1 and c.numel() >= 1,
            lambda: f"{name} must be an int32 tensor of shape (batch + 1), got {c.dtype} of shape {_fmt(c.shape)}",
        )
        _check(
            c.device == query.device,
            lambda: f"{name} must be on the same device as query ({query.device}), got {c.device}",
        )
    _check(
        cu_seqlens_k.numel() == cu_seqlens_q.numel(),
        lambda: f"cu_seqlens_k must have cu_seqlens_q's shape ({cu_seqlens_q.numel()}), got ({cu_seqlens_k.numel()})",
    )
    _check(max_seqlen_q >= 0, lambda: f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    _check(max_seqlen_k >= 0, lambda: f"max_seqlen_k must be >= 0, got {max_seqlen_k}")
    check_dropout_p(dropout_p)
    return cu_seqlens_q.numel() - 1, hq, hkv, total_q, total_k, E, ev


# ---------------------------------------------------------------------------
# Fake kernels (registered by mha_ext.ops, the module the library names)


def _varlen_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 is_causal=False, scale=None, rng_state=None, window_left=-1, window_right=-1, bottom_right=True,
                 softcap=0.0, alibi_slopes=None):
    B, hq, _, total_q, _, _, ev = check_varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                      max_seqlen_k, dropout_p)
    check_variant(query, (B,), hq, window_left, window_right, softcap, alibi_slopes)
    given = dropout_p > 0.0 and rng_state is not None
    if given:
        check_rng_state(rng_state, query.device)
    out = query.new_empty((total_q, hq, ev))
    lse = query.new_empty((hq, total_q), dtype=_acc_dtype(query.dtype))
    rng = torch.empty(2, dtype=torch.int64, device=rng_state.device if given else query.device)
    return out, lse, rng


def _varlen_backward_fake(grad_out, query, key, value, out, logsumexp, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, is_causal, scale, rng_state, window_left=-1, window_right=-1,
                          bottom_right=True, softcap=0.0, alibi_slopes=None):
    B, hq, hkv, total_q, total_k, E, ev = check_varlen_inputs(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                                              max_seqlen_q, max_seqlen_k, dropout_p)
    check_variant(query, (B,), hq, window_left, window_right, softcap, alibi_slopes)
    _check_same_shape("grad_out", grad_out, (total_q, hq, ev), query)
    _check_same_shape("out", out, (total_q, hq, ev), query)
    _check_same_shape("logsumexp", logsumexp, (hq, total_q), query, _acc_dtype(query.dtype))
    if dropout_p > 0.0:
        check_rng_state(rng_state, query.device)
    return query.new_empty((total_q, hq, E)), query.new_empty((total_k, hkv, E)), query.new_empty((total_k, hkv, ev))


# ---------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output):
    query, key, value, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, _, *variant = inputs
    out, lse, rng_used = output
    window_left, window_right, bottom_right, softcap, alibi = (variant + [-1, -1, True, 0.0, None][len(variant):])
    _check(
        alibi is None or not alibi.requires_grad,
        lambda: "alibi_slopes must not require grad: ALiBi's slopes are constants here (pass alibi_slopes.detach())",
    )
    ctx.has_alibi = alibi is not None
    ctx.save_for_backward(query, key, value, out, lse, rng_used, cu_q, cu_k, *([alibi] if ctx.has_alibi else []))
    ctx.args = (max_q, max_k, dropout_p, is_causal, scale)
    ctx.variant = (window_left, window_right, bottom_right, softcap)
    ctx.mark_non_differentiable(lse, rng_used)


def _composite_varlen(query, key, value, cu_q, cu_k, dropout_p, is_causal, scale, rng_state, window_left,
                      window_right, bottom_right, softcap, alibi):
    """The varlen forward in differentiable torch ops, one sequence at a time
    (for backward(create_graph=True)). Dropout draws follow the op's row ids."""
    _check(dropout_p == 0.0, lambda: "mha_ext: second-order gradients of varlen_attention with dropout are not "
           "supported")
    outs = []
    hq, hkv = query.shape[1], key.shape[1]
    for b in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        o = _composite_attention(query[q0:q1].transpose(0, 1), key[k0:k1].transpose(0, 1),
                                 value[k0:k1].transpose(0, 1), None, 0.0, is_causal, scale, hq != hkv, None,
                                 window_left, window_right, bottom_right, softcap, slopes)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else query.new_zeros((0, hq, value.shape[2]))


def _backward(ctx, grad_out, grad_lse, grad_rng):
    query, key, value, out, lse, rng_used, cu_q, cu_k, *rest = ctx.saved_tensors
    alibi = rest[0] if ctx.has_alibi else None
    max_q, max_k, dropout_p, is_causal, scale = ctx.args
    window_left, window_right, bottom_right, softcap = ctx.variant
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if torch.is_grad_enabled():  # backward(create_graph=True): differentiable gradients
        wanted = list(ctx.needs_input_grad[:3])
        inputs = [query, key, value]
        recomputed = _composite_varlen(query, key, value, cu_q, cu_k, dropout_p, is_causal, scale, rng_used,
                                       *ctx.variant, alibi)
        grads = iter(torch.autograd.grad(recomputed, [t for t, w in zip(inputs, wanted) if w], grad_out,
                                         create_graph=True))
        return tuple(next(grads) if w else None for w in wanted) + (None,) * 13
    gq, gk, gv = torch.ops.mha_ext.varlen_attention_backward(
        grad_out, query, key, value, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, scale, rng_used,
        window_left, window_right, bottom_right, softcap, alibi,
    )
    return (gq, gk, gv) + (None,) * 13



def _double_backward(ctx, *grads):
    raise RuntimeError(
        "mha_ext: mha_ext::varlen_attention_backward is not differentiable; second-order gradients of "
        "mha_ext::varlen_attention come from backward(create_graph=True), which uses a differentiable composite"
    )



# ---------------------------------------------------------------------------
# Functional API


def _length(n):
    # a symbolic length (a compiled graph's, e.g. a nested tensor's longest
    # sequence) stays symbolic: the schema takes SymInt
    return n if isinstance(n, torch.SymInt) else int(n)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dropout_p: float = 0.0,
    causal: bool = False,
    alignment: str = "bottom_right",
    window: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Fused attention over sequences of different lengths packed along the
    rows, with no work on padding (FlashAttention's flash_attn_varlen_func).

    query (total_q, Hq, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev),
    Hq a multiple of Hkv (GQA); cu_seqlens_q / cu_seqlens_k int32 (B + 1),
    the cumulative lengths: sequence b is rows cu[b] .. cu[b + 1] and attends
    to its own keys only. max_seqlen_q / max_seqlen_k: at least the longest
    sequence. Returns (total_q, Hq, Ev), and with return_lse=True also the
    logsumexp (Hq, total_q) in float32 (float64 for float64).

    The variants are those of mha_ext.attention, per sequence: alignment
    "bottom_right" (the default, FlashAttention's: a sequence's last query row
    sees its last key) or "top_left"; causal, window=(left, right), softcap,
    alibi_slopes (Hq) or (B, Hq); dropout_p and scale. A row that may see no
    key gives 0."""
    _check(not transforms_active(),
           lambda: "varlen_attention does not support torch.func transforms (grad, vmap, jvp); call it outside "
                   "them, or use mha_ext.attention on padded inputs there")
    variant = _variant_args(alignment, window, softcap)
    rng_state = new_rng_state(query.device) if dropout_p > 0.0 else None
    out, lse, _ = run_op(
        torch.ops.mha_ext.varlen_attention.default, query, key, value, cu_seqlens_q, cu_seqlens_k, _length(max_seqlen_q), _length(max_seqlen_k), float(dropout_p),
        bool(causal), scale, rng_state, *variant, alibi_slopes,
    )
    return (out, lse) if return_lse else out
