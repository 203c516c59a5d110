"""Bad input gets a clear error naming the argument with expected vs got, the
same words from the C++ op (eager) and from the fake kernel (compile/export)."""
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mha_ext
from conftest import DEVICES
from cxx_runtime import insert_long_kinds


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype) if dtype.is_floating_point else torch.zeros(*shape, dtype=dtype)


Q, K, V = (2, 4, 6, 8), (2, 4, 5, 8), (2, 4, 5, 3)

# name -> (args of mha_ext::attention, expected message)
CASES = {
    "batch mismatch": ((t(*Q), t(3, 4, 5, 8), t(3, 4, 5, 3)), "key batch dims must equal query's (2), got (3)"),
    "heads mismatch": ((t(*Q), t(2, 2, 5, 8), t(2, 2, 5, 3)),
                       "key must have the same number of heads as query (4) unless enable_gqa=True, got 2"),
    "gqa not a multiple": ((t(2, 6, 6, 8), t(2, 4, 5, 8), t(2, 4, 5, 3), None, 0.0, False, None, True),
                           "query heads (6) must be a multiple of key/value heads (4) with enable_gqa=True"),
    "value length": ((t(*Q), t(*K), t(2, 4, 6, 3)), "value must have the same seq_len as key (5), got 6"),
    "value heads": ((t(*Q), t(*K), t(2, 2, 5, 3)), "value must have the same number of heads as key (4), got 2"),
    "head_dim": ((t(*Q), t(2, 4, 5, 7), t(*V)), "key must have the same head_dim as query (8), got 7"),
    "dims": ((t(*Q), t(4, 5, 8), t(4, 5, 3)), "key must have the same number of dims as query (4), got 3"),
    "mixed dtype": ((t(*Q), t(*K, dtype=torch.float64), t(*V)),
                    "key must have the same dtype as query (torch.float32), got torch.float64"),
    "integer query": ((t(*Q, dtype=torch.int64), t(*K), t(*V)),
                      "query must be a floating-point tensor (float64, float32, float16 or bfloat16), got torch.int64"),
    "integer value": ((t(*Q), t(*K), t(*V, dtype=torch.int32)),
                      "value must be a floating-point tensor (float64, float32, float16 or bfloat16), got torch.int32"),
    "2-d query": ((t(6, 8), t(5, 8), t(5, 3)),
                  "query must have at least 3 dims (..., heads, seq_len, head_dim), got shape (6, 8)"),
    "mask shape": ((t(*Q), t(*K), t(*V), t(3, 3)),
                   "attn_mask must broadcast to (N..., Hq, L, S) = (2, 4, 6, 5), got (3, 3)"),
    "mask too many dims": ((t(*Q), t(*K), t(*V), t(1, 2, 4, 6, 5)),
                           "attn_mask must broadcast to (N..., Hq, L, S) = (2, 4, 6, 5), got (1, 2, 4, 6, 5)"),
    "mask int dtype": ((t(*Q), t(*K), t(*V), t(6, 5, dtype=torch.int64)),
                       "attn_mask must be bool or query's dtype (torch.float32), got torch.int64"),
    "mask other float dtype": ((t(*Q), t(*K), t(*V), t(6, 5, dtype=torch.float64)),
                               "attn_mask must be bool or query's dtype (torch.float32), got torch.float64"),
    "dropout too big": ((t(*Q), t(*K), t(*V), None, 1.5), "dropout_p must be in [0, 1), got 1.5"),
    "dropout one": ((t(*Q), t(*K), t(*V), None, 1.0), "dropout_p must be in [0, 1), got 1"),
    "dropout negative": ((t(*Q), t(*K), t(*V), None, -0.25), "dropout_p must be in [0, 1), got -0.25"),
    "rng_state dtype": ((t(*Q), t(*K), t(*V), None, 0.1, False, None, False, torch.zeros(2, dtype=torch.int32)),
                        "rng_state must be an int64 tensor of shape (2) holding (seed, offset) or of shape (5) holding "
                        "(seed, offset, rows, row0, col0) on the CPU, got torch.int32 of shape (2) on cpu"),
    "rng_state shape": ((t(*Q), t(*K), t(*V), None, 0.1, False, None, False, torch.zeros(3, dtype=torch.int64)),
                        "rng_state must be an int64 tensor of shape (2) holding (seed, offset) or of shape (5) holding "
                        "(seed, offset, rows, row0, col0) on the CPU, got torch.int64 of shape (3) on cpu"),
}


