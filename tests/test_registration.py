"""The ops are honestly registered: opcheck, torch.compile(fullgraph=True),
torch.export, and a C++-first load finding the Python fakes."""
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import mha_ext


def _args(dtype=torch.float64, rg=True):
    q = torch.randn(2, 4, 6, 8, dtype=dtype, requires_grad=rg)
    k = torch.randn(2, 2, 5, 8, dtype=dtype, requires_grad=rg)
    v = torch.randn(2, 2, 5, 3, dtype=dtype, requires_grad=rg)
    return q, k, v


ATTENTION_CASES = {
    "plain": lambda: (*_args(), None, 0.0, False, None, True, None),
    "causal + float mask with grad": lambda: (*_args(), torch.randn(6, 5, dtype=torch.float64, requires_grad=True),
                                              0.0, True, 0.5, True, None),
    "bool mask + dropout": lambda: (*_args(), torch.rand(2, 1, 6, 5) > 0.3, 0.2, False, None, True,
                                    torch.tensor([5, 9], dtype=torch.int64)),
    "float32": lambda: (*_args(torch.float32), None, 0.0, True, None, True, None),
    "dropout frame": lambda: (*_args(), None, 0.3, True, None, True, torch.tensor([5, 9, 20, 3, 5])),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_opcheck_attention(case):
    torch.library.opcheck(torch.ops.mha_ext.attention.default, ATTENTION_CASES[case]())


@pytest.mark.parametrize("mask_grad", [False, True])
def test_opcheck_attention_backward(mask_grad):
    q, k, v = _args(rg=False)
    m = torch.randn(6, 5, dtype=torch.float64)
    rng = torch.tensor([1, 2], dtype=torch.int64)
    out, lse, _ = torch.ops.mha_ext.attention(q, k, v, m, 0.1, True, None, True, rng)
    g = torch.randn_like(out)
    torch.library.opcheck(torch.ops.mha_ext.attention_backward.default,
                          (g, q, k, v, out, lse, m, 0.1, True, None, True, rng, mask_grad))


def test_opcheck_dropout_mask():
    torch.library.opcheck(torch.ops.mha_ext.dropout_mask.default,
                          (torch.tensor([3, 4], dtype=torch.int64), [2, 3, 4, 5], 0.5))
    torch.library.opcheck(torch.ops.mha_ext.dropout_mask.default,
                          (torch.tensor([3, 4, 9, 2, 7], dtype=torch.int64), [2, 3, 4, 5], 0.5))


class TinyLM(nn.Module):
    def __init__(self, mha_cls):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.attn = mha_cls(32, 4, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, idx):
        x = self.emb(idx)
        L = idx.shape[1]
        mask = torch.ones(L, L, dtype=torch.bool).triu(1)
        y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(x + y)


def test_compile_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    model = TinyLM(mha_ext.MultiheadAttention)
    idx = torch.randint(0, 50, (2, 12))
    eager = model(idx)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(idx)
    torch.testing.assert_close(out, eager)
    out.sum().backward()
    g_compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager.sum().backward()
    for a, p in zip(g_compiled, model.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_compile_inductor_functional():
    def f(q, k, v):
        return mha_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    q, k, v = _args(torch.float32, rg=False)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


def test_export():
    torch.manual_seed(0)
    model = TinyLM(mha_ext.MultiheadAttention).eval()
    idx = torch.randint(0, 50, (2, 12))
    ep = torch.export.export(model, (idx,))
    assert any("mha_ext.attention" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(idx), model(idx))


def test_cpp_first_load_names_the_python_module_of_the_fakes():
    # Load only the shared library (no `import mha_ext`): the op names the module
    # holding its fake kernel and autograd (set_python_module); importing that
    # module makes fake tensors work.
    code = (
        "import torch, glob, os, importlib, importlib.util;"
        "d = os.path.dirname(importlib.util.find_spec('mha_ext').origin);"
        "torch.ops.load_library(glob.glob(os.path.join(d, '_C*.so'))[0]);"
        "mod = torch._C._dispatch_pystub('mha_ext::attention', '')[0];"
        "importlib.import_module(mod);"
        "from torch._subclasses.fake_tensor import FakeTensorMode;"
        "m = FakeTensorMode();"
        "q = m.from_tensor(torch.randn(2, 3, 4, 8));"
        "out, lse, _ = torch.ops.mha_ext.attention(q, q, q);"
        "print(mod, tuple(out.shape), tuple(lse.shape))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "mha_ext.ops (2, 3, 4, 8) (2, 3, 4)"
