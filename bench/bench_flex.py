"""The attention variants of real models, mha_ext against FlexAttention
(torch.nn.attention.flex_attention, compiled, with a block mask) and against
what torch users run without it (SDPA: is_causal, or the variant as a
materialised mask or bias; eager ops for the softcap, which SDPA cannot
express), in one process, interleaved, medians.

    python bench/bench_flex.py            # L = 1024, 4096 (a few minutes, most of it compiling)
    python bench/bench_flex.py --quick    # L = 1024
    python bench/bench_flex.py --dry-run  # tiny sizes (checks the script)
    python bench/bench_flex.py --decode   # one query row against a long KV cache instead

Cases (Hq = 8 query heads on Hkv = 2, head dim 64, batch 1): causal; a
sliding window of L / 8 keys, causal (Mistral); softcap 50, causal (Gemma 2);
ALiBi, causal (BLOOM, MPT); documents packed in one row of L tokens, causal
within each (lengths uniform in 25-100% of L / 4: mha_ext.varlen_attention on
the packed rows; FlexAttention's document mask; SDPA's bool mask). Forward,
and forward + backward where the library has one (FlexAttention has no
backward on the CPU: its column says so). On a CUDA GPU (--device cuda) the
same cases, float16 / bfloat16. Writes bench/out/flex.md and prints it.
"""
import argparse
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
from bench_attention import cpu_name, geomean, gpu_times, median_times, table, write_report  # noqa: E402

HQ, HKV, E = 8, 2, 64
SOFTCAP = 50.0


def alibi_slopes(h):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])


