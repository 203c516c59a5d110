"""Fake kernels, autograd and the functional API of the mha_ext ops.

The schemas live in csrc/mha.cpp; the C++ library names this module with
set_python_module, so torch checks the registrations come from here and can
point a C++-first user at it.
The input checks (mha_ext/checks.py) mirror csrc/checks.cpp word for word, so
an error reads the same in eager mode and under torch.compile / torch.export.
"""
import numbers
from typing import Optional

import torch

from . import _C
from .transforms import attention_function, transforms_active
from .checks import (_acc_dtype, _check, _check_same_shape, _fmt, check_attention_inputs, check_dropout_p, check_rng_state,
                     check_variant)

__all__ = ["scaled_dot_product_attention", "attention", "check_attention_inputs", "cpu_isa"]


def run_op(op, *args):
    """op(*args), straight to the backend kernel when autograd has nothing to
    record: grad mode off (generate(), no_grad) or no argument requiring
    grad. That is the choice torch's own autograd kernel of a custom op makes
    (it redispatches below autograd there), taken before the dispatcher's
    round trip through that kernel, which cost 5 us of a 12 us call on a
    decode step. Under torch.compile / export, and for tensors or modes with
    __torch_function__, the op is called as it is."""
    if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args))
            or torch._C._has_torch_function(args) or torch._C._is_torch_function_mode_enabled()):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def run_attention(*args):
    """torch.ops.mha_ext.attention.default(*args) (the schema's arguments,
    positional, as many as given): mha_ext._C.attention makes the same call
    from C++ below autograd when autograd has nothing to record and no torch
    function applies, without torch.ops's boxing of the arguments and
    wrapping of the results (a tiny call: 29 us through torch.ops below
    autograd, 11 us so, on an AMD EPYC of family 23); else (None) by
    run_op. Under torch.compile / export the op is called as it is."""
    if not torch.compiler.is_compiling():
        if transforms_active():  # torch.func transforms: mha_ext/transforms.py
            return attention_function(*args)
        res = _C.attention(*args)
        if res is not None:
            return res
    return run_op(torch.ops.mha_ext.attention.default, *args)


# ---------------------------------------------------------------------------
# Fake kernels


def _empty_in_query_order(query, shape):
    """As the kernels allocate out (host_common.h, empty_in_query_order): a 4-D
    output's leading dims in memory in the order of query's strides (dims of
    size 1 or stride 0 in place), as torch's fused SDPA; other ranks contiguous."""
    if query.dim() != 4 or len(shape) != 4:
        return query.new_empty(shape)
    slots = [d for d in range(3) if query.shape[d] > 1 and query.stride(d) > 0]
    order = sorted(slots, key=lambda d: -query.stride(d))  # stable, as std::stable_sort
    perm = [0, 1, 2, 3]
    for slot, d in zip(slots, order):
        perm[slot] = d
    inv = [0] * 4
    for m, d in enumerate(perm):
        inv[d] = m
    return query.new_empty([shape[d] for d in perm]).permute(inv)


@torch.library.register_fake("mha_ext::attention")
def _attention_fake(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, rng_state=None, window_left=-1, window_right=-1, bottom_right=False,
                    softcap=0.0, alibi_slopes=None):
    batch, hq, _, L, _, _, ev = check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa)
    check_variant(query, batch, hq, window_left, window_right, softcap, alibi_slopes)
    given = dropout_p > 0.0 and rng_state is not None
    if given:
        check_rng_state(rng_state, query.device, L)
    out = _empty_in_query_order(query, batch + (hq, L, ev))
    lse = query.new_empty(batch + (hq, L), dtype=_acc_dtype(query.dtype))
    # a copy of the given rng_state, else one on query's device (drawn, or zeros without dropout)
    rng = torch.empty(rng_state.shape if given else 2, dtype=torch.int64,
                      device=rng_state.device if given else query.device)
    return out, lse, rng


