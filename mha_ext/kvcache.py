"""The fake kernel and the functional API of the KV-cache op
(mha_ext::kvcache_attention; mha_ext.ops registers the fake kernel, the
module the library names). Its checks mirror check_kvcache_inputs
(csrc/checks.cpp) as far as shapes go; the values of cache_seqlens
and of a block_table are checked by the kernels' host code, which reads them."""
from typing import Optional

import torch

from . import _C
from .checks import _acc_dtype, _check, _check_qkv_common, _fmt, check_variant
from .ops import _variant_args

__all__ = ["kvcache_attention"]


def _check_4d(name, t, query, what):
    _check_qkv_common(name, t, query, t.dim() == 4, f"4 dims ({what})")


def _check_sizes(name, t, want, what):
    _check(tuple(t.shape) == tuple(want), lambda: f"{name} must have shape {what} = {_fmt(want)}, got {_fmt(t.shape)}")


_KV_BLOCK_MULTIPLE = 256  # AttentionFwdParams::kKVBlockMultiple


def _check_int32(name, t, query, shape_ok, want):
    _check(t.dtype == torch.int32 and shape_ok,
           lambda: f"{name} must be an int32 tensor of shape {want}, got {t.dtype} of shape {_fmt(t.shape)}")
    _check(t.device == query.device, lambda: f"{name} must be on the same device as query ({query.device}), got {t.device}")


def check_kvcache_inputs(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None):
    """The Python twin of the shape checks of mha_ext::check_kvcache_inputs.
    Returns (B, Lq, Hq, Hkv, Ev)."""
    paged = block_table is not None
    rows = "num_blocks, block_size, heads, head_dim" if paged else "batch, max_seqlen, heads, head_dim"
    _check_4d("query", query, query, "batch, seqlen, heads, head_dim")
    _check_4d("k_cache", k_cache, query, rows)
    _check_4d("v_cache", v_cache, query, rows)
    B, L, hq, E = query.shape
    S, hkv, ev = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if paged:
        t = block_table
        _check_int32("block_table", t, query, t.dim() == 2 and t.shape[0] == B, f"(B, max_blocks) with B = {B}")
        n = k_cache.shape[0]
        _check_sizes("k_cache", k_cache, (n, S, hkv, E), "(num_blocks, block_size, Hkv, E)")
        _check_sizes("v_cache", v_cache, (n, S, hkv, ev), "(num_blocks, block_size, Hkv, Ev)")
        _check(S > 0 and S % _KV_BLOCK_MULTIPLE == 0,
               lambda: f"with a block_table, the cache blocks (k_cache dim 1) must hold a multiple of "
               f"{_KV_BLOCK_MULTIPLE} rows, got {S}")
    else:
        _check_sizes("k_cache", k_cache, (B, S, hkv, E), "(B, S_max, Hkv, E)")
        _check_sizes("v_cache", v_cache, (B, S, hkv, ev), "(B, S_max, Hkv, Ev)")
    _check(hq == hkv or (hkv > 0 and hq % hkv == 0),
           lambda: f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    c = cache_seqlens
    _check_int32("cache_seqlens", c, query, c.dim() == 1 and c.shape[0] == B, f"(B) = ({B})")
    _check((k_new is None) == (v_new is None),
           lambda: f"k_new and v_new must be given together, got {'k_new only' if k_new is not None else 'v_new only'}")
    if k_new is not None:
        _check_4d("k_new", k_new, query, "batch, seqlen, heads, head_dim")
        _check_4d("v_new", v_new, query, "batch, seqlen, heads, head_dim")
        n = k_new.shape[1]
        _check_sizes("k_new", k_new, (B, n, hkv, E), "(B, L_new, Hkv, E)")
        _check_sizes("v_new", v_new, (B, n, hkv, ev), "(B, L_new, Hkv, Ev)")
    return B, L, hq, hkv, ev


def check_forward_only(query, k_cache, v_cache, k_new, v_new, alibi_slopes):
    """prepare_kvcache's (csrc/kvcache_host.h) refusal of a call that asks
    for gradients, in the same words (under torch.compile the fake kernel
    is what sees the call in grad mode)."""
    if not torch.is_grad_enabled():
        return
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                    ("v_new", v_new), ("alibi_slopes", alibi_slopes)):
        _check(t is None or not t.requires_grad,
               lambda: f"kvcache_attention is forward only (no backward): {name} requires grad while grad mode is on; "
                       "call it under torch.no_grad() or torch.inference_mode(), or pass tensors that do not "
                       "require grad")


def _kvcache_fake(query, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, scale=None, is_causal=False,
                  window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, block_table=None):
    check_forward_only(query, k_cache, v_cache, k_new, v_new, alibi_slopes)
    B, L, hq, _, ev = check_kvcache_inputs(query, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table)
    check_variant(query, (B,), hq, window_left, window_right, softcap, alibi_slopes)
    return query.new_empty((B, L, hq, ev)), query.new_empty((B, hq, L), dtype=_acc_dtype(query.dtype))


def kvcache_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    *,
    causal: bool = False,
    window: tuple = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block_table: Optional[torch.Tensor] = None,
    return_lse: bool = False,
):
    """Attention against a preallocated KV cache, forward only (FlashAttention's
    flash_attn_with_kvcache).

    query (B, Lq, Hq, E); k_cache (B, S_max, Hkv, E) and v_cache (B, S_max, Hkv,
    Ev), preallocated; cache_seqlens int32 (B): keys already cached. k_new /
    v_new (B, L_new, Hkv, E / Ev), when given, are written into the caches in
    place at rows cache_seqlens[b] .. cache_seqlens[b] + L_new (the caller
    advances cache_seqlens); nothing is copied or concatenated. Batch b attends
    to its first cache_seqlens[b] + L_new keys, causal / window / ALiBi aligned
    at the bottom-right corner (the last query row sees the last key); GQA
    (Hq a multiple of Hkv), softcap, scale. Returns (B, Lq, Hq, Ev), and with
    return_lse=True also the logsumexp (B, Hq, Lq).

    Paged (block_table int32 (B, max_blocks), as vLLM and FlashAttention
    lay it out): k_cache / v_cache are a pool (num_blocks, block_size, Hkv,
    E / Ev), block_size a multiple of 256, and batch b's key j is row
    j % block_size of block block_table[b, j // block_size]; S_max =
    max_blocks * block_size. Decode steps (at most 16 query rows per
    key/value head) and the CUDA kernels read the blocks in place; longer
    query chunks on the CPU gather a batch's blocks first."""
    wl, wr, _, cap = _variant_args("bottom_right", window, softcap)
    args = (query, k_cache, v_cache, cache_seqlens, k_new, v_new, scale, bool(causal), wl, wr, cap, alibi_slopes,
            block_table)
    # the plain call from C++ without torch.ops's boxing (None where it declines)
    res = None if torch.compiler.is_compiling() else _C.kvcache_attention(*args)
    out, lse = res if res is not None else torch.ops.mha_ext.kvcache_attention(*args)
    return (out, lse) if return_lse else out
