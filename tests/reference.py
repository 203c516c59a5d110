"""The one independent reference for mha_ext's tests: plain float64 code,
written from the definitions, sharing nothing with the kernels."""
import math

import numpy as np
import torch


def scores(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
           compute_dtype=torch.float64, window=(-1, -1), bottom_right=False, softcap=0.0, alibi_slopes=None):
    """scale * q k^T after the variants and the mask, -inf where a key is
    hidden, in compute_dtype: (..., Hq, L, S), and the (..., Hq, L, S) bool of
    the keys each row may see. See probabilities()."""
    q, k = query.to(compute_dtype), key.to(compute_dtype)
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        assert enable_gqa and hq % hkv == 0
        k = k.repeat_interleave(hq // hkv, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    diag = torch.arange(L).unsqueeze(-1) + (S - L if bottom_right else 0)  # (L, 1)
    col = torch.arange(S)
    if alibi_slopes is not None:
        dist = (diag - col).abs().to(compute_dtype)
        scores = scores - alibi_slopes.to(compute_dtype)[..., None, None] * dist
    allowed = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        allowed = allowed & (col <= diag)
    if window[0] >= 0:
        allowed = allowed & (col >= diag - window[0])
    if window[1] >= 0:
        allowed = allowed & (col <= diag + window[1])
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            scores = scores + attn_mask.to(compute_dtype)
    allowed = allowed.expand(scores.shape)
    return scores.masked_fill(~allowed, float("-inf")), allowed


def probabilities(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                  compute_dtype=torch.float64, **variant):
    """softmax(scale * q k^T + mask) in compute_dtype, SDPA semantics, with the
    key/value heads repeated for GQA: (..., Hq, L, S). A row with no key to
    attend to is 0. Differentiable (autograd).

    attn_mask: bool (True = may attend) or float (added), broadcastable to
    (..., Hq, L, S). The diagonal key of query i is d = i (top-left) or
    d = i + S - L (variant bottom_right=True). is_causal: query i sees keys
    <= d; window=(left, right): keys d - left .. d + right (-1: unbounded); all
    applied together with attn_mask. softcap > 0: the scaled scores become
    softcap * tanh(scores / softcap); alibi_slopes (Hq) or (..., Hq): minus
    slope * |d - j|; both before the mask is added."""
    s, allowed = scores(query, key, attn_mask, is_causal, scale, enable_gqa, compute_dtype, **variant)
    any_key = allowed.any(dim=-1, keepdim=True) & (s > float("-inf")).any(dim=-1, keepdim=True)
    probs = torch.softmax(torch.where(any_key, s, 0.0), dim=-1)
    return torch.where(any_key, probs, 0.0)


def _repeat_kv(t, hq):
    return t if t.shape[-3] == hq else t.repeat_interleave(hq // t.shape[-3], dim=-3)


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
              keep=None, dropout_p=0.0, compute_dtype=torch.float64, **variant):
    """softmax(scale * q k^T + mask) v in float64, SDPA semantics.

    compute_dtype: float64 for the reference; the inputs' own dtype gives what
    plain eager PyTorch gets in that dtype (every op rounding to it), the
    yardstick for half and bfloat16 kernels. Masks and is_causal as in
    probabilities(), and its variant keywords (window, bottom_right, softcap,
    alibi_slopes). keep: bool dropout keep-mask (..., Hq, L, S).
    A row with no key to attend to gives 0. Differentiable (autograd)."""
    probs = probabilities(query, key, attn_mask, is_causal, scale, enable_gqa, compute_dtype, **variant)
    if keep is not None:
        probs = probs * keep.to(compute_dtype) / (1.0 - dropout_p)
    return probs @ _repeat_kv(value.to(compute_dtype), query.shape[-3])


def magnitudes(query, key, value, grad_out, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
               keep=None, dropout_p=0.0, **variant):
    """For each result (out, dq, dk, dv, dmask), the magnitude of the terms
    summed into each element, in float64: the sums with every term replaced by
    its absolute value. The scale against which a rounding error is judged.
    dk and dv are per key/value head (summed over a GQA group), dmask is
    (..., Hq, L, S) before any broadcast is summed out (sum_to)."""
    with torch.no_grad():
        hq = query.shape[-3]
        q, k, v, go = (t.double() for t in (query, key, value, grad_out))
        kr, vr = _repeat_kv(k, hq).abs(), _repeat_kv(v, hq).abs()
        p = probabilities(query, key, attn_mask, is_causal, scale, enable_gqa, **variant)
        pd = p if keep is None else p * keep.double() / (1.0 - dropout_p)
        sc = abs(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        d = ((pd @ vr) * go.abs()).sum(-1, keepdim=True)  # D = rowsum(dO * O), O's terms included
        dp = go.abs() @ vr.transpose(-2, -1)
        if keep is not None:
            dp = dp * keep.double() / (1.0 - dropout_p)
        ds = p * (dp + d)

        def per_kv_head(t):  # (..., Hq, S, X) -> (..., Hkv, S, X)
            g = hq // key.shape[-3]
            return t.unflatten(-3, (key.shape[-3], g)).sum(-3)

        return {"out": pd @ vr, "dq": sc * ds @ kr, "dk": per_kv_head(sc * ds.transpose(-2, -1) @ q.abs()),
                "dv": per_kv_head(pd.transpose(-2, -1) @ go.abs()), "dmask": ds}


def sum_to(t, shape):
    """t summed over the dims that broadcast to it from `shape` (a mask's)."""
    lead = t.dim() - len(shape)
    t = t.sum(dim=tuple(range(lead))) if lead > 0 else t
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


def logsumexp(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, **variant):
    s, _ = scores(query, key, attn_mask, is_causal, scale, enable_gqa, **variant)
    return torch.logsumexp(s, dim=-1)


# Philox4x32-10 (Salmon et al., SC'11) on numpy arrays.
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint32) for x in (c0, c1, c2, c3))
    k0, k1 = np.uint32(k0), np.uint32(k1)
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0 = _M0 * c0.astype(np.uint64)
            p1 = _M1 * c2.astype(np.uint64)
            n0 = (p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0
            n1 = (p1 & _LO).astype(np.uint32)
            n2 = (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1
            n3 = (p0 & _LO).astype(np.uint32)
            c0, c1, c2, c3 = n0, n1, n2, n3
            k0, k1 = np.uint32(k0 + _W0), np.uint32(k1 + _W1)
    return np.stack([c0, c1, c2, c3])


def dropout_keep(seed, offset, shape, dropout_p):
    """The keep mask of mha_ext's dropout contract: element (row, j) of the
    flattened (rows, S) view uses word j % 4 of
    Philox(key=seed, counter=(offset + j // 4, row)); it is dropped iff that
    word < floor(p * 2^32)."""
    *lead, S = shape
    rows = int(np.prod(lead)) if lead else 1
    row = np.repeat(np.arange(rows, dtype=np.uint64), S)
    j = np.tile(np.arange(S, dtype=np.uint64), rows)
    group = (np.uint64(offset) + j // np.uint64(4)).astype(np.uint64)
    seed = np.uint64(seed)
    words = philox4x32_10(group & _LO, group >> np.uint64(32), row & _LO, row >> np.uint64(32),
                          seed & _LO, seed >> np.uint64(32))
    word = words[(j % np.uint64(4)).astype(np.int64), np.arange(rows * S)]
    threshold = np.uint64(math.floor(dropout_p * 2**32))
    return torch.from_numpy(word.astype(np.uint64) >= threshold).reshape(shape)
