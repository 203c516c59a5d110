"""Decoding: one (or a few) query rows against a long key/value cache,
mha_ext against F.scaled_dot_product_attention, in one process, interleaved,
medians; K/V bytes read per second beside a streaming-read bandwidth measured
in the same run (a sum over a 1 GiB float32 tensor) and, for S >= 8k, a
streaming read interleaved with each case's runs (this VM's bandwidth moves
by up to 2x within minutes, so the share of it is taken rep by rep).

    python bench/bench_decode.py            # the grid of issue 12 (a few minutes)
    python bench/bench_decode.py --quick
    python bench/bench_decode.py --layers 12   # whole decode steps of a 12-layer model instead
    python bench/bench_decode.py --queries 8,16   # steps of several query rows (speculative, chunked)
    python bench/bench_decode.py --dense --queries 4,8,16   # the kernel mha_ext picks against the dense one

Writes markdown to bench/out/decode.md (decode-layers.md with --layers) and
prints it. With --layers N each case is a decode step of a model of N layers:
one call a layer, each layer its own K/V, the two libraries' steps
interleaved. Between two calls of a layer the other layers' K/V pass through
the caches, as in a model (where its weights pass too), so a layer's K/V come
from the caches only where all the layers' fit.
"""
import argparse
import datetime
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
from bench_attention import cpu_name, median_times, write_report  # noqa: E402


def stream_gbs(reps=5):
    x = torch.ones(256 * 1024 * 1024)  # 1 GiB
    t = median_times([lambda: x.sum()], reps)[0]
    return x.numel() * 4 / t / 1e9


STREAM = None  # 512 MiB of float32 for the interleaved streaming read


def stream_read():
    global STREAM
    if STREAM is None:
        STREAM = torch.ones(128 * 1024 * 1024)
    return STREAM.sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--layers", type=int, default=0, help="time decode steps over this many layers' caches")
    ap.add_argument("--queries", default="1,4", help="query rows a call (e.g. 8,16: multi-token steps)")
    ap.add_argument("--dense", action="store_true",
                    help="the decode kernel against the dense one (MHA_EXT_CPU_DECODE=off) on the same calls")
    args = ap.parse_args()
    if args.layers > 0:
        return layers_table(args)
    if args.dense:
        return dense_table(args)
    batches = [1, 4] if args.quick else [1, 4, 8]
    lengths = [2048, 8192] if args.quick else [2048, 8192, 32768]
    shapes = [(32, 8, 128), (12, 12, 64)]
    bw = stream_gbs()
    lines = [f"# Decode: mha_ext vs F.scaled_dot_product_attention, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, mha_ext CPU path "
             f"{mha_ext.ops.cpu_isa()}; `python bench/bench_decode.py {' '.join(sys.argv[1:])}`; medians of "
             f"{args.reps} interleaved runs or more (a short call as many as take 0.3 s of mha_ext's time, up "
             f"to 101). Streaming read (sum of 1 GiB float32): {bw:.1f} GB/s. "
             "K/V GB/s = bytes of K and V / time. At S >= 8k, stream GB/s is a sum over 512 MiB of float32 run "
             "between the two in each rep (its median), and % of it is mha_ext's K/V GB/s over it.", "",
             "| dtype | B | Hq, Hkv, D | S | L | mha_ext ms | torch ms | torch / mha_ext | mha_ext K/V GB/s | "
             "torch K/V GB/s | stream GB/s | mha_ext % of stream |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, shares = [], []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for B in batches:
            for hq, hkv, D in shapes:
                for S in lengths:
                    for L in (int(x) for x in args.queries.split(",")):
                        q = torch.randn(B, hq, L, D, dtype=dtype)
                        k = torch.randn(B, hkv, S, D, dtype=dtype)
                        v = torch.randn(B, hkv, S, D, dtype=dtype)
                        gqa = hq != hkv
                        fns = [lambda: mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
                               lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)]
                        if S >= 8192:
                            fns.append(stream_read)
                        # short calls (tens of microseconds) move most from run to run:
                        # as many runs as take about 0.3 s of mha_ext's time, up to 101
                        t_one = median_times(fns[:1], 3, warmup=1)[0]
                        reps = max(args.reps, min(101, int(0.3 / max(t_one, 1e-6))))
                        ta, tb, *ts = median_times(fns, reps)
                        kv = 2 * k.numel() * k.element_size()
                        ratios.append(tb / ta)
                        share = ""
                        if ts:
                            sb = STREAM.numel() * 4 / ts[0] / 1e9
                            share = f" {sb:.1f} | {100 * kv / ta / 1e9 / sb:.0f}% |"
                            shares.append(kv / ta / 1e9 / sb)
                        else:
                            share = " | |"
                        lines.append(f"| {name} | {B} | {hq}, {hkv}, {D} | {S} | {L} | {ta * 1e3:.3f} | {tb * 1e3:.3f} | "
                                     f"{tb / ta:.2f} | {kv / ta / 1e9:.1f} | {kv / tb / 1e9:.1f} |{share}")
                        print(lines[-1], flush=True)
                        del q, k, v
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    lines += ["", f"Geometric mean of torch / mha_ext over the table: {geo:.2f}; lowest {min(ratios):.2f}."]
    if shares:
        lines.append(f"At S >= 8k, mha_ext's K/V read as a share of the interleaved streaming read: "
                     f"{100 * min(shares):.0f}-{100 * max(shares):.0f}%, {sum(s >= 0.8 for s in shares)} of "
                     f"{len(shares)} cases at 80% or more.")
    write_report("decode.md", lines)


