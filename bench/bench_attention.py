"""mha_ext against torch's own attention on this machine, side by side in one
process, interleaved, medians of repeated runs.

    python bench/bench_attention.py            # the full grid (takes a while; progress shown)
    python bench/bench_attention.py --quick    # a smaller grid
    python bench/bench_attention.py --threads 1,2 --dtypes float32,bfloat16

Tables (markdown, also written to bench/out/bench.md):
  1. functional: mha_ext.scaled_dot_product_attention vs F.scaled_dot_product_attention,
     forward and forward+backward, per heads x head_dim, L, case, dtype, threads;
  2. module: mha_ext.MultiheadAttention vs nn.MultiheadAttention (need_weights=False);
  3. ceiling: float32 forward GFLOP/s of mha_ext vs torch.mm on a large matmul;
  4. memory: peak extra resident memory of forward+backward by L (O(L) vs O(L^2));
  5. CUDA (only where a GPU is present): TFLOP/s of forward and forward+backward, mha_ext vs
     F.scaled_dot_product_attention on the same GPU, float16 / bfloat16, and peak GPU memory.
A PNG (bench/out/speedup.png) plots the speed-up against torch by L, one line per case.
Attention FLOPs = 4 * B * H * L * S * E (forward), halved for causal; backward counted as 2.5x forward.
"""
import argparse
import datetime
import glob
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
from peakmem import peak_extra_mib, reexec_with_fixed_mmap_threshold  # noqa: E402

CASES = ["plain", "causal", "dropout", "mask3d", "ev!=e"]


