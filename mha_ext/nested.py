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
failed here (a CUDA build of torch on a machine without a GPU).

Under torch.compile the nested inputs must be packed buffers (no holes,
offsets from 0 to the buffer's end: what torch.nested.nested_tensor and
nested_tensor_from_jagged make), and key and value must share their
offsets: what eager mode reads from the offsets' values, a graph cannot.

Also as in torch: inputs ragged on dim 1 with dense dims after it,
(B, j, L, E), are a batch of j items each, run through the dense op on the
packed buffers.
"""
import torch

from .checks import _check, _fmt

__all__ = ["jagged_attention"]


def _lengths(t):
    """The sequence lengths (B) of nested tensor t: its lengths, or its
    offsets' differences where it has none."""
    lengths = t.lengths()
    return lengths if lengths is not None else t.offsets()[1:] - t.offsets()[:-1]


def _max_length(lens):
    n = int(lens.max()) if lens.numel() > 0 else 0
    if torch.compiler.is_compiling():  # (an unbacked length in a compiled graph: its bounds, for the op's checks)
        torch._check(n >= 0)
    return n


def _packed(name, t):
    """t, ragged on dim r -> (its rows (total, ...), the ragged dim first and
    packed in sequence order; cu_seqlens int32 (B + 1); the longest
    sequence; and the row of t's buffer each packed row came from, or None
    where they are the buffer itself). Only t.values() goes through the
    nested tensor's own dispatch (a Python call each)."""
    offsets, lengths = t.offsets(), t.lengths()
    values = t.values().movedim(t._ragged_idx - 1, 0)
    max_len = t._maybe_max_seqlen  # (cached by the nested tensor, else read from its offsets)
    max_len = _max_length(_lengths(t)) if max_len is None else max_len
    if torch.compiler.is_compiling():
        # A compiled graph takes the offsets of a packed buffer as they are
        # (what torch.nested.nested_tensor and nested_tensor_from_jagged
        # make; the op's host code checks them as cu_seqlens when it runs):
        # gathering a view's rows depends on the offsets' values.
        _check(lengths is None, lambda: f"{name}: a nested view with holes (lengths, as torch.nested.narrow makes) "
                                        "is not supported under torch.compile; call .contiguous() on it first")
        return values, offsets.to(torch.int32), max_len, None
    if lengths is None and int(offsets[0]) == 0 and int(offsets[-1]) == values.shape[0]:
        return values, offsets.to(torch.int32), max_len, None
    # a view with holes (torch.nested.narrow) or offsets not starting at 0:
    # its rows gathered in sequence order
    lens = _lengths(t)
    _check(bool((lens >= 0).all()), lambda: f"{name}'s sequence lengths must be >= 0, got {lens.tolist()}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=offsets.device)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    # packed row i of sequence b is buffer row offsets[b] + (i - cu[b])
    rows = torch.arange(total, device=offsets.device) + torch.repeat_interleave(offsets[:-1] - cu[:-1], lens,
                                                                                output_size=total)
    rows = rows.to(values.device)
    return values.index_select(0, rows), cu.to(torch.int32), max_len, rows


def _check_nested(fn, query, key, value, attn_mask):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(t.is_nested, lambda: f"{fn}(): {name} must be a nested tensor as the other inputs are, "
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
    if torch.compiler.is_compiling():
        # the ragged sizes as symbols: equal where the tensors share their
        # offsets (the lengths' values are not read in a compiled graph)
        r = a._ragged_idx
        _check(a.shape[r] == b.shape[r],
               lambda: "under torch.compile, nested inputs whose lengths must agree must share their offsets (the "
                       "same ragged size), got different ones")
        return True
    la, lb = _lengths(a), _lengths(b)
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
        _check(alibi_slopes is None, lambda: f"{fn}(): alibi_slopes with inputs ragged on dim 1 (dense items) is not "
                                             "supported, got a tensor")
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
           lambda: f"{fn}(): key must have the same number of heads as query ({hq}) unless enable_gqa=True, got {hkv}")
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
    if torch.compiler.is_compiling():
        # the cached extents are symbolic there, which the public call does
        # not take: torch's own view, so that a chained call keeps them
        from torch.nested._internal.nested_tensor import nested_view_from_values_offsets_lengths
        return nested_view_from_values_offsets_lengths(values, t.offsets(), t.lengths(), ragged_idx=r,
                                                       min_seqlen=t._maybe_min_seqlen, max_seqlen=t._maybe_max_seqlen)
    return torch.nested.nested_tensor_from_jagged(values, t.offsets(), lengths=t.lengths(), jagged_dim=r,
                                                  min_seqlen=t._maybe_min_seqlen, max_seqlen=t._maybe_max_seqlen)


def multihead_forward(m, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                      is_causal):
    """mha_ext.MultiheadAttention.forward on nested tensors of the jagged
    layout, (N, j, E) with batch_first=True, in training and inference (torch's
    module takes only the strided layout, only in its inference path). Each
    sequence attends to its own keys (no mask: the lengths are the padding),
    and is_causal, which torch's module takes only as a hint about its
    attn_mask, makes it causal per sequence (top-left): there is no mask to
    say so with nested inputs, and so a TransformerDecoderLayer's
    tgt_is_causal=True trains on ragged batches. The output is nested like
    the query. need_weights: (N, H, L, S) per
    sequence, zero-padded to the longest, averaged over heads by default (as
    torch's inference path returns them for nested inputs); not with dropout."""
    from .ops import scaled_dot_product_attention

    is_causal = bool(is_causal)  # (torch's module takes any truth value, None included)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(t.is_nested and t.layout == torch.jagged,
               lambda: f"MultiheadAttention: nested inputs must all be nested tensors of layout torch.jagged, got "
                       f"{name} {'of layout ' + str(t.layout) if t.is_nested else 'dense'}")
        _check(t.dim() == 3 and t._ragged_idx == 1,
               lambda: f"MultiheadAttention: nested {name} must be (N, j, E), ragged on dim 1, got {t.dim()} dims "
                       f"ragged on dim {t._ragged_idx}")
    _check(m.batch_first,
           lambda: "MultiheadAttention: nested inputs are (N, j, E): batch_first must be True, got False")
    _check(key_padding_mask is None and attn_mask is None,
           lambda: "MultiheadAttention: key_padding_mask and attn_mask are not supported with nested inputs (each "
                   f"sequence attends to its own keys), got key_padding_mask "
                   f"{'None' if key_padding_mask is None else 'a tensor'} and attn_mask "
                   f"{'None' if attn_mask is None else 'a tensor'}")
    _check(m.bias_k is None and not m.add_zero_attn,
           lambda: "MultiheadAttention: add_bias_kv and add_zero_attn are not supported with nested inputs, got "
                   f"add_bias_kv={m.bias_k is not None}, add_zero_attn={m.add_zero_attn}")
    E, H = m.embed_dim, m.num_heads
    D = E // H
    _check(query.shape[-1] == E,
           lambda: f"MultiheadAttention: query's last dim must be embed_dim ({E}), got {query.shape[-1]}")
    for name, t, want in (("key", key, m.kdim), ("value", value, m.vdim)):
        _check(t.shape[-1] == want, lambda: f"MultiheadAttention: {name}'s last dim must be "
                                            f"{name[0]}dim ({want}), got {t.shape[-1]}")
    N = query.shape[0]
    for name, t in (("key", key), ("value", value)):
        _check(t.shape[0] == N, lambda: f"MultiheadAttention: {name} must have query's batch size ({N}), got "
                                        f"{t.shape[0]}")
    dropout_p = m.dropout if m.training else 0.0
    _check(not (need_weights and torch.compiler.is_compiling()),
           lambda: "MultiheadAttention: need_weights=True with nested inputs is not supported under torch.compile "
                   "(the weights are padded to the longest sequence, a value of the data); pass need_weights=False")
    _check(not (need_weights and dropout_p > 0.0),
           lambda: f"MultiheadAttention: need_weights=True with dropout ({dropout_p}) in training is not supported "
                   "with nested inputs; pass need_weights=False")
    if m._qkv_same_embed_dim:
        w_q, w_k, w_v = m.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    b_q, b_k, b_v = (None, None, None) if m.in_proj_bias is None else m.in_proj_bias.chunk(3)
    q = torch.nn.functional.linear(query, w_q, b_q).unflatten(-1, (H, D)).transpose(1, 2)  # (N, H, j, D)
    k = torch.nn.functional.linear(key, w_k, b_k).unflatten(-1, (H, D)).transpose(1, 2)
    v = torch.nn.functional.linear(value, w_v, b_v).unflatten(-1, (H, D)).transpose(1, 2)
    out = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
    out = m.out_proj(out.transpose(1, 2).flatten(-2))  # (N, j, E)
    if not need_weights:
        return out, None
    return out, _padded_weights(q, k, average_attn_weights, is_causal)


def _padded_weights(q, k, average, is_causal=False):
    """softmax(q k^T / sqrt(D)) of each sequence (causal: top-left), (N, H, L,
    S) zero-padded to the longest query and key sequences (mean over heads if
    average)."""
    qs, ks = q.unbind(), k.unbind()  # (H, L_b, D), (H, S_b, D)
    L, S = max((t.shape[1] for t in qs), default=0), max((t.shape[1] for t in ks), default=0)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    w = torch.zeros(len(qs), q.shape[1], L, S, dtype=acc, device=q.device)
    for b, (qb, kb) in enumerate(zip(qs, ks)):
        if kb.shape[1] > 0:
            scores = (qb.to(acc) @ kb.to(acc).transpose(-2, -1)) * qb.shape[-1] ** -0.5
            if is_causal:
                scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
                                            .triu(1), float("-inf"))
            w[b, :, :qb.shape[1], :kb.shape[1]] = torch.softmax(scores, dim=-1)
    w = w.to(q.dtype)
    return w.mean(dim=1) if average else w
