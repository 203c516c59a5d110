"""mha_ext._C's fast calls: the attention op called from C++ below autograd,
skipping torch.ops's boxing, for the plain call (plain tensors, no torch
function mode, nothing for autograd to record); everything else declines
(None) and goes through torch.ops. Each fast result is checked against the
float64 reference and against the same call through torch.ops; each declined
case, that the public function still gives the reference's answer and that
what the fast call skips (autograd, __torch_function__) happened."""
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import mha_ext
import reference as R
from mha_ext import _C

torch.manual_seed(0)


def qkv(hq=4, hkv=2, L=3, S=37, E=16, dtype=torch.float32, requires_grad=False):
    return (torch.randn(2, hq, L, E, dtype=dtype, requires_grad=requires_grad),
            torch.randn(2, hkv, S, E, dtype=dtype, requires_grad=requires_grad),
            torch.randn(2, hkv, S, E, dtype=dtype, requires_grad=requires_grad))


def test_plain_sdpa_call_is_fast_and_right():
    q, k, v = qkv()
    mask = torch.rand(3, 37) > 0.3
    out = _C.sdpa(q, k, v, mask, 0.0, False, 0.3, True)
    assert isinstance(out, torch.Tensor)
    ref = R.attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mha_ext.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True), out,
                               rtol=0, atol=0)


