"""mha_ext.MultiheadAttention against torch.nn.MultiheadAttention."""
import pytest
import torch
import torch.nn as nn

import mha_ext

CONFIGS = {
    "default": dict(embed_dim=32, num_heads=4),
    "batch_first": dict(embed_dim=32, num_heads=4, batch_first=True),
    "no bias": dict(embed_dim=24, num_heads=3, bias=False),
    "bias_kv + zero_attn": dict(embed_dim=32, num_heads=2, add_bias_kv=True, add_zero_attn=True),
    "kdim/vdim": dict(embed_dim=32, num_heads=4, kdim=20, vdim=12, batch_first=True),
}


def pair(cfg, dtype=torch.float64):
    ref = nn.MultiheadAttention(**cfg, dtype=dtype)
    if cfg.get("add_bias_kv"):
        nn.init.normal_(ref.bias_k)
        nn.init.normal_(ref.bias_v)
    if cfg.get("bias", True):
        nn.init.normal_(ref.in_proj_bias, std=0.1)
    ours = mha_ext.MultiheadAttention(**cfg, dtype=dtype)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def inputs(cfg, N=3, L=7, S=9, self_attn=False, batched=True, dtype=torch.float64):
    E = cfg["embed_dim"]
    kd, vd = cfg.get("kdim") or E, cfg.get("vdim") or E
    bf = cfg.get("batch_first", False)

    def t(n, d):
        if not batched:
            return torch.randn(n, d, dtype=dtype)
        return torch.randn(N, n, d, dtype=dtype) if bf else torch.randn(n, N, d, dtype=dtype)

    if self_attn:
        x = t(L, E)
        return x, x, x
    return t(L, E), t(S, kd), t(S, vd)


def masks(kind, N, H, L, S, dtype=torch.float64):
    am = kpm = None
    if "bool2d" in kind:
        am = torch.rand(L, S) > 0.7
        am[:, 0] = False  # every query keeps a key: torch gives NaN otherwise
    if "float2d" in kind:
        am = torch.randn(L, S, dtype=dtype)
    if "bool3d" in kind:
        am = torch.rand(N * H, L, S) > 0.7
        am[..., 0] = False
    if "float3d" in kind:
        am = torch.randn(N * H, L, S, dtype=dtype)
    if "kpm_bool" in kind:
        kpm = torch.rand(N, S) > 0.6
        kpm[:, 0] = False
    if "kpm_float" in kind:
        kpm = torch.randn(N, S, dtype=dtype)
    return am, kpm


MASK_KINDS = ["none", "bool2d", "float2d", "bool3d", "float3d", "kpm_bool", "kpm_float", "bool2d+kpm_bool",
              "float2d+kpm_float"]


def check_same(ours, ref, args, kwargs):
    o_out, o_w = ours(*args, **kwargs)
    r_out, r_w = ref(*args, **kwargs)
    torch.testing.assert_close(o_out, r_out, rtol=1e-9, atol=1e-9)
    if r_w is None:
        assert o_w is None
    else:
        torch.testing.assert_close(o_w, r_w, rtol=1e-9, atol=1e-9)
    return o_out, r_out


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_matches_torch(cfg_name, mask_kind, need_weights, average):
    cfg = CONFIGS[cfg_name]
    ours, ref = pair(cfg)
    N, L, S = 3, 7, 9
    q, k, v = inputs(cfg, N, L, S)
    am, kpm = masks(mask_kind, N, cfg["num_heads"], L, S)
    check_same(ours, ref, (q, k, v), dict(key_padding_mask=kpm, attn_mask=am, need_weights=need_weights,
                                          average_attn_weights=average))