def dense_table(args):
    """mha_ext's default choice of CPU kernel against MHA_EXT_CPU_DECODE=off
    (the dense kernel for every call), interleaved, causal bottom-right."""
    lines = [f"# Decode: the decode kernel against the dense kernel, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, mha_ext CPU path "
             f"{mha_ext.ops.cpu_isa()}; `python bench/bench_decode.py {' '.join(sys.argv[1:])}`; medians of "
             f"{args.reps} interleaved runs; auto = the kernel mha_ext picks, dense = MHA_EXT_CPU_DECODE=off.", "",
             "| dtype | B | Hq, Hkv, D | S | L | rows a key/value head | auto ms | dense ms | dense / auto |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for B in ([1] if args.quick else [1, 4]):
            for hq, hkv, D in [(32, 8, 128), (12, 12, 64)]:
                for S in ([512, 4096] if args.quick else [512, 4096, 32768]):
                    for L in (int(x) for x in args.queries.split(",")):
                        q = torch.randn(B, hq, L, D, dtype=dtype)
                        k, v = (torch.randn(B, hkv, S, D, dtype=dtype) for _ in range(2))
                        call = lambda: mha_ext.attention(q, k, v, causal=True, alignment="bottom_right",  # noqa: E731
                                                         enable_gqa=hq != hkv)

                        def mode(i):
                            os.environ["MHA_EXT_CPU_DECODE"] = ("auto", "off")[i]

                        try:
                            ta, td = median_times([call, call], args.reps, before=mode)
                        finally:
                            os.environ.pop("MHA_EXT_CPU_DECODE", None)
                        ratios.append(td / ta)
                        lines.append(f"| {name} | {B} | {hq}, {hkv}, {D} | {S} | {L} | {L * hq // hkv} | "
                                     f"{ta * 1e3:.3f} | {td * 1e3:.3f} | {td / ta:.2f} |")
                        print(lines[-1], flush=True)
    lines += ["", f"dense / auto: {min(ratios):.2f}-{max(ratios):.2f}."]
    write_report("decode-dense.md", lines)


def layers_table(args):
    n = args.layers
    lines = [f"# Decode steps of {n} layers: mha_ext vs F.scaled_dot_product_attention, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, mha_ext CPU path "
             f"{mha_ext.ops.cpu_isa()}; `python bench/bench_decode.py {' '.join(sys.argv[1:])}`; B = 1, one query "
             f"row; a step is one call for each of {n} layers, each layer its own K/V; medians of {args.reps} "
             "interleaved steps or more (as many as take 0.5 s of mha_ext's time, up to 61). K/V GB/s = bytes of "
             "all the layers' K and V / the step's time.", "",
             "| dtype | Hq, Hkv, D | S | K/V a layer MiB | mha_ext ms | torch ms | torch / mha_ext | "
             "mha_ext K/V GB/s | torch K/V GB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    shapes = [(12, 12, 64), (32, 8, 64), (32, 8, 128)]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for hq, hkv, D in shapes:
            for S in ([2048, 8192] if args.quick else [2048, 4096, 8192]):
                q = torch.randn(1, hq, 1, D, dtype=dtype)
                kv = [(torch.randn(1, hkv, S, D, dtype=dtype), torch.randn(1, hkv, S, D, dtype=dtype))
                      for _ in range(n)]
                gqa = hq != hkv

                def step(fn):
                    for k, v in kv:
                        fn(q, k, v, enable_gqa=gqa)

                fns = [lambda: step(mha_ext.scaled_dot_product_attention),
                       lambda: step(F.scaled_dot_product_attention)]
                t_one = median_times(fns[:1], 3, warmup=1)[0]
                reps = max(args.reps, min(61, int(0.5 / max(t_one, 1e-6))))
                ta, tb = median_times(fns, reps)
                layer = 2 * kv[0][0].numel() * kv[0][0].element_size()
                ratios.append(tb / ta)
                lines.append(f"| {name} | {hq}, {hkv}, {D} | {S} | {layer / 2**20:.0f} | {ta * 1e3:.3f} | "
                             f"{tb * 1e3:.3f} | {tb / ta:.2f} | {n * layer / ta / 1e9:.1f} | {n * layer / tb / 1e9:.1f} |")
                print(lines[-1], flush=True)
                del q, kv
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    lines += ["", f"Geometric mean of torch / mha_ext: {geo:.2f}; lowest {min(ratios):.2f}."]
    write_report("decode-layers.md", lines)


if __name__ == "__main__":
    main()