@pytest.mark.parametrize("nargs", [3, 9, 14])
def test_plain_attention_call_is_fast_and_equals_torch_ops(nargs):
    q, k, v = qkv(hq=2, hkv=2, L=5, S=40)
    slopes = torch.tensor([0.25, 0.5])
    args = (q, k, v, None, 0.0, True, None, False, None, 7, 0, True, 4.0, slopes)[:nargs]
    fast = _C.attention(*args)
    assert isinstance(fast, tuple) and len(fast) == 3
    slow = torch.ops.mha_ext.attention.default(*args)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    kw = {} if nargs < 14 else dict(window=(7, 0), bottom_right=True, softcap=4.0, alibi_slopes=slopes)
    ref = R.attention(q, k, v, is_causal=nargs > 5, **kw)
    torch.testing.assert_close(fast[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_grad_mode_decides():
    q, k, v = qkv(requires_grad=True)
    assert _C.sdpa(q, k, v, None, 0.0, False, None, True) is None
    assert _C.attention(q, k, v) is None
    out = mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out.grad_fn is not None  # through torch.ops and its autograd
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        fast = _C.sdpa(q, k, v, None, 0.0, False, None, True)
        assert fast is not None and fast.grad_fn is None
        torch.testing.assert_close(fast, out.detach(), rtol=0, atol=0)


def test_slopes_that_require_grad_go_through_autograd():
    # slopes alone requiring grad: autograd's kernel refuses them (they are constants)
    q, k, v = qkv(hq=2, hkv=2)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    assert _C.attention(q, k, v, None, 0.0, False, None, False, None, -1, -1, False, 0.0, slopes) is None
    with pytest.raises(RuntimeError, match="alibi_slopes must not require grad"):
        mha_ext.attention(q, k, v, alibi_slopes=slopes)
    with torch.no_grad():
        out = mha_ext.attention(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(out.double(), R.attention(q, k, v, alibi_slopes=slopes.detach()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["int dropout_p", "int scale", "dropout", "broadcast batch", "3-D key", "GQA off"])
def test_declined_calls_still_right(case):
    q, k, v = qkv()
    kw = dict(enable_gqa=True)
    if case == "int dropout_p":
        kw["dropout_p"] = 0
    elif case == "int scale":
        kw["scale"] = 1
    elif case == "dropout":
        kw["dropout_p"] = 0.5
    elif case == "broadcast batch":
        k, v = k[:1], v[:1]
    elif case == "3-D key":
        k, v = k[0], v[0]
    else:
        kw["enable_gqa"] = False
        k, v = k[:, :1], v[:, :1]  # one key head broadcasts to the four query heads, as in torch
    args = (q, k, v, None, float(kw.get("dropout_p", 0.0)) if case != "int dropout_p" else 0, False,
            kw.get("scale"), kw["enable_gqa"])
    assert _C.sdpa(*args) is None
    out = mha_ext.scaled_dot_product_attention(q, k, v, **kw)
    if case == "dropout":
        assert out.shape == (2, 4, 3, 16) and torch.isfinite(out).all()
        return
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


class Tagged(torch.Tensor):
    """A tensor subclass whose __torch_function__ records what it saw."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclass_goes_through_torch_function():
    q, k, v = qkv(hq=2)
    qt = q.as_subclass(Tagged)
    assert _C.sdpa(qt, k, v, None, 0.0, False, None, True) is None
    assert _C.attention(qt, k, v) is None
    Tagged.seen.clear()
    out = mha_ext.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
    assert any("attention" in name for name in Tagged.seen), Tagged.seen
    torch.testing.assert_close(out.as_subclass(torch.Tensor), F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               rtol=1e-5, atol=1e-5)


def test_torch_function_mode_sees_the_op():
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = qkv(hq=2)
    with Record():
        assert _C.sdpa(q, k, v, None, 0.0, False, None, True) is None
        out = mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert any("mha_ext.attention" in s for s in seen), seen
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=1e-5, atol=1e-5)


def test_torch_dispatch_mode_sees_the_fast_call():
    # the fast call goes through the dispatcher, so dispatch modes (profilers,
    # FLOP counters, fake tensors) see the op as they did through torch.ops
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = qkv(hq=2)
    with Record():
        out = _C.sdpa(q, k, v, None, 0.0, False, None, True)
    assert out is not None and "mha_ext.attention.default" in seen, seen
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=1e-5, atol=1e-5)


def test_errors_read_as_through_torch_ops():
    q, k, v = qkv()
    bad_v = v[..., :5, :]  # value's length differs from key's
    with pytest.raises(RuntimeError) as fast:
        _C.sdpa(q, k, bad_v, None, 0.0, False, None, True)
    with pytest.raises(RuntimeError) as slow:
        torch.ops.mha_ext.attention.default(q, k, bad_v, None, 0.0, False, None, True)
    assert str(fast.value) == str(slow.value) and "value" in str(fast.value)
    with pytest.raises(RuntimeError) as public:
        mha_ext.scaled_dot_product_attention(q, k, bad_v, enable_gqa=True)
    assert str(public.value) == str(slow.value)


def test_the_gil_is_released_during_the_op():
    # Another Python thread runs while the op computes, as with torch.ops.
    # Holding the GIL, the op would let it run only in the 5 ms switch
    # intervals after the call (the count then covers about 5 ms of spinning);
    # released, the count covers most of the call. One op thread, so the
    # spinning thread has a core of its own on a 2-core machine. The call
    # must outlast the switch interval many times over: 1024 x 8192 a head,
    # four times the work of 512 x 4096, which took 47 ms once on an Intel
    # Xeon with AMX (one thread), under the 50 ms the check below needs.
    q, k, v = torch.randn(1, 8, 1024, 64), torch.randn(1, 8, 8192, 64), torch.randn(1, 8, 8192, 64)
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t = threading.Thread(target=spin)
    t.start()
    try:
        before, t0 = count[0], time.perf_counter()
        time.sleep(0.05)  # releases the GIL: the spinning thread's rate
        rate = (count[0] - before) / (time.perf_counter() - t0)
        before, t0 = count[0], time.perf_counter()
        out = _C.sdpa(q, k, v, None, 0.0, False, None, False)
        during, took = count[0] - before, time.perf_counter() - t0
    finally:
        stop.set()
        t.join()
        torch.set_num_threads(threads)
    assert out is not None
    assert took > 0.05, took
    assert during > rate * 0.025, (during, rate, took)


def test_kvcache_fast_call_equals_torch_ops_and_writes_in_place():
    B, S_max, hq, hkv, E = 2, 40, 4, 2, 16
    q = torch.randn(B, 1, hq, E)
    kc, vc = torch.randn(B, S_max, hkv, E), torch.randn(B, S_max, hkv, E)
    sl = torch.tensor([5, 17], dtype=torch.int32)
    kn, vn = torch.randn(B, 1, hkv, E), torch.randn(B, 1, hkv, E)
    kc2, vc2 = kc.clone(), vc.clone()
    v0 = kc._version
    fast = _C.kvcache_attention(q, kc, vc, sl, kn, vn, None, True, -1, -1, 0.0, None, None)
    assert isinstance(fast, tuple) and kc._version > v0  # the in-place write is seen by autograd's checks
    slow = torch.ops.mha_ext.kvcache_attention.default(q, kc2, vc2, sl, kn, vn, None, True, -1, -1, 0.0, None, None)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    for b in range(B):  # the new row written at cache_seqlens[b], attended with the cached ones
        n = int(sl[b]) + 1
        assert torch.equal(kc[b, n - 1], kn[b, 0]) and torch.equal(vc[b, n - 1], vn[b, 0])
        ref = R.attention(q[b].transpose(0, 1), kc[b, :n].transpose(0, 1), vc[b, :n].transpose(0, 1), enable_gqa=True)
        torch.testing.assert_close(fast[0][b].transpose(0, 1).double(), ref, rtol=1e-5, atol=1e-5)
    assert _C.kvcache_attention(q.as_subclass(Tagged), kc, vc, sl, None, None, None, True, -1, -1, 0.0, None,
                                None) is None
    assert _C.kvcache_attention(q, kc, vc, sl, None, None, None, True, -1, -1, 0, None, None) is None  # int softcap


class Counting:
    """Stands in for mha_ext._C in a module's globals: counts the fast calls
    made, and makes them."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            res = getattr(_C, name)(*args)
            self.calls.append((name, res is not None))
            return res
        return call


def test_public_functions_take_the_fast_calls(monkeypatch):
    counting = Counting()
    monkeypatch.setattr(mha_ext.ops, "_C", counting)
    monkeypatch.setattr(mha_ext.kvcache, "_C", counting)
    q, k, v = qkv()
    mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    mha_ext.attention(q, k, v, enable_gqa=True, window=(4, 0))
    mha = mha_ext.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        mha(x, x, x, need_weights=False)
    kc, vc = torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    mha_ext.kvcache_attention(q.transpose(1, 2), kc, vc, torch.tensor([3, 9], dtype=torch.int32), causal=True)
    assert counting.calls == [("sdpa", True), ("attention", True), ("attention", True), ("kvcache_attention", True)]