@pytest.mark.parametrize("cfg_name", ["default", "batch_first"])
def test_self_attention_gradients_match_torch(cfg_name):
    cfg = CONFIGS[cfg_name]
    ours, ref = pair(cfg)
    x = inputs(cfg, self_attn=True)[0].requires_grad_()
    am, kpm = masks("float2d+kpm_float", 3, cfg["num_heads"], 7, 7)
    o, _ = ours(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    r, _ = ref(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)
    g = torch.randn_like(o)
    go = torch.autograd.grad(o, [x] + list(ours.parameters()), g)
    gr = torch.autograd.grad(r, [x] + list(ref.parameters()), g)
    for a, b in zip(go, gr):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_weights_gradient_matches_torch():
    cfg = CONFIGS["default"]
    ours, ref = pair(cfg)
    q, k, v = inputs(cfg)
    q.requires_grad_()
    _, ow = ours(q, k, v, average_attn_weights=False)
    _, rw = ref(q, k, v, average_attn_weights=False)
    g = torch.randn_like(ow)
    torch.testing.assert_close(torch.autograd.grad(ow, q, g)[0], torch.autograd.grad(rw, q, g)[0])


@pytest.mark.parametrize("need_weights", [False, True])
def test_unbatched(need_weights):
    cfg = CONFIGS["default"]
    ours, ref = pair(cfg)
    q, k, v = inputs(cfg, batched=False)
    kpm = torch.rand(9) > 0.6
    kpm[0] = False
    am = torch.rand(cfg["num_heads"], 7, 9) > 0.8
    am[..., 0] = False
    check_same(ours, ref, (q, k, v), dict(key_padding_mask=kpm, attn_mask=am, need_weights=need_weights))


@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_hint(need_weights):
    cfg = CONFIGS["batch_first"]
    ours, ref = pair(cfg)
    x = inputs(cfg, self_attn=True)[0]
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    check_same(ours, ref, (x, x, x), dict(attn_mask=causal, is_causal=True, need_weights=need_weights))
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ours(x, x, x, is_causal=True)


def test_fully_masked_query_gives_zero_not_nan():
    cfg = CONFIGS["batch_first"]
    ours, ref = pair(cfg)
    q, k, v = inputs(cfg)
    kpm = torch.zeros(3, 9, dtype=torch.bool)
    kpm[1] = True  # batch 1 sees no key
    out, w = ours(q, k, v, key_padding_mask=kpm)
    r_out, _ = ref(q, k, v, key_padding_mask=kpm)
    assert torch.isnan(r_out[1]).all()  # torch's convention
    assert torch.isfinite(out).all() and torch.all(w[1] == 0)
    # the output of a query with no key is out_proj(0) = out_proj.bias
    torch.testing.assert_close(out[1], ours.out_proj.bias.expand(7, -1))
    torch.testing.assert_close(out[[0, 2]], r_out[[0, 2]])


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_state_dict_round_trip(cfg_name):
    cfg = CONFIGS[cfg_name]
    ours, ref = pair(cfg)
    assert list(ours.state_dict()) == list(ref.state_dict())
    back = nn.MultiheadAttention(**cfg, dtype=torch.float64)
    back.load_state_dict(ours.state_dict(), strict=True)
    for (n1, a), (n2, b) in zip(back.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


@pytest.mark.parametrize("layer_cls", ["encoder", "decoder"])
def test_inside_transformer_layers(layer_cls):
    torch.manual_seed(1)
    if layer_cls == "encoder":
        ref = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True, dtype=torch.float64)
    else:
        ref = nn.TransformerDecoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True, dtype=torch.float64)
    ours = __import__("copy").deepcopy(ref)
    for name in ("self_attn", "multihead_attn"):
        if hasattr(ref, name):
            old = getattr(ref, name)
            new = mha_ext.MultiheadAttention(32, 4, dropout=0.0, batch_first=True, dtype=torch.float64)
            new.load_state_dict(old.state_dict())
            setattr(ours, name, new)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 7, 32, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, 5, 32, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    args = (x, mask) if layer_cls == "encoder" else (x, mem, mask)
    kw = {"is_causal": True} if layer_cls == "encoder" else {"tgt_is_causal": True}
    o, r = ours(*args, **kw), ref(*args, **kw)
    torch.testing.assert_close(o, r)
    g = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, [x] + list(ours.parameters()), g),
                    torch.autograd.grad(r, [x] + list(ref.parameters()), g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cfg_name", ["default", "bias_kv + zero_attn", "kdim/vdim"])
def test_gradcheck_module(cfg_name):
    cfg = dict(CONFIGS[cfg_name])
    cfg.update(embed_dim=8, num_heads=2)
    if "kdim" in cfg:
        cfg.update(kdim=6, vdim=4)
    ours, _ = pair(cfg)
    q, k, v = (t.requires_grad_() for t in inputs(cfg, N=2, L=3, S=4))
    am = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, am: ours(q, k, v, attn_mask=am, need_weights=False)[0],
                                    (q, k, v, am))


def test_gradcheck_module_with_dropout_fixed_seed():
    cfg = dict(embed_dim=8, num_heads=2, dropout=0.3, batch_first=True)
    ours, _ = pair(cfg)
    ours.train()
    q, k, v = (t.requires_grad_() for t in inputs(cfg, N=2, L=3, S=4))

    def f(q, k, v):
        torch.manual_seed(11)
        return ours(q, k, v, need_weights=False)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_only_in_training_and_weights_consistent():
    cfg = dict(embed_dim=16, num_heads=2, dropout=0.5, batch_first=True)
    ours, ref = pair(cfg)
    q, k, v = inputs(cfg)
    ours.eval()
    ref.eval()
    check_same(ours, ref, (q, k, v), {})
    ours.train()
    out, w = ours(q, k, v, average_attn_weights=False)
    assert (w == 0).any()  # some weights dropped
    # the output is exactly what the returned (dropped) weights give
    vh = nn.functional.linear(v, ours.in_proj_weight[32:], ours.in_proj_bias[32:]).unflatten(-1, (2, 8)).transpose(1, 2)
    recon = ours.out_proj((w @ vh).transpose(1, 2).flatten(-2))
    torch.testing.assert_close(out, recon)


@pytest.mark.parametrize("cfg_name", ["batch_first", "kdim/vdim", "bias_kv + zero_attn"])
def test_gradgradcheck_module(cfg_name):
    cfg = dict(CONFIGS[cfg_name])
    cfg.update(embed_dim=4, num_heads=2)
    if "kdim" in cfg:
        cfg.update(kdim=3, vdim=2)
    ours, _ = pair(cfg)
    q, k, v = (t.requires_grad_() for t in inputs(cfg, N=1, L=2, S=3))
    kpm = torch.tensor([[False, False, True]])
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: ours(q, k, v, key_padding_mask=kpm, need_weights=False)[0], (q, k, v))
