"""Nested tensors of torch's jagged layout in mha_ext.scaled_dot_product_attention.

A jagged nested tensor (torch.nested.nested_tensor(..., layout=torch.jagged))
holds B sequences of different lengths in one packed buffer, their rows found
by int64 offsets (B + 1). SDPA takes them as query (B, Hq, j, E), key
(B, Hkv, k, E), value (B, Hkv, k, Ev), the ragged dim 2 (a
(B, j, H * E) tensor unflattened and transposed): the packed buffers are
FlashAttention's varlen layout, (total, H, E), so they go to the varlen op
in place, no padding and no copy, and the output is a nested view of the
op's packed output on the query's offsets (the same ragged size, so it adds
to the query). torch's own CPU path for these copies every sequence into a
strided nested tensor and runs its math kernel on each; with is_causal it
fails on a CPU-only machine.

Also as in torch: inputs ragged on dim 1 with dense dims after it,
(B, j, L, E), are a batch of j items each, run through the dense op on the
packed buffers.
"""
import torch

from .checks import _check, _fmt

__all__ = ["jagged_attention"]


def _max_length(offsets, lengths):
    lens = lengths if lengths is not None else offsets[1:] - offsets[:-1]
    return int(lens.max()) if lens.numel() > 0 else 0


def _packed(name, t):
    """t, ragged on dim r -> (its rows (total, ...), the ragged dim first and
    packed in sequence order; cu_seqlens int32 (B + 1); the longest
    sequence; and the row of t's buffer each packed row came from, or None
    where they are the buffer itself). Only t.values() goes through the
    nested tensor's own dispatch (a Python call each)."""
    offsets, lengths = t.offsets(), t.lengths()
    values = t.values().movedim(t._ragged_idx - 1, 0)
    max_len = t._maybe_max_seqlen  # (cached by the nested tensor, else read from its offsets)
    max_len = _max_length(offsets, lengths) if max_len is None else max_len
    # (compiled: the offsets of a buffer without holes taken as they are; the
    # op's host code checks cu_seqlens when it runs)
    if lengths is None and (torch.compiler.is_compiling() or
                            (int(offsets[0]) == 0 and int(offsets[-1]) == values.shape[0])):
        return values, offsets.to(torch.int32), max_len, None
    # a view with holes (torch.nested.narrow) or offsets not starting at 0:
    # its rows gathered in sequence order
    starts = offsets[:-1]
    lens = lengths if lengths is not None else offsets[1:] - offsets[:-1]
    _check(bool((lens >= 0).all()), lambda: f"{name}'s sequence lengths must be >= 0, got {lens.tolist()}")
    rows = torch.cat([torch.arange(int(s), int(s) + int(n), device=values.device)
                      for s, n in zip(starts.tolist(), lens.tolist())]) if lens.numel() else offsets.new_zeros(0)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=offsets.device)
    cu[1:] = lens.cumsum(0)
    return values.index_select(0, rows), cu, max_len, rows


def _check_nested(fn, query, key, value, attn_mask):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(t.is_nested, lambda: f"{fn}(): {name} must be a nested tensor as query is, "
                                    "got a dense tensor")
        _check(t.layout == torch.jagged,
               lambda: f"{fn}(): {name} must be a nested tensor of layout torch.jagged, got "
                       f"{t.layout} (torch.nested.nested_tensor(..., layout=torch.jagged))")
    _check(attn_mask is None,
           lambda: f"{fn}(): attn_mask is not supported with nested (jagged) inputs, got a "
                   "tensor (each sequence already sees only its own keys; is_causal applies per sequence)")
    dims = (query.dim(), key.dim(), value.dim())
    _check(dims == (4, 4, 4), lambda: f"{fn}(): nested query, key and value must have 4 dims "
                                      f"(batch, heads, j, head_dim), got {dims[0]}, {dims[1]} and {dims[2]}")
    ragged = (query._ragged_idx, key._ragged_idx, value._ragged_idx)
    _check(ragged in ((2, 2, 2), (1, 1, 1)),
           lambda: f"{fn}(): nested query, key and value must all be ragged on dim 2 "
                   f"(batch, heads, j, head_dim) or all on dim 1, got dims {ragged[0]}, {ragged[1]} and {ragged[2]}")
    B = query.shape[0]
    for name, t in (("key", key), ("value", value)):
        _check(t.shape[0] == B, lambda: f"{fn}(): {name} must have query's batch size ({B}), "
                                        f"got {t.shape[0]}")
    return ragged[0]


