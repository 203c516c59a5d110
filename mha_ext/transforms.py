"""mha_ext::attention under torch.func transforms (grad, vmap, jacrev, ...).

The autograd that torch.library.register_autograd gives a custom op is an
autograd.Function without setup_context, which torch.func refuses ("it must
override the setup_context staticmethod"); so under a transform the
functional API calls the op through the Function below instead: the same
setup_context (mha_ext.ops), a backward by torch.func.vjp of the op's
differentiable composite, and a vmap rule that moves the
vmapped dim of each input to the front, where the op takes it as one more
batch dim (no loop over the batch). torch's SDPA works under these
transforms; this keeps the drop-in working there too.
"""
import torch

from .checks import _check

__all__ = ["transforms_active", "attention_function"]

# the schema's defaults of the arguments after rng_state (window_left,
# window_right, bottom_right, softcap, alibi_slopes)
_DEFAULTS = (None, 0.0, False, None, False, None, -1, -1, False, 0.0, None)


def transforms_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def _to_front(t, d, B):
    """t with its vmapped dim d (None: not vmapped) first, of size B."""
    return t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand((B,) + tuple(t.shape))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(*args):
        return torch.ops.mha_ext.attention.default(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        from .ops import _setup_context
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_rng):
        # The op's differentiable composite (mha_ext.ops), differentiated by
        # torch.func.vjp: transforms apply to the backward too (vmap over it
        # for jacrev, grad of it for second order), which the fused backward
        # op has no rules for. O(L x S) memory per head, as torch's math path.
        from .ops import _composite_attention
        query, key, value, out, lse, rng_used, *rest = ctx.saved_tensors
        attn_mask = rest[0] if ctx.has_mask else None
        alibi = rest[-1] if ctx.has_alibi else None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        with_mask = ctx.mask_requires_grad

        def forward(q, k, v, *m):
            return _composite_attention(q, k, v, m[0] if with_mask else attn_mask, *ctx.args, rng_used,
                                        *ctx.variant, alibi)

        primals = (query, key, value) + ((attn_mask,) if with_mask else ())
        grads = torch.func.vjp(forward, *primals)[1](grad_out)
        return tuple(grads[:3]) + ((grads[3] if with_mask else None),) + (None,) * 10

    @staticmethod
    def vmap(info, in_dims, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng_state,
             window_left, window_right, bottom_right, softcap, alibi_slopes):
        B = info.batch_size
        _check(in_dims[8] is None, lambda: "mha_ext.attention under vmap: rng_state must not be vmapped")
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
        out = _Attention.apply(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, rng_state, window_left,
                               window_right, bottom_right, softcap, slopes)
        return out, (0, 0, None)


def attention_function(*args):
    """torch.ops.mha_ext.attention.default(*args) (positional, as many as
    given) through the transform-aware Function: (out, logsumexp, rng_state)."""
    full = tuple(args) + _DEFAULTS[len(args) - 3:]
    return _Attention.apply(*full)
