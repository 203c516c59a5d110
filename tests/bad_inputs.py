"""The catalogue of bad inputs for tests/test_bad_inputs.py: each case is a
snippet run in a process of its own, and what it must do: raise a clear error
(its type and a pattern of its message, which names the argument and says what
was expected and what came), or behave as torch does (the snippet asserts it).

Snippets see: torch, F (torch.nn.functional), mha_ext, sdpa (the drop-in), op
(torch.ops.mha_ext), MHA (mha_ext.MultiheadAttention), and t(*shape, dtype=)
for random tensors."""
import traceback

PRELUDE = """
import torch
import torch.nn.functional as F
import mha_ext
sdpa = mha_ext.scaled_dot_product_attention
op = torch.ops.mha_ext
MHA = mha_ext.MultiheadAttention
torch.manual_seed(0)
def t(*shape, dtype=torch.float32):
    x = torch.randn(*shape, dtype=torch.float64)
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)
q, k, v = t(2, 4, 6, 8), t(2, 4, 5, 8), t(2, 4, 5, 3)
def same_as_torch(ours, theirs):
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
"""


def R(exc, pattern):  # must raise exc with a message matching pattern
    return ("raises", exc, pattern)


TORCH = ("passes",)  # the snippet compares with torch (or asserts the defined behaviour) itself

