"""Two CPU instruction-set paths of mha_ext on the same calls, interleaved:
one worker process per path (MHA_EXT_CPU_ISA is read once per process), the
same case timed by each in turn, rep after rep, and torch's SDPA timed in the
first worker between them; medians, ratios, the machine named.

    python bench/isa_ab.py                          # avx512 vs avx512bf16, bfloat16 (the pair products)
    python bench/isa_ab.py --isas avx2,avx512 --dtype float32
    python bench/isa_ab.py --quick

Columns: each path's forward and forward+backward time, the second path's
speed-up over the first (first's time / second's), and torch / second.
Writes markdown to bench/out/isa_ab.md and prints it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# A worker: reads one JSON case a line, answers with its timings.
WORKER = r"""
import json, sys, time, statistics, torch, mha_ext
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
print(json.dumps({"isa": mha_ext.ops.cpu_isa()}), flush=True)
cache = {}
def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
for line in sys.stdin:
    c = json.loads(line)
    key = (c["B"], c["H"], c["L"], c["E"], c["dtype"])
    if key not in cache:
        torch.manual_seed(0)
        dt = getattr(torch, c["dtype"])
        cache.clear()
        cache[key] = [torch.randn(c["B"], c["H"], c["L"], c["E"]).to(dt).requires_grad_() for _ in range(4)]
    q, k, v, g = cache[key]
    causal = c["causal"]
    def fwd(f):
        with torch.no_grad():
            f(q, k, v, is_causal=causal)
    def fb(f):
        f(q, k, v, is_causal=causal).backward(g)
    out = {"fwd": timed(lambda: fwd(mha_ext.scaled_dot_product_attention), c["reps"]),
           "fb": timed(lambda: fb(mha_ext.scaled_dot_product_attention), c["reps"])}
    if c["torch"]:
        out["torch_fwd"] = timed(lambda: fwd(F.scaled_dot_product_attention), c["reps"])
        out["torch_fb"] = timed(lambda: fb(F.scaled_dot_product_attention), c["reps"])
    print(json.dumps(out), flush=True)
"""


def main():
    sys.path.insert(0, HERE)
    from bench_attention import batch_for, cpu_name, write_report  # noqa: E402

    ap = argparse.ArgumentParser()
    ap.add_argument("--isas", default="avx512,avx512bf16", help="two paths, the baseline first")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="alternations of the two workers per case")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per case and round in a worker (their median)")
    ap.add_argument("--target-gflop", type=float, default=1.0, help="forward work per case, picks the batch")
    ap.add_argument("--quick", action="store_true", help="two shapes, L = 512 and 1024")
    ap.add_argument("--lengths", default=None, help="comma list (default 512,1024,2048,4096)")
    args = ap.parse_args()
    isas = args.isas.split(",")
    assert len(isas) == 2, "--isas takes two paths"
    shapes = [(12, 64), (4, 128)] if args.quick else [(12, 64), (16, 64), (4, 128)]
    lengths = [512, 1024] if args.quick else [512, 1024, 2048, 4096]
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]

    workers = []
    for isa in isas:
        env = dict(os.environ, MHA_EXT_CPU_ISA=isa)
        w = subprocess.Popen([sys.executable, "-c", WORKER, str(args.threads)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
        got = json.loads(w.stdout.readline())["isa"]
        if got != isa:
            sys.exit(f"the CPU has no {isa} path: the worker runs {got}")
        workers.append(w)

    def ask(w, case):
        time.sleep(0.05)  # the other worker's idle threads stop spinning (OpenMP) before this one runs
        w.stdin.write(json.dumps(case) + "\n")
        w.stdin.flush()
        return json.loads(w.stdout.readline())

    rows, ratios = [], {"fwd": [], "fb": []}
    for (H, E) in shapes:
        for L in lengths:
            B = batch_for(H, L, E, args.target_gflop)
            for causal in (False, True):
                case = {"B": B, "H": H, "L": L, "E": E, "dtype": args.dtype, "causal": causal, "reps": args.reps}
                got = [[], []]
                for _ in range(args.rounds):
                    for i, w in enumerate(workers):
                        got[i].append(ask(w, dict(case, torch=i == 0)))
                med = [{k: statistics.median(r[k] for r in g) for k in g[0]} for g in got]
                fw, fb = med[0]["fwd"] / med[1]["fwd"], med[0]["fb"] / med[1]["fb"]
                ratios["fwd"].append(fw)
                ratios["fb"].append(fb)
                rows.append([f"{H}x{E}", L, B, "causal" if causal else "plain",
                             f"{med[0]['fwd'] * 1e3:.2f}", f"{med[1]['fwd'] * 1e3:.2f}", f"{fw:.2f}",
                             f"{med[0]['torch_fwd'] / med[1]['fwd']:.2f}",
                             f"{med[0]['fb'] * 1e3:.2f}", f"{med[1]['fb'] * 1e3:.2f}", f"{fb:.2f}",
                             f"{med[0]['torch_fb'] / med[1]['fb']:.2f}"])
                print(" | ".join(str(x) for x in rows[-1]), flush=True)
    for w in workers:
        w.stdin.close()
        w.wait()

    def geo(xs):
        return statistics.geometric_mean(xs)
    a, b = isas
    head = (f"# {a} against {b}: mha_ext on two CPU paths, {time.strftime('%Y-%m-%d')}\n\n"
            f"{cpu_name()}, {args.threads} threads, {args.dtype}, B for about {args.target_gflop:g} GFLOP a forward; "
            f"`python bench/isa_ab.py {' '.join(sys.argv[1:])}`; one worker process a path, the same case "
            f"timed by each in turn, {args.rounds} rounds, medians (each round the median of {args.reps} runs); "
            f"torch's SDPA timed in the first worker. speed-up = {a} time / {b} time.\n")
    cols = ["HxE", "L", "B", "case", f"fwd ms {a}", f"fwd ms {b}", "fwd speed-up", f"torch / {b} fwd",
            f"fwd+bwd ms {a}", f"fwd+bwd ms {b}", "fwd+bwd speed-up", f"torch / {b} fwd+bwd"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    lines.append(f"\nGeometric mean speed-up of {b} over {a}: forward {geo(ratios['fwd']):.2f} "
                 f"({min(ratios['fwd']):.2f}-{max(ratios['fwd']):.2f}), forward+backward {geo(ratios['fb']):.2f} "
                 f"({min(ratios['fb']):.2f}-{max(ratios['fb']):.2f}).")
    print()
    write_report("isa_ab.md", lines)


if __name__ == "__main__":
    main()
