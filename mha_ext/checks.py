"""The Python layer's input checks, shared by the fake kernels of every op
(ops.py, varlen.py, kvcache.py) and the functional API. They mirror
csrc/checks.cpp word for word, so an error reads the same in eager mode and
under torch.compile / torch.export.
"""
import torch

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _fmt(sizes) -> str:
    return "(" + ", ".join(str(s) for s in sizes) + ")"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(cond, msg_fn):
    if not cond:
        raise RuntimeError(msg_fn())


def _check_qkv_common(name, t, query, dims_ok, dims_want):
    """query, key and value (of every op): a supported float type, dims_ok
    (else dims_want), and key / value query's dtype and device. Returns
    whether t is not query (the twin of check_qkv_common in csrc/checks.cpp)."""
    _check(
        t.dtype in _FLOATS,
        lambda: f"{name} must be a floating-point tensor (float64, float32, float16 or bfloat16), got {t.dtype}",
    )
    _check(dims_ok, lambda: f"{name} must have {dims_want}, got shape {_fmt(t.shape)}")
    if t is query:
        return False
    _check(t.dtype == query.dtype, lambda: f"{name} must have the same dtype as query ({query.dtype}), got {t.dtype}")
    _check(
        t.device == query.device,
        lambda: f"{name} must be on the same device as query ({query.device}), got {t.device}",
    )
    return True


def _check_qkv_tensor(name, t, query):
    if not _check_qkv_common(name, t, query, t.dim() >= 3, "at least 3 dims (..., heads, seq_len, head_dim)"):
        return
    _check(
        t.dim() == query.dim(),
        lambda: f"{name} must have the same number of dims as query ({query.dim()}), got {t.dim()}",
    )
    qb, tb = tuple(query.shape[:-3]), tuple(t.shape[:-3])
    _check(qb == tb, lambda: f"{name} batch dims must equal query's {_fmt(qb)}, got {_fmt(tb)}")


def check_attention_inputs(query, key, value, attn_mask, dropout_p, enable_gqa):
    """The Python twin of mha_ext::check_attention_inputs (csrc/checks.cpp).

    Returns (batch_sizes, Hq, Hkv, L, S, E, Ev)."""
    _check_qkv_tensor("query", query, query)
    _check_qkv_tensor("key", key, query)
    _check_qkv_tensor("value", value, query)
    batch = tuple(query.shape[:-3])
    hq, L, E = query.shape[-3:]
    hkv, S = key.shape[-3], key.shape[-2]
    ev = value.shape[-1]
    _check(key.shape[-1] == E, lambda: f"key must have the same head_dim as query ({E}), got {key.shape[-1]}")
    _check(
        value.shape[-3] == hkv,
        lambda: f"value must have the same number of heads as key ({hkv}), got {value.shape[-3]}",
    )
    _check(value.shape[-2] == S, lambda: f"value must have the same seq_len as key ({S}), got {value.shape[-2]}")
    if enable_gqa:
        _check(
            hq == hkv or (hkv > 0 and hq % hkv == 0),
            lambda: f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) with enable_gqa=True",
        )
    else:
        _check(
            hkv == hq,
            lambda: f"key must have the same number of heads as query ({hq}) unless enable_gqa=True, got {hkv}",
        )
    if attn_mask is not None:
        m = attn_mask
        _check(
            m.dtype == torch.bool or m.dtype == query.dtype,
            lambda: f"attn_mask must be bool or query's dtype ({query.dtype}), got {m.dtype}",
        )
        _check(
            m.device == query.device,
            lambda: f"attn_mask must be on the same device as query ({query.device}), got {m.device}",
        )
        target = batch + (hq, L, S)
        ok = m.dim() <= len(target) and all(
            m.shape[-i] == target[-i] or m.shape[-i] == 1 for i in range(1, m.dim() + 1)
        )
        _check(ok, lambda: f"attn_mask must broadcast to (N..., Hq, L, S) = {_fmt(target)}, got {_fmt(m.shape)}")
    check_dropout_p(dropout_p)
    return batch, hq, hkv, L, S, E, ev


def check_variant(query, batch, hq, window_left, window_right, softcap, alibi_slopes):
    """The Python twin of mha_ext::check_variant (csrc/checks.cpp)."""
    _check(window_left >= -1, lambda: f"window_left must be >= -1 (-1: no limit), got {window_left}")
    _check(window_right >= -1, lambda: f"window_right must be >= -1 (-1: no limit), got {window_right}")
    _check(
        softcap == softcap and abs(softcap) != float("inf") and softcap >= 0.0,
        lambda: f"softcap must be a finite number >= 0 (0: none), got {softcap:g}",
    )
    if alibi_slopes is not None:
        a = alibi_slopes
        full = tuple(batch) + (hq,)
        _check(
            a.is_floating_point() and tuple(a.shape) in ((hq,), full),
            lambda: f"alibi_slopes must be a floating-point tensor of shape (Hq) = ({hq}) or (N..., Hq) = "
            f"{_fmt(full)}, got {a.dtype} of shape {_fmt(a.shape)}",
        )
        _check(
            a.device == query.device,
            lambda: f"alibi_slopes must be on the same device as query ({query.device}), got {a.device}",
        )


def check_dropout_p(dropout_p):
    _check(0.0 <= dropout_p < 1.0, lambda: f"dropout_p must be in [0, 1), got {dropout_p:g}")


def check_rng_state(r, query_device, frame_len_q=None):
    """rng_state: (seed, offset); for the dense ops (frame_len_q, the query
    length, given) also (seed, offset, rows, row0, col0), a dropout frame."""
    placed = r.device.type == "cpu" or r.device == query_device
    framed = frame_len_q is not None and r.numel() == 5
    where = "on the CPU" if query_device.type == "cpu" else f"on the CPU or on query's device ({query_device})"
    shapes = "(2) holding (seed, offset)" + (
        " or of shape (5) holding (seed, offset, rows, row0, col0)" if frame_len_q is not None else "")
    _check(
        r.dtype == torch.int64 and (r.numel() == 2 or framed) and r.dim() == 1 and placed,
        lambda: f"rng_state must be an int64 tensor of shape {shapes} {where}, got "
        f"{r.dtype} of shape {_fmt(r.shape)} on {r.device}",
    )


def _check_same_shape(name, t, expected, like, dtype=None):
    want = like.dtype if dtype is None else dtype
    _check(t.dtype == want, lambda: f"{name} must have dtype {want}, got {t.dtype}")
    _check(t.device == like.device, lambda: f"{name} must be on the same device as query ({like.device}), got {t.device}")
    _check(tuple(t.shape) == tuple(expected), lambda: f"{name} must have shape {_fmt(expected)}, got {_fmt(t.shape)}")
