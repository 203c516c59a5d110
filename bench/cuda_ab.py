"""Versions of the plain CUDA forward kernel side by side, in one process,
without building the torch extension: each source tree (a git revision, or a
directory holding csrc/) compiles bench/cuda_ab/variant.cu into one library
(nvcc, in parallel; about 10 s a tree on 16 cores where the extension's
build takes 140 s), and the table times each version and torch's flash and
memory-efficient SDPA backends, interleaved, on the shapes of
`bench_cuda.py --quick` (float16 / bfloat16, 16 x 64 and 8 x 128 heads,
L = 512 to 8192, plain and causal), with each version's output error against
a float32 reference beside flash's. For a session with a lent GPU: one call
measures a kernel change against the commit before it.

    python bench/cuda_ab.py HEAD~1 .                 # the last commit's kernel against the working tree's
    python bench/cuda_ab.py --lengths 2048 A B C     # three versions, one length
    python bench/cuda_ab.py --emulate .              # the harness itself on the CPU (the emulation, tiny shapes)
"""
import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "bench", "cuda_ab", "variant.cu")


def source_tree(spec, scratch, i):
    """A directory holding csrc/ for spec: the directory itself, or a git revision's csrc/."""
    if os.path.isdir(os.path.join(spec, "csrc")):
        return os.path.abspath(spec)
    dest = os.path.join(scratch, f"tree{i}")
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", ROOT, "archive", spec, "csrc"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def nvcc():
    found = shutil.which("nvcc")
    return found or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def build(specs, scratch, emulate):
    """One shared library with the entries ab_fwd_0 .. ab_fwd_{n-1}."""
    objects, jobs = [], []
    for i, spec in enumerate(specs):
        tree = source_tree(spec, scratch, i)
        obj = os.path.join(scratch, f"v{i}.o")
        defs = [f"-Dmha_ext=mha_ext_ab{i}", f"-DAB_ENTRY=ab_fwd_{i}", f"-I{tree}/csrc/cuda"]
        if emulate:
            from torch.utils.cpp_extension import include_paths
            cmd = ["g++", "-x", "c++", "-std=c++20", "-O1", "-fPIC", "-DMHA_SIMT_EMULATION", *defs,
                   *[f"-I{p}" for p in include_paths()], "-c", SOURCE, "-o", obj]
        else:
            major, minor = torch.cuda.get_device_capability()
            arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
            cmd = [nvcc(), "-std=c++20", "-O3", f"-arch={arch}", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
                   *defs, "-c", SOURCE, "-o", obj]
        jobs.append((spec, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        objects.append(obj)
    for spec, job in jobs:
        out = job.communicate()[0]
        if job.returncode != 0:
            sys.exit(f"{spec}: the compile failed\n{out[-4000:]}")
    lib = os.path.join(scratch, "ab.so")
    if emulate:
        import torch.utils.cpp_extension as ext
        libdir = os.path.join(os.path.dirname(ext.__file__), "..", "lib")
        cmd = ["g++", "-shared", "-o", lib, *objects, f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}"]
    else:
        cmd = [nvcc(), "-shared", "-o", lib, *objects]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(lib)


def entry(lib, i):
    fn = getattr(lib, f"ab_fwd_{i}")
    fn.argtypes = [ctypes.c_int] + [ctypes.c_int64] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="+", help="git revisions or directories holding csrc/ (the first is the baseline)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds (medians)")
    ap.add_argument("--gflop", type=float, default=200.0, help="GFLOP a call (sets the batch, as bench_cuda.py)")
    ap.add_argument("--emulate", action="store_true")
    args = ap.parse_args()
    emulate = args.emulate
    device = torch.device("cpu" if emulate else "cuda")
    scratch = tempfile.mkdtemp(prefix="cuda_ab.")
    try:
        t0 = time.perf_counter()
        lib = build(args.trees, scratch, emulate)
        fns = [entry(lib, i) for i in range(len(args.trees))]
        print(f"built {len(fns)} versions in {time.perf_counter() - t0:.0f} s", flush=True)
        if emulate:
            emulated(fns, args.trees)
        else:
            table(fns, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def call(fn, q, k, v, out, lse, causal, reps):
    B, H, L, D = q.shape
    dtype = 0 if q.dtype == torch.float16 else 1
    err = fn(dtype, B, H, L, k.shape[2], D, int(causal), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
             lse.data_ptr(), reps)
    if err:
        raise RuntimeError(f"launch error {err}")


def emulated(fns, names):
    """Each version on the CPU emulation against a float64 reference: the harness's params and launch."""
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128):
            for causal in (False, True):
                B, H, L, S = 1, 2, 130, 130
                q, k, v = (torch.randn(B, H, n, D).to(dtype) for n in (L, S, S))
                ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
                # the bound: twice torch's own error in the dtype, plus one unit in the last place
                eager = (F.scaled_dot_product_attention(q, k, v, is_causal=causal).double() - ref).abs().max().item()
                bound = 2 * eager + torch.finfo(dtype).eps
                first = None
                for fn, name in zip(fns, names):
                    out = torch.empty(B, H, L, D, dtype=dtype)
                    lse = torch.empty(B, H, L, dtype=torch.float32)
                    call(fn, q, k, v, out, lse, causal, 1)
                    err = (out.double() - ref).abs().max().item()
                    first = out if first is None else first
                    same = (out != first).sum().item()
                    print(f"{name} {str(dtype)[6:]} D {D} causal {causal}: max error {err:.2e} (bound {bound:.2e}), "
                          f"{same} elements differ from the first version's")
                    if not err <= bound:
                        sys.exit(f"{name}: error {err:.2e} past {bound:.2e}")


def gpu_times(fns, reps):
    """Medians (s) of each fn's time to its kernels' end, interleaved: round r
    starts with fn r mod n (as bench_attention.median_times, which this does
    not import: that module imports mha_ext, which this does not build)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for r in range(reps):
        for j in range(len(fns)):
            i = (r + j) % len(fns)
            t = time.perf_counter()
            fns[i]()
            torch.cuda.synchronize()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


def table(fns, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    names = [f"v{i} ({t})" for i, t in enumerate(args.trees)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; versions: " + ", ".join(names))
    head = (["dtype", "HxE", "L", "B", "case"] + [f"TFLOP/s {n}" for n in names] + ["flash", "efficient"] +
            [f"v{i} / flash (time)" for i in range(len(fns))] + [f"v{i} / v0 (time)" for i in range(1, len(fns))] +
            ["max error " + n for n in names] + ["flash's"])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)

    def sdpa(backend, q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        for D in args.dims:
            H = 16 if D == 64 else 8
            for L in args.lengths:
                B = max(1, round(args.gflop * 1e9 / (4 * H * L * L * D)))
                torch.manual_seed(0)
                q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
                outs = [torch.empty_like(q) for _ in fns]
                lses = [torch.empty(B, H, L, device="cuda", dtype=torch.float32) for _ in fns]
                for causal in (False, True):
                    case = "causal" if causal else "plain"
                    # errors against float32 (the memory-efficient backend: no L x S matrix)
                    ref = sdpa(SDPBackend.EFFICIENT_ATTENTION, q.float(), k.float(), v.float(), causal)
                    errs = []
                    for fn, o, l in zip(fns, outs, lses):
                        call(fn, q, k, v, o, l, causal, 1)
                        torch.cuda.synchronize()
                        errs.append((o.float() - ref).abs().max().item())
                    errs.append((sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal).float() - ref).abs().max().item())
                    del ref
                    # a sample: `burst` calls queued back to back, so that the host's
                    # launch and synchronisation do not count
                    burst = 5
                    calls = [lambda fn=fn, o=o, l=l: call(fn, q, k, v, o, l, causal, burst)
                             for fn, o, l in zip(fns, outs, lses)]
                    calls += [lambda b=b: [sdpa(b, q, k, v, causal) for _ in range(burst)]
                              for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)]
                    t = [x / burst for x in gpu_times(calls, args.reps)]
                    flop = 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)
                    tf = [flop / x / 1e12 for x in t]
                    n = len(fns)
                    row = [dt, f"{H}x{D}", L, B, case] + [f"{x:.1f}" for x in tf]
                    row += [f"{t[i] / t[n]:.2f}" for i in range(n)] + [f"{t[i] / t[0]:.3f}" for i in range(1, n)]
                    row += [f"{e:.1e}" for e in errs]
                    print("| " + " | ".join(str(x) for x in row) + " |", flush=True)
                    for e in errs[:-1]:
                        if not (e <= 2 * errs[-1] + 2 * torch.finfo(dtype).eps):
                            print(f"  ^ a version's error {e:.2e} is past twice flash's {errs[-1]:.2e}", flush=True)


if __name__ == "__main__":
    main()
