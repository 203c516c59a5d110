"""mha_ext.MultiheadAttention: a drop-in for torch.nn.MultiheadAttention.

It is a subclass, so it has the same constructor, parameters and state_dict
keys (load_state_dict(strict=True) works both ways) and passes isinstance
checks in nn.Transformer*Layer. Only forward differs: the attention itself
runs through the fused mha_ext::attention op.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .ops import attention_weights, new_rng_state, run_attention, run_op
from .transforms import transforms_active

__all__ = ["MultiheadAttention"]


def _as_float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """nn.MultiheadAttention's convention: bool True = masked out -> -inf; floats are added."""
    if mask.dtype == torch.bool:  # (out of place: vmap cannot fill a tensor in place from a vmapped mask)
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _attend_unpadded_keys(q, k, v, key_padding_mask, dropout_p, rng_state):
    """Attention of q (N, H, L, D) over the keys of k, v (N, H, S, D) that
    key_padding_mask (N, S), True = padding, leaves: only those are gathered
    and attended (mha_ext::varlen_attention), so padding costs no work.
    Returns what mha_ext::attention does: out (N, H, L, D), logsumexp (N, H, L)."""
    N, H, L, D = q.shape
    keep = ~key_padding_mask
    cu_k = F.pad(keep.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = torch.arange(0, (N + 1) * L, L, dtype=torch.int32, device=q.device)
    out, lse, rng_used = run_op(
        torch.ops.mha_ext.varlen_attention.default, q.transpose(1, 2).reshape(N * L, H, D), k.transpose(1, 2)[keep], v.transpose(1, 2)[keep], cu_q, cu_k, L,
        k.shape[2], dropout_p, False, None, rng_state)
    return out.view(N, L, H, -1).transpose(1, 2), lse.view(H, N, L).transpose(0, 1), rng_used


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in for torch.nn.MultiheadAttention with a fused attention core.

    Semantics follow torch's module: masks use its convention (bool True = not
    allowed, floats added; attn_mask (L, S) or (N*H, L, S); key_padding_mask (N, S)),
    dropout only in training, need_weights returns the (dropped-out) weights,
    averaged over heads by default. One difference is defined instead of NaN:
    a query that may attend to no key gets output 0 (and weights 0)."""

    def __init__(self, embed_dim, num_heads, *args, **kwargs):
        if num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim}, num_heads={num_heads}"
            )
        super().__init__(embed_dim, num_heads, *args, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if query.is_nested or key.is_nested or value.is_nested:  # torch's jagged layout, (N, j, E)
            from .nested import multihead_forward
            return multihead_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                                     average_attn_weights, is_causal)
        E, H = self.embed_dim, self.num_heads
        D = E // H
        self_attention = query is key and key is value
        if query.dim() not in (2, 3):
            raise RuntimeError(
                f"query must be (L, E) unbatched or (L, N, E) / (N, L, E) batched, got shape {tuple(query.shape)}"
            )
        batched = query.dim() == 3
        for name, t in (("key", key), ("value", value)):
            if t.dim() != query.dim():
                raise RuntimeError(
                    f"{name} must have {query.dim()} dims like query, got shape {tuple(t.shape)}"
                )
        if query.shape[-1] != E:
            raise RuntimeError(f"query's last dim must be embed_dim ({E}), got {query.shape[-1]}")
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # from here on: query (N, L, E), key (N, S, kdim), value (N, S, vdim)
        N, L = query.shape[0], query.shape[1]
        if key.shape[:2] != value.shape[:2] or key.shape[0] != N:
            raise RuntimeError(
                f"key and value must share batch and sequence dims with query's batch {N}, "
                f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
            )

        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask."
            )
        # Like torch: the is_causal hint replaces attn_mask when nothing else needs it.
        use_causal = is_causal and key_padding_mask is None and not need_weights
        if use_causal:
            attn_mask = None

        # Input projections.
        if self._qkv_same_embed_dim:
            if self_attention:
                q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
            else:
                w_q, w_k, w_v = self.in_proj_weight.chunk(3)
                b_q, b_k, b_v = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
                q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        else:
            b_q, b_k, b_v = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q = F.linear(query, self.q_proj_weight, b_q)
            k = F.linear(key, self.k_proj_weight, b_k)
            v = F.linear(value, self.v_proj_weight, b_v)

        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(N, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.expand(N, 1, E)], dim=1)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        # Heads: (N, X, E) -> (N, H, X, D), strided views, no copies.
        q = q.unflatten(-1, (H, D)).transpose(1, 2)
        k = k.unflatten(-1, (H, D)).transpose(1, 2)
        v = v.unflatten(-1, (H, D)).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, H, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(N, H, 1, D)], dim=2)
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        S = k.shape[2]

        mask = self._merge_masks(attn_mask, key_padding_mask, q.dtype, N, L, S)
        dropout_p = self.dropout if self.training else 0.0
        all_dropped = dropout_p == 1.0  # as torch: every weight dropped, the output is out_proj's bias
        if all_dropped:
            dropout_p = 0.0
        rng_state = new_rng_state(q.device) if dropout_p > 0.0 else None
        # A bool key_padding_mask alone: the padded keys are left out of the
        # work (varlen) instead of masked. With need_weights and dropout the
        # weights must show the dense op's dropout draws, so that case stays dense.
        # (Not under torch.func transforms: the varlen op has no rules for them.)
        skip_padding = (key_padding_mask is not None and key_padding_mask.dtype == torch.bool and attn_mask is None
                        and not use_causal and not (need_weights and dropout_p > 0.0) and not transforms_active())
        if skip_padding:
            out, lse, rng_used = _attend_unpadded_keys(q, k, v, key_padding_mask, dropout_p, rng_state)
        else:
            out, lse, rng_used = run_attention(q, k, v, mask, dropout_p, use_causal, None, False, rng_state)
        if all_dropped:
            out = out * 0.0
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, E))
        if batched and not self.batch_first:
            out = out.transpose(0, 1)
        elif not batched:
            out = out.squeeze(0)

        if not need_weights:
            return out, None
        weights = self._weights(q, k, mask, lse, dropout_p, rng_used)
        if all_dropped:
            weights = weights * 0.0
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights.squeeze(0)
        return out, weights

    def _merge_masks(self, attn_mask, key_padding_mask, dtype, N, L, S):
        """Both of torch's masks -> one SDPA mask broadcastable to (N, H, L, S):
        bool (True = may attend) when both are bool, else float (added)."""
        H = self.num_heads
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if tuple(attn_mask.shape) != (L, S):
                    raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be {(L, S)}.")
                attn_mask = attn_mask.view(1, 1, L, S)
            elif attn_mask.dim() == 3:
                if tuple(attn_mask.shape) != (N * H, L, S):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is {tuple(attn_mask.shape)}, but should be {(N * H, L, S)}."
                    )
                attn_mask = attn_mask.view(N, H, L, S)
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
            if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
                raise RuntimeError(f"only bool and floating types of attn_mask are supported, got {attn_mask.dtype}")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (N, S):
                raise RuntimeError(
                    f"expecting key_padding_mask shape of {(N, S)}, but got {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.dtype != torch.bool and not key_padding_mask.is_floating_point():
                raise RuntimeError(
                    f"only bool and floating types of key_padding_mask are supported, got {key_padding_mask.dtype}"
                )
            key_padding_mask = key_padding_mask.view(N, 1, 1, S)
        masks = [m for m in (attn_mask, key_padding_mask) if m is not None]
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            merged = masks[0] if len(masks) == 1 else masks[0] | masks[1]
            return ~merged
        merged = _as_float_mask(masks[0], dtype)
        for m in masks[1:]:
            merged = merged + _as_float_mask(m, dtype)
        return merged

    def _weights(self, q, k, mask, lse, dropout_p, rng_state):
        """The attention weights torch's module returns, (N, H, L, S), dropped out
        with the very mask the fused op applied (same rng_state)."""
        return attention_weights(q, k, mask, lse, dropout_p=dropout_p, rng_state=rng_state)