def documents(L, gen):
    """Lengths uniform in 25-100% of L / 4, the last cut to fill L."""
    lens, total = [], 0
    while total < L:
        n = min(int(torch.randint(L // 16, L // 4 + 1, (1,), generator=gen)), L - total)
        lens.append(n)
        total += n
    return lens


def case_fns(name, L, dtype, device, backward, gen):
    """(mha_ext fn, FlexAttention fn, torch fn, torch's label) for one case."""
    q = torch.randn(1, HQ, L, E, generator=gen).to(device, dtype)
    k = torch.randn(1, HKV, L, E, generator=gen).to(device, dtype)
    v = torch.randn(1, HKV, L, E, generator=gen).to(device, dtype)
    for t in (q, k, v):
        t.requires_grad_(backward)
    g = torch.randn(1, HQ, L, E, generator=gen).to(device, dtype)
    i = torch.arange(L, device=device)
    window = L // 8
    slopes = alibi_slopes(HQ).to(device)
    kw, score_mod = dict(causal=True), None
    visible = i[:, None] >= i[None, :]  # the torch column's mask: causal, and what each case adds
    bias = None
    if name == "causal":
        mask_mod = lambda b, h, qi, kv: qi >= kv  # noqa: E731
    elif name == "sliding window":
        kw["window"] = (window, 0)
        mask_mod = lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= window)  # noqa: E731
        visible = visible & (i[:, None] - i[None, :] <= window)
    elif name == "softcap":
        kw["softcap"] = SOFTCAP
        mask_mod = lambda b, h, qi, kv: qi >= kv  # noqa: E731
        score_mod = lambda s, b, h, qi, kv: SOFTCAP * torch.tanh(s / SOFTCAP)  # noqa: E731
    elif name == "alibi":
        kw["alibi_slopes"] = slopes
        mask_mod = lambda b, h, qi, kv: qi >= kv  # noqa: E731
        score_mod = lambda s, b, h, qi, kv: s - slopes[h] * (qi - kv).abs()  # noqa: E731
        bias = -(slopes.view(HQ, 1, 1) * (i[:, None] - i[None, :]).abs()).to(dtype)
    elif name == "documents":
        lens = documents(L, gen)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
        mask_mod = lambda b, h, qi, kv: (qi >= kv) & (doc[qi] == doc[kv])  # noqa: E731
        visible = visible & (doc[:, None] == doc[None, :])
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    block_mask = create_block_mask(mask_mod, None, None, L, L, device=device)
    flex = torch.compile(flex_attention, dynamic=False)

    def mha():
        if name == "documents":  # packed rows: (total, H, E)
            pq, pk, pv = (t[0].transpose(0, 1) for t in (q, k, v))
            return mha_ext.varlen_attention(pq, pk, pv, cu, cu, max(lens), max(lens), causal=True,
                                            alignment="top_left").transpose(0, 1).unsqueeze(0)
        return mha_ext.attention(q, k, v, enable_gqa=True, alignment="top_left", **kw)

    def fx():
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

    if name == "softcap":  # no SDPA form: the eager ops (transformers' eager attention)
        label = "eager ops"

        def ref():
            kk, vv = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
            s = q @ kk.transpose(-1, -2) / math.sqrt(E)
            s = SOFTCAP * torch.tanh(s / SOFTCAP)
            return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ vv
    elif name == "causal":
        label = "SDPA, is_causal"

        def ref():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        label = "SDPA, mask"
        m = visible if bias is None else bias.masked_fill(~visible, float("-inf"))

        def ref():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    def step(f):
        if not backward:
            return lambda: f()
        return lambda: torch.autograd.backward(f(), g)

    return step(mha), step(fx), step(ref), label, (mha, fx, ref)


def decode_table(args, device):
    """Decoding: one query row (B = 1, 32 query heads on 8, head dim 128)
    against 2k-32k keys, forward, mha_ext against FlexAttention compiled
    (no block mask: every key visible) and SDPA."""
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cpu" else [torch.float16, torch.bfloat16]
    times = (lambda fns, r: gpu_times(fns, r, device)) if device.type == "cuda" else median_times
    lengths = [256] if args.dry_run else [2048, 8192, 32768]
    reps = 2 if args.dry_run else 15
    torch._dynamo.config.cache_size_limit = 256
    rows, vs_flex = [], []
    for dtype in dtypes:
        for S in lengths:
            q = torch.randn(1, 32, 1, 128, dtype=dtype, device=device)
            k, v = (torch.randn(1, 8, S, 128, dtype=dtype, device=device) for _ in range(2))
            flex = torch.compile(flex_attention, dynamic=False)
            fns = [lambda: mha_ext.attention(q, k, v, enable_gqa=True), lambda: flex(q, k, v, enable_gqa=True),
                   lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)]
            diff = (fns[0]().float() - fns[1]().float()).abs().max().item()
            tm, tf, tr = times(fns, reps)
            vs_flex.append(tf / tm)
            rows.append([str(dtype).replace("torch.", ""), S, f"{tm * 1e3:.3f}", f"{tf * 1e3:.3f}", f"{tr * 1e3:.3f}",
                         f"{tf / tm:.2f}", f"{tr / tm:.2f}", f"{diff:.1e}"])
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
            torch._dynamo.reset()
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    lines = [f"# Decoding: mha_ext against FlexAttention and SDPA, {datetime.date.today()}", "",
             f"{where}, torch {torch.__version__}; `python bench/bench_flex.py {' '.join(sys.argv[1:])}`; medians "
             f"of {reps} interleaved runs; one query row, 32 query heads on 8 key/value heads, head dim 128, batch "
             "1. FlexAttention compiled (dynamic=False), its compile time not counted.", "",
             table(["dtype", "S", "mha_ext ms", "FlexAttention ms", "SDPA ms", "Flex / mha_ext", "SDPA / mha_ext",
                    "max |mha_ext - Flex|"], rows), "",
             f"FlexAttention / mha_ext: {min(vs_flex):.2f}-{max(vs_flex):.2f} (geomean {geomean(vs_flex):.2f})."]
    write_report("flex-decode.md", lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes (checks the script)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--decode", action="store_true", help="one query row against 2k-32k keys (32 / 8 x 128 heads)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.decode:
        return decode_table(args, device)
    lengths = [256] if args.dry_run else [1024] if args.quick else [1024, 4096]
    reps = 2 if args.dry_run else args.reps
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cpu" else [torch.float16, torch.bfloat16]
    times = (lambda fns, r: gpu_times(fns, r, device)) if device.type == "cuda" else median_times
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    path = mha_ext.ops.cpu_isa() if device.type == "cpu" else "cuda"
    torch._dynamo.config.cache_size_limit = 256
    gen = torch.Generator().manual_seed(0)
    headers = ["dtype", "L", "case", "pass", "mha_ext ms", "FlexAttention ms", "torch ms", "torch is",
               "Flex / mha_ext", "torch / mha_ext", "max |mha_ext - Flex|"]
    rows, vs_flex, vs_torch = [], [], []
    for dtype in dtypes:
        for L in lengths:
            for name in ["causal", "sliding window", "softcap", "alibi", "documents"]:
                for backward in (False, True):
                    fm, ff, fr, label, raw = case_fns(name, L, dtype, device, backward, gen)
                    diff = "" if backward else f"{(raw[0]().float() - raw[1]().float()).abs().max().item():.1e}"
                    fns, flex_ok = [fm, fr], True
                    try:
                        ff()
                        fns.append(ff)
                    except NotImplementedError:  # FlexAttention's backward on the CPU
                        flex_ok = False
                    t = times(fns, reps)
                    tm, tr = t[0], t[1]
                    tf = t[2] if flex_ok else None
                    if tf is not None:
                        vs_flex.append(tf / tm)
                    vs_torch.append(tr / tm)
                    rows.append([str(dtype).replace("torch.", ""), L, name, "fwd+bwd" if backward else "fwd",
                                 f"{tm * 1e3:.2f}", f"{tf * 1e3:.2f}" if tf else "no backward here",
                                 f"{tr * 1e3:.2f}", label, f"{tf / tm:.2f}" if tf else "", f"{tr / tm:.2f}",
                                 diff])
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
                    torch._dynamo.reset()
    lines = [f"# Attention variants: mha_ext against FlexAttention and torch, {datetime.date.today()}", "",
             f"{where}, torch {torch.__version__}, mha_ext path {path}; "
             f"`python bench/bench_flex.py {' '.join(sys.argv[1:])}`; medians of {reps} interleaved runs; "
             f"{HQ} query heads on {HKV} key/value heads, head dim {E}, batch 1. FlexAttention compiled "
             "(torch.compile, dynamic=False) with its block mask; its compile time is not counted. "
             "The last column compares the two forward outputs.", "",
             table(headers, rows), "",
             f"Geometric mean of FlexAttention / mha_ext: {geomean(vs_flex):.2f} over {len(vs_flex)} cases "
             f"(lowest {min(vs_flex) if vs_flex else float('nan'):.2f}); torch / mha_ext: {geomean(vs_torch):.2f} "
             f"(lowest {min(vs_torch):.2f})."]
    write_report("flex.md", lines)


if __name__ == "__main__":
    main()