@torch.library.register_fake("mha_ext::attention_backward")
def _attention_backward_fake(grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p, is_causal,
                             scale, enable_gqa, rng_state, attn_mask_requires_grad, window_left=-1,
                             window_right=-1, bottom_right=False, softcap=0.0, alibi_slopes=None):
    batch, hq, hkv, L, S, E, ev = check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa)
    check_variant(query, batch, hq, window_left, window_right, softcap, alibi_slopes)
    _check_same_shape("grad_out", grad_out, batch + (hq, L, ev), query)
    _check_same_shape("out", out, batch + (hq, L, ev), query)
    _check_same_shape("logsumexp", logsumexp, batch + (hq, L), query, _acc_dtype(query.dtype))
    if dropout_p > 0.0:
        check_rng_state(rng_state, query.device, L)
    want_mask = attn_mask_requires_grad and attn_mask is not None and attn_mask.dtype != torch.bool
    grad_mask = attn_mask.new_empty(attn_mask.shape) if want_mask else query.new_empty((0,))
    return (
        query.new_empty(batch + (hq, L, E)),
        query.new_empty(batch + (hkv, S, E)),
        query.new_empty(batch + (hkv, S, ev)),
        grad_mask,
    )


@torch.library.register_fake("mha_ext::draw_rng_state")
def _draw_rng_state_fake(like, len_kv):
    _check(len_kv >= 0, lambda: f"len_kv must be >= 0, got {len_kv}")
    return torch.empty(2, dtype=torch.int64, device=like.device)


@torch.library.register_fake("mha_ext::dropout_mask")
def _dropout_mask_fake(rng_state, shape, dropout_p):
    _check(len(shape) > 0, lambda: "shape must have at least 1 dim, got ()")
    check_rng_state(rng_state, torch.device("cpu"), shape[-2] if len(shape) >= 2 else 1)
    check_dropout_p(dropout_p)
    return torch.empty(shape, dtype=torch.bool, device=rng_state.device)


# ---------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _, *variant = inputs
    out, lse, rng_used = output
    ctx.mask_requires_grad = bool(
        attn_mask is not None and attn_mask.requires_grad and attn_mask.dtype != torch.bool
    )
    ctx.has_mask = attn_mask is not None
    # (window_left, window_right, bottom_right, softcap); the slopes are saved
    window_left, window_right, bottom_right, softcap, alibi = (variant + [-1, -1, False, 0.0, None][len(variant):])
    _check(
        alibi is None or not alibi.requires_grad,
        lambda: "alibi_slopes must not require grad: ALiBi's slopes are constants here (pass alibi_slopes.detach())",
    )
    ctx.has_alibi = alibi is not None
    ctx.save_for_backward(query, key, value, out, lse, rng_used, *([attn_mask] if ctx.has_mask else []),
                          *([alibi] if ctx.has_alibi else []))
    ctx.args = (dropout_p, is_causal, scale, enable_gqa)
    ctx.variant = (window_left, window_right, bottom_right, softcap)
    ctx.mark_non_differentiable(lse, rng_used)


def _visible(L, S, is_causal, window_left, window_right, bottom_right, device):
    """(L, S) bool: the keys each query row may see (AttentionVariant)."""
    i = torch.arange(L, device=device).unsqueeze(-1) + (S - L if bottom_right else 0)
    j = torch.arange(S, device=device)
    window_left, window_right = min(window_left, L + S), min(window_right, L + S)  # (no int64 overflow)
    right = (0 if window_right < 0 else min(window_right, 0)) if is_causal else window_right
    ok = torch.ones(L, S, dtype=torch.bool, device=device)
    if right >= 0:
        ok = ok & (j <= i + right)
    if window_left >= 0:
        ok = ok & (j >= i - window_left)
    return ok