def _message(fn):
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize("case", list(CASES))
def test_eager_and_fake_say_the_same(case):
    args, expected = CASES[case]
    eager = _message(lambda: torch.ops.mha_ext.attention(*args))
    assert eager == expected
    mode = FakeTensorMode()
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        fake = _message(lambda: torch.ops.mha_ext.attention(*fake_args))
    assert fake == expected


def test_functional_raises_the_same():
    with pytest.raises(RuntimeError, match=re.escape("attn_mask must broadcast to (N..., Hq, L, S) = (2, 4, 6, 5), got (3, 3)")):
        mha_ext.scaled_dot_product_attention(t(*Q), t(*K), t(*V), attn_mask=t(3, 3))


def test_backward_checks_its_inputs():
    q, k, v = t(*Q), t(*K), t(*V)
    out, lse, rng = torch.ops.mha_ext.attention(q, k, v)
    bad = [
        ((t(2, 4, 6, 4), q, k, v, out, lse), "grad_out must have shape (2, 4, 6, 3), got (2, 4, 6, 4)"),
        ((out, q, k, v, out, lse.double()), "logsumexp must have dtype torch.float32, got torch.float64"),
        ((out, q, k, v, out[..., :1, :], lse), "out must have shape (2, 4, 6, 3), got (2, 4, 1, 3)"),
    ]
    for args, expected in bad:
        full = args + (None, 0.0, False, None, False, rng, False)
        assert _message(lambda: torch.ops.mha_ext.attention_backward(*full)) == expected
        mode = FakeTensorMode()
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in full)
        with mode:
            assert _message(lambda: torch.ops.mha_ext.attention_backward(*fake_args)) == expected


def test_mixed_devices_fake():
    # The fake kernel's device check, with a CPU query and a meta key (the C++
    # check is the same words; it needs a second device type to run eagerly).
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    q = mode.from_tensor(t(*Q))
    k = mode.from_tensor(torch.empty(*K, device="meta"))
    v = mode.from_tensor(torch.empty(*V, device="meta"))
    with mode:
        assert _message(lambda: torch.ops.mha_ext.attention(q, k, v)) == (
            "key must be on the same device as query (cpu), got meta")


@pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)])
def test_mixed_devices(device):
    q = t(*Q).to(device)
    with pytest.raises(RuntimeError, match=re.escape("key must be on the same device as query (cuda:0), got cpu")):
        torch.ops.mha_ext.attention(q, t(*K), t(*V))


def test_module_errors():
    with pytest.raises(ValueError, match=re.escape("embed_dim must be divisible by num_heads, got embed_dim=10, num_heads=3")):
        mha_ext.MultiheadAttention(10, 3)
    m = mha_ext.MultiheadAttention(8, 2)
    x = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match=re.escape("The shape of the 2D attn_mask is (3, 3), but should be (4, 4).")):
        m(x, x, x, attn_mask=torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match=re.escape("expecting key_padding_mask shape of (2, 4), but got (2, 5)")):
        m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=re.escape("query's last dim must be embed_dim (8), got 6")):
        m(torch.randn(4, 2, 6), x, x)
    with pytest.raises(RuntimeError, match=re.escape("only bool and floating types of attn_mask are supported, got torch.int64")):
        m(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int64))


def test_integers_in_a_cpp_message_and_the_shared_cpp_runtime():
    # The C++ checks format integers with the stream code of libstdc++. A library
    # linked with a private, static copy of it (-static-libstdc++ from a toolchain
    # or LDFLAGS) cut such a message at its first integer here and crashed on a GPU
    # machine's image; setup.py names the shared runtime first. The message is
    # checked whole, and the library must take the stream code from libstdc++.so.
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(RuntimeError) as e:
        torch.ops.mha_ext.attention(q, q, q, None, 0.2, False, None, False, torch.tensor([1, 2, 9, 0, 0]))
    assert str(e.value).startswith(
        "rng_state's dropout frame (rows, row0, col0) must have row0 >= 0, col0 >= 0 and rows >= row0 + 10 "
        "(the query length), got (9, 0, 0)")
    assert insert_long_kinds(mha_ext.library_path) == ["U"]
