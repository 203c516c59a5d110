"""mha_ext::attention under torch.func transforms (grad, vmap, jvp, jacrev,
jacfwd, ...).

The autograd that torch.library.register_autograd gives a custom op is an
autograd.Function without setup_context, which torch.func refuses ("it must
override the setup_context staticmethod"); so under a transform the
functional API calls the op through the Function below instead: the same
setup_context (mha_ext.ops), a backward by torch.func.vjp and a forward-mode
rule by torch.func.jvp of the op's differentiable composite (so transforms
apply to them too), and a vmap rule that moves the vmapped dim of each input
to the front, where the op takes it as one more batch dim (no loop over the
batch). torch's SDPA works under these transforms; this keeps the drop-in
working there too. functionalize needs none of it: the op itself runs there.
"""
import torch
from torch._C._functorch import TransformType

from .checks import _check

__all__ = ["transforms_active", "attention_function"]

# the schema's defaults of the arguments from attn_mask on (attn_mask,
# dropout_p, is_causal, scale, enable_gqa, rng_state, window_left,
# window_right, bottom_right, softcap, alibi_slopes)
_DEFAULTS = (None, 0.0, False, None, False, None, -1, -1, False, 0.0, None)


def transforms_active() -> bool:
    """Whether a torch.func transform that needs the Function below (grad,
    vjp, jvp, vmap) is active; functionalize runs the op as it is."""
    if torch.compiler.is_compiling():  # (a compiled graph calls the op as it is)
        return False
    interp = torch._C._functorch.peek_interpreter_stack()
    return interp is not None and interp.key() != TransformType.Functionalize


def _to_front(t, d, B):
    """t with its vmapped dim d (None: not vmapped) first, of size B."""
    return t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand((B,) + tuple(t.shape))


def _composite_of(ctx_args, ctx_variant, attn_mask, with_mask, rng_used, alibi):
    from .ops import _composite_attention

    def forward(q, k, v, *m):
        return _composite_attention(q, k, v, m[0] if with_mask else attn_mask, *ctx_args, rng_used, *ctx_variant,
                                    alibi)
    return forward


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(*args):
        return torch.ops.mha_ext.attention.default(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        from .ops import _setup_context
        _setup_context(ctx, inputs, output)
        # forward mode (jvp) reads the inputs and the dropout draw
        attn_mask, alibi = inputs[3], (inputs[13] if len(inputs) > 13 else None)
        ctx.save_for_forward(*inputs[:3], output[2], *([attn_mask] if attn_mask is not None else []),
                             *([alibi] if alibi is not None else []))
        ctx.mask_is_float = attn_mask is not None and attn_mask.dtype != torch.bool

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_rng):
        # O(L x S) memory per head, as torch's math path
        query, key, value, out, lse, rng_used, *rest = ctx.saved_tensors
        attn_mask = rest[0] if ctx.has_mask else None
        alibi = rest[-1] if ctx.has_alibi else None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        with_mask = ctx.mask_requires_grad
        fn = _composite_of(ctx.args, ctx.variant, attn_mask, with_mask, rng_used, alibi)
        primals = (query, key, value) + ((attn_mask,) if with_mask else ())
        grads = torch.func.vjp(fn, *primals)[1](grad_out)
        return tuple(grads[:3]) + ((grads[3] if with_mask else None),) + (None,) * 10

    @staticmethod
    def jvp(ctx, *tangents):
        query, key, value, rng_used, *rest = ctx.saved_tensors
        attn_mask = rest[0] if ctx.has_mask else None
        alibi = rest[-1] if ctx.has_alibi else None
        with_mask = ctx.mask_is_float and tangents[3] is not None
        fn = _composite_of(ctx.args, ctx.variant, attn_mask, with_mask, rng_used, alibi)
        primals = (query, key, value) + ((attn_mask,) if with_mask else ())
        tans = tuple(torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents[:len(primals)]))
        out_tangent = torch.func.jvp(fn, primals, tans)[1]
        return out_tangent, None, None

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng_state,
             window_left, window_right, bottom_right, softcap, alibi_slopes):
        B = info.batch_size
        _check(in_dims[13] is None, lambda: "mha_ext.attention under vmap: alibi_slopes must not be vmapped")
        q, k, v = (_to_front(t, d, B) for t, d in zip((query, key, value), in_dims[:3]))
        mask = attn_mask
        if attn_mask is not None and in_dims[3] is not None:
            # (B, mask dims...), the mask right-aligned against (B, N..., H, L, S)
            mask = attn_mask.movedim(in_dims[3], 0)
            mask = mask.view((B,) + (1,) * (q.dim() - mask.dim()) + tuple(mask.shape[1:]))
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() > 1:  # (N..., Hq): the new batch dim in front as well
            slopes = slopes.unsqueeze(0).expand((B,) + tuple(slopes.shape))
        rng = rng_state
        if dropout_p > 0.0:
            # as torch's random ops under vmap: an error unless vmap says how
            # the items' draws relate
            _check(info.randomness != "error",
                   lambda: "vmap: called random operation while in randomness error mode (mha_ext.attention with "
                           f"dropout_p={dropout_p}); pass randomness='same' or 'different' to vmap, or draw outside")
            if in_dims[8] is not None:  # one draw an item ('different'): the batch's rows differ, the first draw serves
                rng = rng_state.select(in_dims[8], 0)
            if info.randomness == "same":  # every item the same mask: each on its own, with one draw
                outs = []
                for i in range(B):
                    m_i = mask[i] if mask is not None and mask.dim() == q.dim() else mask
                    s_i = slopes[i] if slopes is not None and slopes.dim() > 1 else slopes
                    outs.append(_Attention.apply(q[i], k[i], v[i], m_i, dropout_p, is_causal, scale, enable_gqa, rng,
                                                 window_left, window_right, bottom_right, softcap, s_i))
                    rng = outs[-1][2]  # (the first call's draw, where the device drew it)
                return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs]), rng), (0, 0, None)
        out = _Attention.apply(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, rng, window_left,
                               window_right, bottom_right, softcap, slopes)
        return out, (0, 0, None)


def attention_function(*args):
    """torch.ops.mha_ext.attention.default(*args) (positional, as many as
    given) through the transform-aware Function: (out, logsumexp, rng_state).
    Under autocast the inputs are cast first, as the op's autocast kernel
    would, so that the Function saves what the kernels computed with."""
    from .ops import autocast_cast
    full = list(args) + list(_DEFAULTS[len(args) - 3:])
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            full[:4] = [autocast_cast(a, device_type, dtype) for a in full[:4]]
    return _Attention.apply(*full)