def _composite_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng_state,
                         window_left=-1, window_right=-1, bottom_right=False, softcap=0.0, alibi_slopes=None):
    """The op's forward in differentiable torch ops, the same semantics (rows
    with no key to attend to give 0, the op's dropout mask): what a second
    order gradient differentiates. Materialises the (..., Hq, L, S) scores, in
    float32 (float64 for float64)."""
    acc = _acc_dtype(query.dtype)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, dim=-3), v.repeat_interleave(hq // hkv, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        i = torch.arange(L, device=q.device).unsqueeze(-1) + (S - L if bottom_right else 0)
        dist = (i - torch.arange(S, device=q.device)).abs().to(acc)
        scores = scores - alibi_slopes.to(acc).unsqueeze(-1).unsqueeze(-1) * dist
    visible = _visible(L, S, is_causal, window_left, window_right, bottom_right, q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            scores = scores + attn_mask.to(acc)
    scores = scores.masked_fill(~visible, float("-inf"))
    any_key = (scores > float("-inf")).any(dim=-1, keepdim=True)
    probs = torch.where(any_key, torch.softmax(torch.where(any_key, scores, 0.0), dim=-1), 0.0)
    if dropout_p > 0.0:
        keep = torch.ops.mha_ext.dropout_mask(rng_state.cpu(), list(probs.shape), dropout_p).to(probs.device)
        probs = probs * keep / (1.0 - dropout_p)
    return (probs @ v).to(query.dtype)


def _backward(ctx, grad_out, grad_lse, grad_rng):
    query, key, value, out, lse, rng_used, *rest = ctx.saved_tensors
    attn_mask = rest[0] if ctx.has_mask else None
    alibi = rest[-1] if ctx.has_alibi else None
    dropout_p, is_causal, scale, enable_gqa = ctx.args
    window_left, window_right, bottom_right, softcap = ctx.variant
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if torch.is_grad_enabled():
        # backward(create_graph=True): the gradients must be differentiable
        # themselves, so they come from the composite forward (O(L x S) memory
        # per head) instead of the fused backward
        wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.mask_requires_grad]
        inputs = [query, key, value, attn_mask]
        recomputed = _composite_attention(query, key, value, attn_mask, *ctx.args[:4], rng_used, *ctx.variant, alibi)
        grads = torch.autograd.grad(recomputed, [t for t, w in zip(inputs, wanted) if w], grad_out,
                                    create_graph=True)
        it = iter(grads)
        gq, gk, gv, gm = (next(it) if w else None for w in wanted)
        return (gq, gk, gv, gm) + (None,) * 10
    gq, gk, gv, gm = torch.ops.mha_ext.attention_backward(
        grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng_used,
        ctx.mask_requires_grad, window_left, window_right, bottom_right, softcap, alibi,
    )
    return (gq, gk, gv, (gm if ctx.mask_requires_grad else None)) + (None,) * 10


torch.library.register_autograd("mha_ext::attention", _backward, setup_context=_setup_context)


def _double_backward(ctx, *grads):
    raise RuntimeError(
        "mha_ext: mha_ext::attention_backward is not differentiable; second-order gradients of "
        "mha_ext::attention come from backward(create_graph=True), which uses a differentiable composite"
    )


# Without this, autograd would pass through a direct call of attention_backward
# as if it were constant and a gradient of it would come out silently zero.
torch.library.register_autograd("mha_ext::attention_backward", _double_backward)


# ---------------------------------------------------------------------------
# Functional API


def cpu_isa() -> str:
    """The instruction set of the CPU kernels in this process: "amx" (AVX-512
    with the AMX tile unit for bfloat16), "avx512bf16" (AVX-512 with
    AVX512-BF16's bfloat16 pair products), "avx512", "avx2" or "generic".
    MHA_EXT_CPU_ISA=generic|avx2|avx512|avx512bf16 (set before the first
    call) forces a lower one."""
    return torch.ops.mha_ext.cpu_isa()


def new_rng_state(device=None) -> Optional[torch.Tensor]:
    """A fresh dropout (seed, offset) for inputs on `device`: on the CPU, drawn
    from torch's default CPU generator; elsewhere None, which lets the op draw
    from that device's generator on the device itself (so a CUDA graph
    replays with fresh draws). torch.manual_seed reproduces both."""
    if device is not None and torch.device(device).type != "cpu":
        return None
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def _type_error(name, position, want, got):
    where = f" (position {position})" if position else ""
    return TypeError(f"scaled_dot_product_attention(): argument '{name}'{where} must be {want}, not {type(got).__name__}")


def _check_arg_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> float:
    """The argument types torch's SDPA takes, with its TypeError messages (the
    values are the op's checks). Returns dropout_p as a float."""
    if (type(dropout_p) is float and type(is_causal) is bool and type(enable_gqa) is bool
            and (scale is None or type(scale) is float) and type(query) is torch.Tensor and type(key) is torch.Tensor
            and type(value) is torch.Tensor and (attn_mask is None or type(attn_mask) is torch.Tensor)):
        return dropout_p  # the common call, without the checks by abstract classes below
    for i, (name, t) in enumerate((("query", query), ("key", key), ("value", value)), 1):
        if not isinstance(t, torch.Tensor):
            raise _type_error(name, i, "Tensor", t)
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise _type_error("attn_mask", 4, "Tensor", attn_mask)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise _type_error("dropout_p", 0, "float", dropout_p)
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise _type_error(name, 0, "bool", flag)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise _type_error("scale", 0, "float", scale)
    return float(dropout_p)


def _broadcast_inputs(query, key, value, enable_gqa):
    """The shapes torch's SDPA accepts beyond the op's (N..., H, L, E) with
    equal batch dims: 2-D inputs, inputs of different ranks, batch dims that
    broadcast (sizes 1), and a head dim of 1 against H heads without GQA.
    Returns query, key, value as expanded views of one rank (no copies; the
    kernels read stride-0 dims in place and autograd sums the gradients of
    the expanded dims) and the rank of the output."""
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) == len(ks) == len(vs) >= 3 and qs[:-3] == ks[:-3] == vs[:-3]:
        hq, hk = qs[-3], ks[-3]
        if hq == hk or (enable_gqa and hk > 0 and hq % hk == 0) or hk != vs[-3]:
            return query, key, value, len(qs)  # the op's own shapes (or its clear errors)
    dims = (len(qs), len(ks), len(vs))
    if min(dims) < 2:
        raise RuntimeError(
            "query, key and value must all have at least 2 dims (..., seq_len, head_dim), got "
            f"query.dim: {dims[0]}, key.dim: {dims[1]} and value.dim: {dims[2]}"
        )
    out_rank = max(dims)
    rank = max(out_rank, 3)
    q, k, v = (t.view((1,) * (rank - t.dim()) + tuple(t.shape)) for t in (query, key, value))
    try:
        batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError:
        raise RuntimeError(
            f"the batch dims of query {_fmt(q.shape[:-3])}, key {_fmt(k.shape[:-3])} and value "
            f"{_fmt(v.shape[:-3])} must broadcast (each dim equal or 1)"
        ) from None
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk == hv and hq != hk and (hq == 1 or hk == 1) and not (enable_gqa and hk > 0 and hq % hk == 0):
        hq = hk = hv = max(hq, hk)  # a single head broadcasts, as in torch
    q = q.expand(batch + (hq,) + tuple(q.shape[-2:]))
    k = k.expand(batch + (hk,) + tuple(k.shape[-2:]))
    v = v.expand(batch + (hv,) + tuple(v.shape[-2:]))
    return q, k, v, out_rank


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, fused.

    query (N..., Hq, L, E), key (N..., Hkv, S, E), value (N..., Hkv, S, Ev) ->
    (N..., Hq, L, Ev). attn_mask is bool (True = may attend) or float (added to
    the scores), broadcastable to (N..., Hq, L, S); is_causal (top-left) may be
    combined with it. A query row that can attend to no key gives 0.

    As in torch: 2-D inputs (L, E), inputs of different ranks and batch dims
    that broadcast are accepted (as stride-0 views, never copied), and
    dropout_p=1.0 drops everything (zeros; NaN stays NaN)."""
    if not torch.compiler.is_compiling() and not transforms_active():
        # the common call in one C++ step, when it is one (else None)
        out = _C.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    dropout_p = _check_arg_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.is_nested or key.is_nested or value.is_nested:  # torch's jagged layout: the varlen op
        from .nested import jagged_attention

        def dense(q, k, v):
            return scaled_dot_product_attention(q, k, v, None, dropout_p, is_causal, scale, enable_gqa), None
        return jagged_attention("scaled_dot_product_attention", query, key, value, attn_mask, dropout_p, is_causal,
                                scale, enable_gqa, dense)[0]
    query, key, value, out_rank = _broadcast_inputs(query, key, value, enable_gqa)
    if enable_gqa and key.shape[-3] == 0 and value.shape[-3] == 0 and query.shape[-3] > 0:
        # torch gives zeros here (no key/value head to attend to)
        return query.new_zeros(tuple(query.shape[:-1]) + (value.shape[-1],))
    all_dropped = dropout_p == 1.0
    if all_dropped:
        dropout_p = 0.0
    rng_state = new_rng_state(query.device) if dropout_p > 0.0 else None
    out, _, _ = run_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        rng_state,
    )
    if all_dropped:
        out = out * 0.0
    if out.dim() > out_rank:
        out = out.view(out.shape[out.dim() - out_rank:])
    return out


def attention_weights(query, key, attn_mask, logsumexp, is_causal=False, scale=None, softcap=0.0, dropout_p=0.0,
                      rng_state=None):
    """The attention weights (N..., Hq, L, S) of a call of the op with these
    arguments (top-left causal), dropped out with the very mask the op
    applied (same rng_state), in query's dtype: what need_weights and
    output_attentions return. Materialises them (O(L x S) per head); rows
    with no key to attend to (logsumexp -inf) are 0."""
    acc = _acc_dtype(query.dtype)
    q, k = query.to(acc), key.to(acc)
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(acc)
    if is_causal:
        scores = scores.masked_fill(~_visible(q.shape[-2], k.shape[-2], True, -1, -1, False, q.device), float("-inf"))
    # Rows with no key to attend to: weights 0 (softmax would give NaN there,
    # and NaN gradients through torch.where).
    any_key = (logsumexp != float("-inf")).unsqueeze(-1)
    weights = torch.where(any_key, torch.softmax(torch.where(any_key, scores, 0.0), dim=-1), 0.0)
    if dropout_p > 0.0:
        keep = torch.ops.mha_ext.dropout_mask(rng_state.cpu(), list(weights.shape), dropout_p).to(weights.device)
        weights = weights * keep / (1.0 - dropout_p)
    return weights.to(query.dtype)


def _variant_args(alignment, window, softcap):
    """(window_left, window_right, bottom_right, softcap) of the ops from the
    functional API's alignment, window and softcap."""
    if alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"alignment must be 'top_left' or 'bottom_right', got {alignment!r}")
    if len(window) != 2:
        raise ValueError(f"window must be (left, right), got {window!r}")
    return int(window[0]), int(window[1]), alignment == "bottom_right", float(softcap)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    *,
    dropout_p: float = 0.0,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
):
    """Fused attention with the variants real models use, forward and backward.

    query (N..., Hq, L, E), key (N..., Hkv, S, E), value (N..., Hkv, S, Ev) ->
    (N..., Hq, L, Ev), and with return_lse=True also the natural-log
    logsumexp of each row (N..., Hq, L) in float32 (float64 for float64),
    which merges partial results. Row i's diagonal key is i ("top_left", as
    SDPA's is_causal) or i + S - L ("bottom_right", as FlashAttention and a KV
    cache: the last query row sees the last key). Then:

    - causal: row i sees no key beyond its diagonal;
    - window=(left, right): row i sees keys diagonal - left .. diagonal + right
      (FlashAttention's window_size; -1 = no bound on that side); key tiles
      wholly outside it are skipped, so the cost grows with the window;
    - softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma 2);
    - alibi_slopes (Hq) or (N..., Hq): scores get - slope * |diagonal - j|
      (BLOOM, MPT; FlashAttention's definition);
    - attn_mask (bool: True = may attend, or float: added) after all of these.

    Scores are scaled (scale, default 1 / sqrt(E)) before the softcap. GQA
    with enable_gqa=True. A row that may see no key gives 0."""
    variant = _variant_args(alignment, window, softcap)
    dropout_p = _check_arg_types(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa)
    if query.is_nested or key.is_nested or value.is_nested:  # torch's jagged layout: the varlen op
        from .nested import jagged_attention

        def dense(q, k, v):
            return attention(q, k, v, dropout_p=dropout_p, causal=causal, alignment=alignment, window=window,
                             softcap=softcap, alibi_slopes=alibi_slopes, scale=scale, enable_gqa=enable_gqa,
                             return_lse=True)
        out, lse = jagged_attention("attention", query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa,
                                    dense, alignment, window, softcap, alibi_slopes, return_lse)
        return (out, lse) if return_lse else out
    rng_state = new_rng_state(query.device) if dropout_p > 0.0 else None
    out, lse, _ = run_attention(
        query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa,
        rng_state, *variant, alibi_slopes,
    )
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# The varlen ops (mha_ext/varlen.py), registered from here: torch requires the
# fake kernels to come from the module the C++ library names.
from . import varlen as _varlen  # noqa: E402