def _same_lengths(a, b):
    if a.offsets() is b.offsets() and a.lengths() is b.lengths():
        return True
    if torch.compiler.is_compiling():  # (not read from the data in a compiled graph)
        return True
    la = a.lengths() if a.lengths() is not None else a.offsets()[1:] - a.offsets()[:-1]
    lb = b.lengths() if b.lengths() is not None else b.offsets()[1:] - b.offsets()[:-1]
    return la.shape == lb.shape and bool(torch.equal(la.cpu(), lb.cpu()))


def jagged_attention(fn, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dense,
                     alignment="top_left", window=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False):
    """fn (scaled_dot_product_attention or attention, named in the errors) on
    nested tensors of the jagged layout (module docstring): the output, and
    with return_lse the logsumexp (B, Hq, j) nested likewise. dense(q, k, v)
    is the dense call (its output and logsumexp) for inputs ragged on dim 1;
    the variants apply per sequence, as in varlen_attention."""
    from .varlen import varlen_attention

    ragged = _check_nested(fn, query, key, value, attn_mask)
    if ragged == 1:  # (B, j, L, E): B x j dense items of L rows
        for name, t in (("key", key), ("value", value)):
            _check(_same_lengths(query, t), lambda: f"{fn}(): {name} must have query's ragged lengths on dim 1")
        (q, _, _, q_rows), (k, *_), (v, *_) = (_packed(n, t) for n, t in (("query", query), ("key", key),
                                                                          ("value", value)))
        out, lse = dense(q, k, v)
        out = _nested_like(_unpacked(out, q_rows, query), query)
        return out, None if lse is None else _nested_like(_unpacked(lse, q_rows, query), query)
    hq, hkv = query.shape[1], key.shape[1]
    _check(value.shape[1] == hkv,
           lambda: f"{fn}(): value must have key's number of heads ({hkv}), got {value.shape[1]}")
    _check(hq == hkv or enable_gqa,
           lambda: f"key must have the same number of heads as query ({hq}) unless enable_gqa=True, got {hkv}")
    _check(_same_lengths(key, value), lambda: f"{fn}(): value must have key's sequence lengths")
    q, cu_q, max_q, q_rows = _packed("query", query)  # (total, H, D): FlashAttention's varlen layout
    k, cu_k, max_k, _ = _packed("key", key)
    v = _packed("value", value)[0]
    all_dropped = dropout_p == 1.0  # torch gives zeros (NaN stays NaN)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0 if all_dropped else dropout_p,
                                causal=is_causal, alignment=alignment, window=window, softcap=softcap,
                                alibi_slopes=alibi_slopes, scale=scale, return_lse=True)
    if all_dropped:
        out = out * 0.0
    out = _nested_like(_unpacked(out, q_rows, query), query)
    return out, _nested_like(_unpacked(lse.t(), q_rows, query), query) if return_lse else None


def _unpacked(out, rows, t):
    """out (packed rows, ...) back on the rows of t's buffer that _packed
    took them from (rows None: they are that buffer's)."""
    if rows is None:
        return out
    n = t.values().shape[t._ragged_idx - 1]
    return out.new_zeros((n,) + tuple(out.shape[1:])).index_copy(0, rows, out)


def _nested_like(values, t):
    """values (rows of t's buffer first, ...) as a nested tensor ragged on
    t's dim, with t's offsets and lengths (so its ragged size is t's)."""
    r = t._ragged_idx
    values = values.movedim(0, r - 1)
    if torch.compiler.is_compiling():  # (the cached extents are symbolic there, which this call does not take)
        return torch.nested.nested_tensor_from_jagged(values, t.offsets(), lengths=t.lengths(), jagged_dim=r)
    return torch.nested.nested_tensor_from_jagged(values, t.offsets(), lengths=t.lengths(), jagged_dim=r,
                                                  min_seqlen=t._maybe_min_seqlen, max_seqlen=t._maybe_max_seqlen)
