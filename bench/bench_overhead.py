"""The fixed cost of a call: mha_ext against F.scaled_dot_product_attention on
inputs too small to measure anything else, and on one decoder layer's decode
step (8 query heads on 2 key/value heads, head dim 64), under no_grad as
generate() runs, in one process, interleaved, medians of loops of calls.

    python bench/bench_overhead.py
    python bench/bench_overhead.py --quick

Rows: torch's SDPA; mha_ext.scaled_dot_product_attention (the drop-in, whose
plain call goes from mha_ext._C in C++ through the dispatcher below autograd
when autograd has nothing to record); the op itself,
torch.ops.mha_ext.attention, which boxes its arguments and goes through the
dispatcher's autograd kernel (a Python one) and back. Writes bench/out/overhead.md.
"""
import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
from bench_attention import cpu_name, median_times, write_report  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    args = ap.parse_args()
    reps = 5 if args.quick else args.reps
    op = torch.ops.mha_ext.attention.default
    cases = [("tiny: 8 on 2 heads, L = 1, S = 16", 16), ("decode step, S = 512", 512), ("decode step, S = 2048", 2048)]
    lines = [
        f"# Call overhead, {datetime.date.today()}, {cpu_name()}, torch {torch.__version__}, no_grad",
        "",
        "`python bench/bench_overhead.py" + (" --quick" if args.quick else "") + "`; microseconds a call, medians of "
        f"{reps} interleaved loops of {args.calls} calls; float32, batch 1, 8 query heads on 2 key/value heads, "
        "head dim 64, one query row.",
        "",
        "| threads | case | torch SDPA | mha_ext SDPA | torch / mha_ext | op through autograd |",
        "|---|---|---|---|---|---|",
    ]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, S in cases:
            q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, S, 64), torch.randn(1, 2, S, 64)

            def loop(f):
                def run():
                    for _ in range(args.calls):
                        f()
                return run

            fns = [
                loop(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                loop(lambda: mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
                loop(lambda: op(q, k, v, None, 0.0, False, None, True, None)),
            ]
            with torch.no_grad():
                t = [x / args.calls * 1e6 for x in median_times(fns, reps, warmup=2)]
            lines.append(f"| {threads} | {name} | {t[0]:.1f} | {t[1]:.1f} | {t[0] / t[1]:.2f} | {t[2]:.1f} |")
    write_report("overhead.md", lines)


if __name__ == "__main__":
    main()