torch.library.register_fake("mha_ext::varlen_attention")(_varlen._varlen_fake)
torch.library.register_fake("mha_ext::varlen_attention_backward")(_varlen._varlen_backward_fake)
torch.library.register_autograd("mha_ext::varlen_attention", _varlen._backward, setup_context=_varlen._setup_context)
torch.library.register_autograd("mha_ext::varlen_attention_backward", _varlen._double_backward)

# The KV-cache op (mha_ext/kvcache.py): forward only, no autograd.
from . import kvcache as _kvcache  # noqa: E402

torch.library.register_fake("mha_ext::kvcache_attention")(_kvcache._kvcache_fake)


# ---------------------------------------------------------------------------
# Autocast (torch.autocast on the CPU or a GPU), as torch's SDPA under it: the
# floating query, key, value and float mask on the autocast device, float64
# aside, are cast to the autocast dtype (bfloat16 or float16, whichever the
# region chose) and the op runs below autocast; the other arguments stay as
# they are (ALiBi slopes keep their precision). So mixed float32 / 16-bit
# inputs work there, and the output has the autocast dtype. The backward ops need none:
# autograd hands them gradients in the forward's dtypes. The KV-cache op's
# caches are written in place, so they are never cast: its query and new rows
# take the caches' dtype instead (a 16-bit query from an autocast projection
# against float32 caches, or a float32 one against 16-bit caches).
_AUTOCAST_LIB = torch.library.Library("mha_ext", "IMPL")