CASES = {
    # -- types ------------------------------------------------------------
    "query not a tensor": ("sdpa([1.0], k, v)", R("TypeError", r"argument 'query' \(position 1\) must be Tensor, not list")),
    "value None": ("sdpa(q, k, None)", R("TypeError", r"argument 'value' \(position 3\) must be Tensor, not NoneType")),
    "attn_mask a list": ("sdpa(q, k, v, attn_mask=[[True]])", R("TypeError", r"argument 'attn_mask' \(position 4\) must be Tensor")),
    "dropout_p a string": ("sdpa(q, k, v, dropout_p='x')", R("TypeError", r"argument 'dropout_p' must be float, not str")),
    "scale a string": ("sdpa(q, k, v, scale='x')", R("TypeError", r"argument 'scale' must be float, not str")),
    "is_causal a string": ("sdpa(q, k, v, is_causal='yes')", R("TypeError", r"argument 'is_causal' must be bool, not str")),
    "integer query": ("sdpa(t(2, 4, 6, 8, dtype=torch.int64), k, v)",
                      R("RuntimeError", r"query must be a floating-point tensor .* got torch.int64")),
    "bool value": ("sdpa(q, k, t(2, 4, 5, 3, dtype=torch.bool))",
                   R("RuntimeError", r"value must be a floating-point tensor .* got torch.bool")),
    "complex query": ("sdpa(q.cfloat(), k.cfloat(), v.cfloat())",
                      R("RuntimeError", r"query must be a floating-point tensor .* got torch.complex64")),
    "key float64, query float32": ("sdpa(q, k.double(), v)",
                                   R("RuntimeError", r"key must have the same dtype as query \(torch.float32\), got torch.float64")),
    "value float16, query float32": ("sdpa(q, k, v.half())",
                                     R("RuntimeError", r"value must have the same dtype as query \(torch.float32\), got torch.float16")),
    "integer mask": ("sdpa(q, k, v, attn_mask=t(6, 5, dtype=torch.int64))",
                     R("RuntimeError", r"attn_mask must be bool or query's dtype \(torch.float32\), got torch.int64")),
    "float64 mask, float32 query": ("sdpa(q, k, v, attn_mask=t(6, 5, dtype=torch.float64))",
                                    R("RuntimeError", r"attn_mask must be bool or query's dtype \(torch.float32\), got torch.float64")),
    # -- shapes -----------------------------------------------------------
    "1-D inputs": ("sdpa(t(8), t(8), t(8))", R("RuntimeError", r"at least 2 dims .* got query.dim: 1, key.dim: 1 and value.dim: 1")),
    "head_dim mismatch": ("sdpa(q, t(2, 4, 5, 7), v)", R("RuntimeError", r"key must have the same head_dim as query \(8\), got 7")),
    "value length differs from key": ("sdpa(q, k, t(2, 4, 6, 3))",
                                      R("RuntimeError", r"value must have the same seq_len as key \(5\), got 6")),
    "value heads differ from key": ("sdpa(q, k, t(2, 2, 5, 3))",
                                    R("RuntimeError", r"value must have the same number of heads as key \(4\), got 2")),
    "heads differ without enable_gqa": ("sdpa(q, t(2, 2, 5, 8), t(2, 2, 5, 3))",
                                        R("RuntimeError", r"key must have the same number of heads as query \(4\) unless enable_gqa=True, got 2")),
    "GQA heads not a multiple": ("sdpa(t(2, 6, 6, 8), k, v, enable_gqa=True)",
                                 R("RuntimeError", r"query heads \(6\) must be a multiple of key/value heads \(4\)")),
    "batch dims that do not broadcast": ("sdpa(q, t(3, 4, 5, 8), t(3, 4, 5, 3))",
                                         R("RuntimeError", r"batch dims of query \(2\), key \(3\) and value \(3\) must broadcast")),
    "mask of the wrong shape": ("sdpa(q, k, v, attn_mask=t(3, 3))",
                                R("RuntimeError", r"attn_mask must broadcast to \(N..., Hq, L, S\) = \(2, 4, 6, 5\), got \(3, 3\)")),
    "mask with too many dims": ("sdpa(q, k, v, attn_mask=t(1, 2, 4, 6, 5))",
                                R("RuntimeError", r"attn_mask must broadcast to .* got \(1, 2, 4, 6, 5\)")),
    "mask transposed (S, L)": ("sdpa(q, k, v, attn_mask=t(5, 6) > 0)",
                               R("RuntimeError", r"attn_mask must broadcast to .* got \(5, 6\)")),
    "head dim 300 (no limit on the CPU)": ("a, b, w = t(1, 1, 3, 300), t(1, 1, 4, 300), t(1, 1, 4, 2)\n"
                                           "same_as_torch(sdpa(a, b, w), F.scaled_dot_product_attention(a, b, w))", TORCH),
    # -- values -----------------------------------------------------------
    "dropout_p above 1": ("sdpa(q, k, v, dropout_p=1.5)", R("RuntimeError", r"dropout_p must be in \[0, 1\), got 1.5")),
    "dropout_p negative": ("sdpa(q, k, v, dropout_p=-0.1)", R("RuntimeError", r"dropout_p must be in \[0, 1\), got -0.1")),
    "dropout_p NaN": ("sdpa(q, k, v, dropout_p=float('nan'))", R("RuntimeError", r"dropout_p must be in \[0, 1\), got nan")),
    "dropout_p 1 (everything dropped)": ("same_as_torch(sdpa(q, k, v, dropout_p=1.0), F.scaled_dot_product_attention(q, k, v, dropout_p=1.0))", TORCH),
    "scale 0 (uniform weights)": ("same_as_torch(sdpa(q, k, v, scale=0.0), F.scaled_dot_product_attention(q, k, v, scale=0.0))", TORCH),
    "scale negative": ("same_as_torch(sdpa(q, k, v, scale=-0.5), F.scaled_dot_product_attention(q, k, v, scale=-0.5))", TORCH),
    "scale NaN gives NaN": ("assert torch.isnan(sdpa(q, k, v, scale=float('nan'))).all()", TORCH),
    "head dim 0 (scores 0: uniform)": ("a, b = t(1, 2, 3, 0), t(1, 2, 4, 0); w = t(1, 2, 4, 5)\n"
                                       "same_as_torch(sdpa(a, b, w), F.scaled_dot_product_attention(a, b, w))", TORCH),
    "query length 0": ("assert sdpa(t(2, 4, 0, 8), k, v).shape == (2, 4, 0, 3)", TORCH),
    "key length 0 (no key: zeros)": ("out = sdpa(q, t(2, 4, 0, 8), t(2, 4, 0, 3)); assert out.shape == (2, 4, 6, 3) and (out == 0).all()", TORCH),
    "every key masked with -inf (zeros, not NaN)": (
        "m = torch.full((6, 5), float('-inf')); out = sdpa(q, k, v, attn_mask=m)\n"
        "assert (out == 0).all()\n"
        "x = q.clone().requires_grad_(); sdpa(x, k, v, attn_mask=m).sum().backward(); assert (x.grad == 0).all()", TORCH),
    "NaN in one query row stays in that row": (
        "x = q.clone(); x[0, 1, 2, 3] = float('nan'); out = sdpa(x, k, v)\n"
        "rows = torch.isnan(out).any(-1); assert rows.sum() == 1 and rows[0, 1, 2]", TORCH),
    "inf in a key": ("x = k.clone(); x[0, 0, 1, 0] = float('inf')\n"
                     "same_as_torch(sdpa(q, x, v), F.scaled_dot_product_attention(q, x, v))", TORCH),
    # sizes past the machine's RAM and swap: a clear error before any
    # allocation (where the system overcommits, the allocation itself succeeds
    # and the writes end in the out-of-memory killer, or run for hours)
    "output larger than memory": ("sdpa(t(1, 1, 1, 8).expand(1, 1, 2**40, 8), k[:1, :1], v[:1, :1])",
                                  R("RuntimeError", r"^the output of shape \(1, 1, 1099511627776, 3\) \(torch.float32\) "
                                    r"needs 12288.0 GiB, more than this process can hold \(\d+\.\d GiB: RAM and swap, within its cgroup's limit\)")),
    "varlen: output larger than memory": (
        "mha_ext.varlen_attention(t(1, 1, 8).expand(2**31 - 1, 64, 8), t(12, 1, 8), t(12, 1, 8), "
        "torch.tensor([0, 2**31 - 1], dtype=torch.int32), torch.tensor([0, 12], dtype=torch.int32), 2**31 - 1, 12)",
        R("RuntimeError", r"^the output of shape \(2147483647, 64, 8\) \(torch.float32\) needs 4096.0 GiB, more than")),
    "KV cache: output larger than memory, the caches untouched": (
        "kc, vc = torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8)\n"
        "try:\n"
        "    mha_ext.kvcache_attention(t(1, 1, 1, 8).expand(1, 2**40, 1, 8), kc, vc, torch.tensor([4], dtype=torch.int32), "
        "k_new=t(1, 1, 1, 8), v_new=t(1, 1, 1, 8))\n"
        "finally:\n"
        "    assert not kc.any() and not vc.any(), 'a cache was written before the error'",
        R("RuntimeError", r"^the output of shape \(1, 1099511627776, 1, 8\) \(torch.float32\) needs 32768.0 GiB, more than")),
    "backward: grad_key larger than memory": (
        "kb, q1 = t(1, 1, 1, 8).expand(1, 1, 2**37, 8), t(1, 1, 1, 8)\n"
        "op.attention_backward(q1, q1, kb, kb, q1, t(1, 1, 1), None, 0.0, False, None, False, torch.zeros(2, dtype=torch.long), False)",
        R("RuntimeError", r"^grad_key of shape \(1, 1, 137438953472, 8\) \(torch.float32\) needs 4096.0 GiB, more than")),
    "backward: mask gradient larger than memory": (
        "qb, m = t(1, 1, 1, 8).expand(1, 1, 2**20, 8), t(1, 1, 1, 1).expand(1, 1, 2**20, 2**20)\n"
        "op.attention_backward(qb, qb, qb, qb, qb, t(1, 1, 2**20), m, 0.0, False, None, False, "
        "torch.zeros(2, dtype=torch.long), True)",
        R("RuntimeError", r"^grad_attn_mask per head of shape \(1, 1, 1048576, 1048576\) \(torch.float32\) needs 4096.0 GiB")),
    "dropout mask larger than memory": (
        "op.dropout_mask(torch.zeros(2, dtype=torch.long), [1, 1, 2**20, 2**20], 0.1)",
        R("RuntimeError", r"^the mask of shape \(1, 1, 1048576, 1048576\) \(torch.bool\) needs 1024.0 GiB")),
    "backward: logsumexp's copy larger than memory": (
        "big = t(1, 1, 1, 8).expand(1, 1, 2**40, 8)\n"
        "op.attention_backward(big, big, k[:1, :1], k[:1, :1], big, t(1, 1, 1).expand(1, 1, 2**40), None, 0.0, False, None, "
        "False, torch.zeros(2, dtype=torch.long), False)",
        R("RuntimeError", r"^logsumexp's contiguous copy of shape \(1, 1, 1099511627776\) \(torch.float32\) needs 4096.0 GiB")),
    # -- devices ----------------------------------------------------------
    "mask on the meta device": ("sdpa(q, k, v, attn_mask=torch.zeros(6, 5, device='meta'))",
                                R("RuntimeError", r"attn_mask must be on the same device as query \(cpu\), got meta")),
    "key on the meta device": ("sdpa(q, torch.empty(2, 4, 5, 8, device='meta'), v)",
                               R("RuntimeError", r"key must be on the same device as query \(cpu\), got meta")),
    # -- the ops' own arguments ------------------------------------------
    "rng_state of the wrong dtype": ("op.attention(q, k, v, None, 0.1, False, None, False, torch.zeros(2))",
                                     R("RuntimeError", r"rng_state must be an int64 tensor of shape \(2\) .* got torch.float32 of shape \(2\)")),
    "rng_state of the wrong shape": ("op.attention(q, k, v, None, 0.1, False, None, False, torch.zeros(3, dtype=torch.int64))",
                                     R("RuntimeError", r"rng_state must be an int64 tensor of shape \(2\) .* got torch.int64 of shape \(3\)")),
    "backward: grad_out of the wrong shape": (
        "out, lse, rng = op.attention(q, k, v)\n"
        "op.attention_backward(t(2, 4, 6, 4), q, k, v, out, lse, None, 0.0, False, None, False, rng, False)",
        R("RuntimeError", r"grad_out must have shape \(2, 4, 6, 3\), got \(2, 4, 6, 4\)")),
    "backward: logsumexp of the wrong dtype": (
        "out, lse, rng = op.attention(q, k, v)\n"
        "op.attention_backward(out, q, k, v, out, lse.double(), None, 0.0, False, None, False, rng, False)",
        R("RuntimeError", r"logsumexp must have dtype torch.float32, got torch.float64")),
    "backward: out of the wrong shape": (
        "out, lse, rng = op.attention(q, k, v)\n"
        "op.attention_backward(out, q, k, v, out[:, :, :5], lse, None, 0.0, False, None, False, rng, False)",
        R("RuntimeError", r"out must have shape \(2, 4, 6, 3\), got \(2, 4, 5, 3\)")),
    "dropout_mask: empty shape": ("op.dropout_mask(torch.zeros(2, dtype=torch.int64), [], 0.1)",
                                  R("RuntimeError", r"shape must have at least 1 dim, got \(\)")),
    "dropout_mask: p out of range": ("op.dropout_mask(torch.zeros(2, dtype=torch.int64), [4], 2.0)",
                                     R("RuntimeError", r"dropout_p must be in \[0, 1\), got 2")),
    # -- the variants (mha_ext.attention and the op's arguments) -----------
    "window of three numbers": ("mha_ext.attention(q, q, q, window=(1, 2, 3))",
                                R("ValueError", r"window must be \(left, right\), got \(1, 2, 3\)")),
    "unknown alignment": ("mha_ext.attention(q, q, q, causal=True, alignment='lower_right')",
                          R("ValueError", r"alignment must be 'top_left' or 'bottom_right', got 'lower_right'")),
    "window_left below -1": ("op.attention(q, q, q, None, 0.0, False, None, False, None, -3, -1, False, 0.0, None)",
                             R("RuntimeError", r"window_left must be >= -1 \(-1: no limit\), got -3")),
    "negative softcap": ("mha_ext.attention(q, q, q, softcap=-2.0)",
                         R("RuntimeError", r"softcap must be a finite number >= 0 \(0: none\), got -2")),
    "NaN softcap": ("mha_ext.attention(q, q, q, softcap=float('nan'))",
                    R("RuntimeError", r"softcap must be a finite number >= 0 \(0: none\), got nan")),
    "ALiBi slopes of the wrong shape": ("mha_ext.attention(q, q, q, alibi_slopes=torch.ones(2, 3))",
                                        R("RuntimeError", r"alibi_slopes must be a floating-point tensor of shape "
                                                          r"\(Hq\) = \(4\) or \(N..., Hq\) = \(2, 4\), got torch.float32 of shape \(2, 3\)")),
    "integer ALiBi slopes": ("mha_ext.attention(q, q, q, alibi_slopes=torch.ones(4, dtype=torch.int32))",
                             R("RuntimeError", r"alibi_slopes must be a floating-point tensor .* got torch.int32")),
    "ALiBi slopes on another device": ("mha_ext.attention(q, q, q, alibi_slopes=torch.ones(4, device='meta'))",
                                       R("RuntimeError", r"alibi_slopes must be on the same device as query \(cpu\), got meta")),
    "bottom-right window that leaves rows empty (defined: 0)": (
        "a, b = t(1, 1, 9, 8), t(1, 1, 4, 8)\n"
        "out, lse = mha_ext.attention(a, b, b, causal=True, alignment='bottom_right', window=(0, 0), return_lse=True)\n"
        "assert (out[..., :5, :] == 0).all() and torch.isneginf(lse[..., :5]).all() and torch.isfinite(out).all()", TORCH),
    # -- varlen (mha_ext.varlen_attention): values of cu_seqlens that would
    #    read outside the packed tensors if trusted -------------------------
    "varlen: cu_seqlens int64": ("mha_ext.varlen_attention(t(10, 2, 8), t(12, 2, 8), t(12, 2, 8), "
                                 "torch.tensor([0, 4, 10]), torch.tensor([0, 5, 12], dtype=torch.int32), 6, 7)",
                                 R("RuntimeError", r"cu_seqlens_q must be an int32 tensor of shape \(batch \+ 1\), got "
                                                   r"torch.int64")),
    "varlen: cu_seqlens_k past the keys": (
        "mha_ext.varlen_attention(t(10, 2, 8), t(12, 2, 8), t(12, 2, 8), torch.tensor([0, 4, 10], dtype=torch.int32), "
        "torch.tensor([0, 5, 5000], dtype=torch.int32), 6, 5000)",
        R("RuntimeError", r"cu_seqlens_k\[-1\] must equal the packed length 12, got 5000")),
    "varlen: cu_seqlens_q decreasing": (
        "mha_ext.varlen_attention(t(10, 2, 8), t(12, 2, 8), t(12, 2, 8), torch.tensor([0, 11, 10], dtype=torch.int32), "
        "torch.tensor([0, 5, 12], dtype=torch.int32), 20, 7)",
        R("RuntimeError", r"cu_seqlens_q must not decrease, got cu_seqlens_q\[1\] = 11 > cu_seqlens_q\[2\] = 10")),
    "varlen: cu_seqlens_q negative start": (
        "mha_ext.varlen_attention(t(10, 2, 8), t(12, 2, 8), t(12, 2, 8), torch.tensor([-4, 4, 10], dtype=torch.int32), "
        "torch.tensor([0, 5, 12], dtype=torch.int32), 8, 7)",
        R("RuntimeError", r"cu_seqlens_q\[0\] must be 0, got -4")),
    "varlen: max_seqlen_k below a real length": (
        "mha_ext.varlen_attention(t(10, 2, 8), t(12, 2, 8), t(12, 2, 8), torch.tensor([0, 4, 10], dtype=torch.int32), "
        "torch.tensor([0, 5, 12], dtype=torch.int32), 6, 3)",
        R("RuntimeError", r"max_seqlen_k must be at least the longest sequence \(7\), got 3")),
    "varlen: batch sizes differ": (
        "mha_ext.varlen_attention(t(10, 2, 8), t(12, 2, 8), t(12, 2, 8), torch.tensor([0, 4, 10], dtype=torch.int32), "
        "torch.tensor([0, 12], dtype=torch.int32), 6, 12)",
        R("RuntimeError", r"cu_seqlens_k must have cu_seqlens_q's shape \(3\), got \(2\)")),
    # -- KV cache (mha_ext.kvcache_attention): positions past the cache ---
    "kvcache: cache_seqlens past the cache": (
        "mha_ext.kvcache_attention(t(2, 1, 4, 8), t(2, 16, 4, 8), t(2, 16, 4, 8), "
        "torch.tensor([3, 16], dtype=torch.int32), t(2, 1, 4, 8), t(2, 1, 4, 8))",
        R("RuntimeError", r"cache_seqlens\[1\] must be in \[0, 15\] \(S_max = 16 minus 1 new keys\), got 16")),
    "kvcache: huge cache_seqlens": (
        "mha_ext.kvcache_attention(t(2, 1, 4, 8), t(2, 16, 4, 8), t(2, 16, 4, 8), "
        "torch.tensor([2**31 - 1, 0], dtype=torch.int32))",
        R("RuntimeError", r"cache_seqlens\[0\] must be in \[0, 16\]")),
    "kvcache: v_new alone": (
        "mha_ext.kvcache_attention(t(2, 1, 4, 8), t(2, 16, 4, 8), t(2, 16, 4, 8), "
        "torch.tensor([3, 4], dtype=torch.int32), None, t(2, 1, 4, 8))",
        R("RuntimeError", r"k_new and v_new must be given together, got v_new only")),
    # -- the module -------------------------------------------------------
    "module: embed_dim not divisible by num_heads": ("MHA(10, 3)", R("ValueError", r"embed_dim must be divisible by num_heads")),
    "module: query of the wrong embed_dim": ("m = MHA(8, 2, batch_first=True); x = t(2, 3, 8); m(t(2, 3, 6), x, x)",
                                             R("RuntimeError", r"query's last dim must be embed_dim \(8\), got 6")),
    "module: key_padding_mask of the wrong shape": (
        "m = MHA(8, 2, batch_first=True); x = t(2, 3, 8); m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))",
        R("RuntimeError", r"expecting key_padding_mask shape of \(2, 3\), but got \(2, 4\)")),
    "module: integer key_padding_mask": (
        "m = MHA(8, 2, batch_first=True); x = t(2, 3, 8); m(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.int64))",
        R("RuntimeError", r"only bool and floating types of key_padding_mask are supported, got torch.int64")),
    "module: 2-D attn_mask of the wrong shape": (
        "m = MHA(8, 2, batch_first=True); x = t(2, 3, 8); m(x, x, x, attn_mask=torch.zeros(3, 4, dtype=torch.bool))",
        R("RuntimeError", r"The shape of the 2D attn_mask is \(3, 4\), but should be \(3, 3\)")),
    "module: 3-D attn_mask of the wrong shape": (
        "m = MHA(8, 2, batch_first=True); x = t(2, 3, 8); m(x, x, x, attn_mask=torch.zeros(3, 3, 3, dtype=torch.bool))",
        R("RuntimeError", r"The shape of the 3D attn_mask is \(3, 3, 3\), but should be \(4, 3, 3\)")),
    "module: is_causal without attn_mask": ("m = MHA(8, 2, batch_first=True); x = t(2, 3, 8); m(x, x, x, is_causal=True)",
                                            R("RuntimeError", r"Need attn_mask if specifying the is_causal hint")),
    "module: key and value of different lengths": (
        "m = MHA(8, 2, batch_first=True); m(t(2, 3, 8), t(2, 4, 8), t(2, 5, 8))",
        R("RuntimeError", r"key and value must share batch and sequence dims")),
}


def run_case(name, conn):
    """Runs one case in this (forked) process and sends back what happened:
    ("ok",) or ("raised", type name, message, traceback)."""
    snippet, _ = CASES[name]
    try:
        env = {}
        exec(PRELUDE, env)
        exec(snippet, env)
        conn.send(("ok",))
    except BaseException as e:  # noqa: BLE001 - the catalogue reports every kind
        conn.send(("raised", type(e).__name__, str(e), traceback.format_exc()[-2000:]))
    finally:
        conn.close()