def cpu_name():
    """The model name with its family / model numbers and last-level cache
    (VMs of different CPUs report the same name)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    extra = []
    if "cpu family" in fields and "model" in fields:
        extra.append(f"family {fields['cpu family']} model {fields['model']}")
    caches = []  # (level, size) of cpu0's caches
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as f, open(os.path.join(index, "size")) as g:
                caches.append((int(f.read()), g.read().strip()))
        except (OSError, ValueError):
            pass
    if caches:
        level, size = max(caches)
        if size.endswith("K") and size[:-1].isdigit():
            size = f"{int(size[:-1]) / 1024:g} MiB"
        extra.append(f"L{level} {size}")
    return f"{name} ({', '.join(extra)})" if extra else name


def median_times(fns, reps, warmup=1, before=None):
    """Interleaved: each rep runs every fn once, in turn, starting one later
    each rep (rep r starts with fn r mod n), so that no fn always runs first
    or always right after the same other one (the allocator and caches carry
    state from one call to the next). before(i), if given, runs untimed
    before each call of fns[i]. Returns medians (s)."""
    before = before or (lambda i: None)
    for i, fn in enumerate(fns):
        for _ in range(warmup):
            before(i)
            fn()
    times = [[] for _ in fns]
    for r in range(reps):
        for i in rotation(len(fns), r):
            before(i)
            t = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def rotation(n, r):
    """The order of rep r over n interleaved candidates: r mod n first."""
    return [(r + i) % n for i in range(n)]


def write_report(name, lines):
    """Writes the markdown lines to bench/out/<name> and prints them."""
    text = "\n".join(lines)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", name), "w") as f:
        f.write(text + "\n")
    print(text)


def batch_for(H, L, E, target_gflop):
    return max(1, round(target_gflop * 1e9 / (4 * H * L * L * E)))


def make_inputs(case, B, H, L, E, dtype, grad):
    Ev = E // 2 if case == "ev!=e" else E
    q = torch.randn(B, H, L, E, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, H, L, E, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, H, L, Ev, dtype=dtype, requires_grad=grad)
    kw = dict(is_causal=case == "causal", dropout_p=0.1 if case == "dropout" else 0.0)
    if case == "mask3d":
        kw["attn_mask"] = torch.randn(1, L, L, dtype=dtype)
    return q, k, v, kw


def attention_fns(case, B, H, L, E, dtype, backward):
    q, k, v, kw = make_inputs(case, B, H, L, E, dtype, backward)
    g = torch.randn(B, H, L, v.shape[-1], dtype=dtype)

    def run(f):
        def go():
            out = f(q, k, v, **kw)
            if backward:
                torch.autograd.grad(out, (q, k, v), g)

        return go

    return [run(mha_ext.scaled_dot_product_attention), run(F.scaled_dot_product_attention)]


def attention_flops(case, B, H, L, E, backward):
    f = 4.0 * B * H * L * L * E * (0.5 if case == "causal" else 1.0)
    return f * (3.5 if backward else 1.0)


def module_fns(case, B, H, L, E, dtype, backward):
    d = H * E
    p = 0.1 if case == "dropout" else 0.0
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(d, H, dropout=p, batch_first=True, dtype=dtype)
    ours = mha_ext.MultiheadAttention(d, H, dropout=p, batch_first=True, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, d, dtype=dtype, requires_grad=backward)
    mask = torch.ones(L, L, dtype=torch.bool).triu(1) if case == "causal" else None
    for m in (ref, ours):
        m.train(backward)

    def run(m):
        def go():
            if backward:
                out = m(x, x, x, attn_mask=mask, need_weights=False, is_causal=mask is not None)[0]
                torch.autograd.grad(out, [x] + list(m.parameters()), torch.ones_like(out))
            else:
                with torch.no_grad():
                    m(x, x, x, attn_mask=mask, need_weights=False, is_causal=mask is not None)

        return go

    return [run(ours), run(ref)]


def gpu_times(fns, reps, device):
    """median_times for work queued on a GPU: each call waits for its kernels."""
    def synced(fn):
        def go():
            fn()
            torch.cuda.synchronize(device)
        return go
    return median_times([synced(fn) for fn in fns], reps)


def device_section(device, dtypes, shapes, lengths, cases, reps, target_gflop, progress):
    """Rows of TFLOP/s on `device` (a GPU when run from main) for mha_ext and torch, per case."""
    rows = []
    jobs = [(dt, H, E, L, c) for dt in dtypes for (H, E) in shapes for L in lengths for c in cases]
    for dt, H, E, L, c in progress(jobs):
        B = batch_for(H, L, E, target_gflop)
        torch.manual_seed(0)
        q, k, v, kw = make_inputs(c, B, H, L, E, dt, True)
        q, k, v = (x.detach().to(device).requires_grad_() for x in (q, k, v))
        if "attn_mask" in kw:
            kw["attn_mask"] = kw["attn_mask"].to(device)
        g = torch.randn(B, H, L, v.shape[-1], dtype=dt, device=device)
        fns = []
        for backward in (False, True):
            for f in (mha_ext.scaled_dot_product_attention, F.scaled_dot_product_attention):
                def go(f=f, backward=backward):
                    out = f(q, k, v, **kw)
                    if backward:
                        torch.autograd.grad(out, (q, k, v), g)
                fns.append(go)
        times = gpu_times(fns, reps, device) if device.type == "cuda" else median_times(fns, reps)
        tf = [attention_flops(c, B, H, L, E, i >= 2) / t / 1e12 for i, t in enumerate(times)]
        rows.append([str(dt).replace("torch.", ""), f"{H}x{E}", L, B, c, f"{tf[0]:.1f}", f"{tf[1]:.1f}",
                     f"{times[1] / times[0]:.2f}", f"{tf[2]:.1f}", f"{tf[3]:.1f}", f"{times[3] / times[2]:.2f}"])
    return table(["dtype", "HxE", "L", "B", "case", "fwd TFLOP/s mha_ext", "fwd TFLOP/s torch", "fwd speed-up",
                  "fwd+bwd TFLOP/s mha_ext", "fwd+bwd TFLOP/s torch", "fwd+bwd speed-up"], rows)


def table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="defaults to L = 512, 1024 and shapes 12x64, 4x128")
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="comma list, e.g. 1,2")
    ap.add_argument("--dtypes", default="float32", help="comma list of float32, bfloat16, float16")
    ap.add_argument("--shapes", default=None, help="heads x head_dim, comma list (default 12x64,16x64,20x64,4x128)")
    ap.add_argument("--lengths", default=None, help="comma list (default 512,1024,2048,4096)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=3, help="timed runs per case, after one warm-up")
    ap.add_argument("--target-gflop", type=float, default=1.0, help="forward work per case, picks the batch")
    ap.add_argument("--memory-lengths", default=None, help="default 1024,2048,4096,8192,16384")
    ap.add_argument("--no-module", action="store_true")
    ap.add_argument("--no-cuda", action="store_true", help="skip the GPU tables even where a GPU is present")
    ap.add_argument("--cuda-target-gflop", type=float, default=200.0, help="forward work per GPU case")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    args = ap.parse_args()
    reexec_with_fixed_mmap_threshold()
    # --quick changes the defaults only; explicit options win.
    args.shapes = args.shapes or ("12x64,4x128" if args.quick else "12x64,16x64,20x64,4x128")
    args.lengths = args.lengths or ("512,1024" if args.quick else "512,1024,2048,4096")
    args.memory_lengths = args.memory_lengths or ("1024,2048,4096" if args.quick else "1024,2048,4096,8192,16384")
    from tqdm import tqdm

    threads = [int(t) for t in args.threads.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    cases = args.cases.split(",")
    os.makedirs(args.out, exist_ok=True)
    header = (f"mha_ext benchmark, {datetime.date.today()}, {cpu_name()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__}, CPU path {mha_ext.ops.cpu_isa()}\n"
              f"command: python bench/bench_attention.py {' '.join(sys.argv[1:])}".rstrip())
    print(header, flush=True)
    report = [header, ""]

    # 1. functional
    jobs = [(t, dt, H, E, L, c) for t in threads for dt in dtypes for (H, E) in shapes for L in lengths for c in cases
            if not (dt != torch.float32 and c in ("mask3d", "ev!=e"))]
    rows, speedups = [], {}
    for t, dt, H, E, L, c in tqdm(jobs, desc="functional", unit="case", file=sys.stderr):
        torch.set_num_threads(t)
        B = batch_for(H, L, E, args.target_gflop)
        fwd = median_times(attention_fns(c, B, H, L, E, dt, False), args.reps)
        bwd = median_times(attention_fns(c, B, H, L, E, dt, True), args.reps)
        gf = attention_flops(c, B, H, L, E, False) / fwd[0] / 1e9
        rows.append([t, str(dt).replace("torch.", ""), f"{H}x{E}", L, B, c,
                     f"{fwd[0]*1e3:.1f}", f"{fwd[1]*1e3:.1f}", f"{fwd[1]/fwd[0]:.2f}",
                     f"{bwd[0]*1e3:.1f}", f"{bwd[1]*1e3:.1f}", f"{bwd[1]/bwd[0]:.2f}", f"{gf:.0f}"])
        speedups.setdefault((t, dt, c), []).append((L, H, E, fwd[1] / fwd[0], bwd[1] / bwd[0]))
    t1 = table(["threads", "dtype", "HxE", "L", "B", "case", "fwd ms mha_ext", "fwd ms torch", "fwd speed-up",
                "fwd+bwd ms mha_ext", "fwd+bwd ms torch", "fwd+bwd speed-up", "mha_ext fwd GFLOP/s"], rows)
    summary = []
    for (t, dt, c), vals in speedups.items():
        summary.append([t, str(dt).replace("torch.", ""), c, f"{geomean([v[3] for v in vals]):.2f}",
                        f"{min(v[3] for v in vals):.2f}", f"{geomean([v[4] for v in vals]):.2f}",
                        f"{min(v[4] for v in vals):.2f}"])
    t1s = table(["threads", "dtype", "case", "fwd geomean", "fwd min", "fwd+bwd geomean", "fwd+bwd min"], summary)
    report += ["## mha_ext.scaled_dot_product_attention vs F.scaled_dot_product_attention",
               "speed-up = torch time / mha_ext time", "", t1, "", "Summary over the grid:", "", t1s, ""]
    print("\n" + "\n".join(report[-7:]), flush=True)

    # 2. module
    if not args.no_module:
        rows = []
        mjobs = [(H, E, L, c) for (H, E) in shapes for L in lengths for c in ("plain", "causal", "dropout")]
        torch.set_num_threads(threads[-1])
        for H, E, L, c in tqdm(mjobs, desc="module", unit="case", file=sys.stderr):
            B = batch_for(H, L, E, args.target_gflop)
            fwd = median_times(module_fns(c, B, H, L, E, torch.float32, False), args.reps)
            bwd = median_times(module_fns(c, B, H, L, E, torch.float32, True), args.reps)
            rows.append([f"{H}x{E}", L, B, c, f"{fwd[0]*1e3:.1f}", f"{fwd[1]*1e3:.1f}", f"{fwd[1]/fwd[0]:.2f}",
                         f"{bwd[0]*1e3:.1f}", f"{bwd[1]*1e3:.1f}", f"{bwd[1]/bwd[0]:.2f}"])
        t2 = table(["HxE", "L", "B", "case", "fwd ms mha_ext", "fwd ms torch", "fwd speed-up",
                    "fwd+bwd ms mha_ext", "fwd+bwd ms torch", "fwd+bwd speed-up"], rows)
        report += [f"## mha_ext.MultiheadAttention vs nn.MultiheadAttention (float32, {threads[-1]} threads, "
                   "need_weights=False; forward in eval/no_grad, forward+backward in training)", "", t2, ""]
        print("\n".join(report[-4:]), flush=True)

    # 3. ceiling
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
        mm = median_times([lambda: torch.mm(a, b)], 5)[0]
        mm_gf = 2 * 4096**3 / mm / 1e9
        for L in [x for x in lengths if x >= 1024]:
            H, E = 12, 64
            B = batch_for(H, L, E, args.target_gflop)
            fwd = median_times(attention_fns("plain", B, H, L, E, torch.float32, False)[:1], args.reps)[0]
            gf = attention_flops("plain", B, H, L, E, False) / fwd / 1e9
            rows.append([t, L, f"{gf:.0f}", f"{mm_gf:.0f}", f"{100 * gf / mm_gf:.0f}%"])
    t3 = table(["threads", "L (12x64)", "mha_ext fwd GFLOP/s", "torch.mm 4096^3 GFLOP/s", "ratio"], rows)
    report += ["## Ceiling: float32 forward attention vs a large torch.mm", "", t3, ""]
    print("\n".join(report[-4:]), flush=True)

    # 4. memory
    torch.set_num_threads(threads[-1])
    rows = []
    H, E = 4, 64
    for L in [int(x) for x in args.memory_lengths.split(",")]:
        row = [L]
        for name, kw in (("mha_ext", {"dropout_p": 0.1}), ("torch fused", {}),
                         ("torch math (dropout 0.1)", {"dropout_p": 0.1})):
            need_gib = 4 * H * L * L * 4 / 2**30  # the math path keeps ~4 L x L float32 matrices per head
            if name.startswith("torch math") and need_gib > 8:
                row.append(f"skipped (~{need_gib:.0f} GiB)")
                continue
            q, k, v = (torch.randn(1, H, L, E, requires_grad=True) for _ in range(3))
            f = mha_ext.scaled_dot_product_attention if name == "mha_ext" else F.scaled_dot_product_attention

            def go():
                out = f(q, k, v, **kw)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

            go()
            _, mib = peak_extra_mib(go)
            row.append(f"{mib:.1f}")
        rows.append(row)
    t4 = table(["L (B=1, 4x64)", "mha_ext (dropout 0.1) MiB", "torch fused MiB", "torch math (dropout 0.1) MiB"], rows)
    report += ["## Peak extra memory of forward+backward (inputs excluded)", "", t4, ""]
    print("\n".join(report[-4:]), flush=True)

    # 5. CUDA
    if torch.cuda.is_available() and not args.no_cuda:
        device = torch.device("cuda")
        name = torch.cuda.get_device_name(device)
        t5 = device_section(device, [torch.float16, torch.bfloat16], shapes + [(8, 256)], lengths + [8192],
                            ["plain", "causal", "dropout"], max(args.reps, 10), args.cuda_target_gflop,
                            lambda jobs: tqdm(jobs, desc="cuda", unit="case", file=sys.stderr))
        rows = []
        for L in [int(x) for x in args.memory_lengths.split(",")]:
            row = [L]
            for f, kw in ((mha_ext.scaled_dot_product_attention, {"dropout_p": 0.1}),
                          (F.scaled_dot_product_attention, {"dropout_p": 0.1})):
                q, k, v = (torch.randn(1, 16, L, 64, dtype=torch.float16, device=device, requires_grad=True)
                           for _ in range(3))
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                out = f(q, k, v, **kw)
                torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
                torch.cuda.synchronize(device)
                row.append(f"{(torch.cuda.max_memory_allocated(device) - base) / 2**20:.1f}")
                del q, k, v, out
            rows.append(row)
        t6 = table(["L (B=1, 16x64, float16)", "mha_ext (dropout 0.1) MiB", "torch (dropout 0.1) MiB"], rows)
        report += [f"## CUDA: {name}", "speed-up = torch time / mha_ext time; FLOPs as above", "", t5, "",
                   "Peak extra GPU memory of forward+backward (inputs excluded):", "", t6, ""]
        print("\n".join(report[-8:]), flush=True)

    path = os.path.join(args.out, "bench.md")
    with open(path, "w") as fh:
        fh.write("\n".join(report) + "\n")
    print(f"written: {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for (t, dt, c), vals in speedups.items():
            by_l = {}
            for L, H, E, sf, sb in vals:
                by_l.setdefault(L, []).append(sb)
            xs = sorted(by_l)
            ax.plot(xs, [geomean(by_l[x]) for x in xs], marker="o",
                    label=f"{c}, {str(dt).replace('torch.', '')}, {t} thr")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("speed-up vs torch (fwd+bwd, geomean over shapes)")
        ax.set_title(f"mha_ext vs torch SDPA on {cpu_name()}, {datetime.date.today()}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        png = os.path.join(args.out, "speedup.png")
        fig.savefig(png, dpi=110)
        print(f"written: {png}")
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