def autocast_cast(a, device_type, dtype):
    """a as autocast casts an argument of torch's SDPA on device_type: a
    floating tensor on that device, not float64, to dtype."""
    eligible = (isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64
                and a.device.type == device_type)
    return a.to(dtype) if eligible else a


def _register_autocast(name, cast_positions, to_caches=False):
    op = getattr(torch.ops.mha_ext, name).default
    names = [a.name for a in op._schema.arguments]
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        below = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name))

        def kernel(_keyset, *args, device_type=device_type, below=below, **kwargs):
            dtype = torch.get_autocast_dtype(device_type)
            if to_caches:  # (k_cache, the op's second argument)
                cache = args[1] if len(args) > 1 else kwargs["k_cache"]
                dtype = cache.dtype if cache.is_floating_point() else dtype

            def cast(a):
                return autocast_cast(a, device_type, dtype)

            args = list(args)  # (by the schema's positions; a name only for what the dispatcher passes so)
            for i in cast_positions:
                if i < len(args):
                    args[i] = cast(args[i])
                elif names[i] in kwargs:
                    kwargs[names[i]] = cast(kwargs[names[i]])
            with torch._C._ExcludeDispatchKeyGuard(below):
                return op(*args, **kwargs)

        _AUTOCAST_LIB.impl(name, kernel, key_name, with_keyset=True)


_register_autocast("attention", (0, 1, 2, 3))  # query, key, value, attn_mask
_register_autocast("varlen_attention", (0, 1, 2))  # query, key, value
_register_autocast("kvcache_attention", (0, 4, 5), to_caches=True)  # query, k_new, v_new
