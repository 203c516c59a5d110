"""mha_ext as an attention backend of Hugging Face transformers.

    import mha_ext.integrations.transformers as mt
    mt.register()                     # once per process
    model = AutoModel.from_pretrained(path, attn_implementation="mha_ext")
    # or: model.set_attn_implementation("mha_ext")

register() adds "mha_ext" to transformers' AttentionInterface (the attention
function below) and to its AttentionMaskInterface, with the mask function of
the "sdpa" backend: the masks transformers builds for SDPA (boolean, True =
may attend; None where plain top-left causal attention or no mask is exact)
reach the fused op instead of being dropped. The attention function follows
transformers' own SDPA integration in what it computes, and differs where
mha_ext can do better:

- GQA heads are never expanded (the op reads each key/value head once for
  its group);
- the module's `softcap` (Gemma 2) is applied inside the op; transformers'
  SDPA backend cannot apply it;
- a query row that may see no key (a padding row) gives 0, not NaN;
- `output_attentions=True` returns the attention weights (SDPA returns None);
- dropout (`dropout` > 0 in training) is fused, with mha_ext's Philox stream.
"""
from typing import Optional

import torch

from ..ops import attention_weights, new_rng_state, run_attention

NAME = "mha_ext"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, Hq, L, E)
    key: torch.Tensor,  # (B, Hkv, S, E)
    value: torch.Tensor,  # (B, Hkv, S, Ev)
    attention_mask: Optional[torch.Tensor],  # (B, 1 or Hq, L, S) bool or float, or None
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    **kwargs,
):
    """The attention function transformers calls: returns (B, L, Hq, Ev) and
    the weights (B, Hq, L, S) when output_attentions is asked for, else None."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "mha_ext: position_bias (T5-style relative attention biases) is not supported; "
            "use attn_implementation='sdpa' or 'eager' for such models"
        )
    hq, hkv = query.shape[1], key.shape[1]
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as transformers' SDPA integration: the mask function leaves the mask out
    # (None) exactly where top-left causal attention, or no mask, is right
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    softcap = float(softcap) if softcap else 0.0
    rng_state = new_rng_state(query.device) if dropout > 0.0 else None
    out, lse, rng_used = run_attention(
        query, key, value, mask, float(dropout), is_causal, scaling, hq != hkv,
        rng_state, -1, -1, False, softcap, None,
    )
    weights = None
    if kwargs.get("output_attentions", False):
        weights = attention_weights(query, key, mask, lse, is_causal=is_causal, scale=scaling, softcap=softcap,
                                    dropout_p=float(dropout), rng_state=rng_used)
    return out.transpose(1, 2).contiguous(), weights


def register() -> None:
    """Makes attn_implementation="mha_ext" available to every model of
    transformers in this process (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
