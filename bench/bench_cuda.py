"""The CUDA kernels on a GPU, in one process, interleaved, medians (each call
synchronised): what the first session with a GPU runs.

    python bench/bench_cuda.py                # both tables (needs a CUDA GPU)
    python bench/bench_cuda.py --quick        # fewer lengths
    python bench/bench_cuda.py --dry-run      # the same code on the CPU, tiny sizes (checks the script)

1. TFLOP/s of forward and forward+backward, mha_ext against torch's SDPA
   with its flash and its memory-efficient backend (torch.nn.attention.sdpa_kernel),
   float16 / bfloat16, head dims 64 and 128, L = 512 .. 16k, causal and not.
2. The run-time switches of the CUDA backend, each value against the default,
   forward and forward+backward, interleaved in the same process (they are read
   at each launch): MHA_EXT_CUDA_FWD_WARP_ROWS (the plain forward kernel's
   32 query rows a warp, or the general kernel's 16; at head dim 64, 16 also
   means 64-row blocks where auto takes 128, so 16 in 128-row blocks is a
   value of its own), MHA_EXT_CUDA_FWD_ROWS
   (64 / 128 query rows per forward block), MHA_EXT_CUDA_OPERANDS (ldmatrix / scalar operand loads;
   scalar only in a build with MHA_EXT_SCALAR_OPERANDS=1, else the row is left out), and for
   float32 MHA_EXT_CUDA_FLOAT32 (auto with TF32 off and on, 3xtf32,
   cuda-cores) beside torch's float32 (memory-efficient backend).
3. Decoding (one query row against 2k-32k keys, B = 1 and 8, 32 heads on 8
   and 12 on 12): MHA_EXT_CUDA_KV_SPLITS auto (keys split across blocks,
   merged by logsumexp) and 1 (one block a head), MHA_EXT_CUDA_DECODE=off
   (the plain kernel instead of the decode kernel), torch's flash and
   memory-efficient backends, and K/V bytes read per second.
4. A decode step's key splits swept (auto, 1, 2, 4 ... 64) at 32k keys, the
   same shapes, each call synchronised and 20 calls queued with one wait (the
   GPU's own time a call where it, not the host, is the slower side).
5. Bool masks (--only masks): MHA_EXT_CUDA_MASK_RANGES auto (each block's
   tiles from the first to the last key, or row, the mask shows it) against
   off (every tile read), with torch's memory-efficient backend, forward and
   forward+backward, bfloat16 8 x 128 heads: a padded batch (a (B, 1, 1, S)
   key padding mask, lengths spread over 25-100% of S), a causal mask given
   as a bool mask (L x L, with the padding: transformers' 4-D masks), and
   prefill against a StaticCache (S = 4 L rows, the first L shown, causal).

Attention FLOPs = 4 B H L S E (forward), halved for causal; backward counted
as 2.5x forward. Writes markdown to bench/out/cuda.md and prints it.
"""
import argparse
import contextlib
import datetime
import itertools
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
from bench_attention import attention_flops, gpu_times, median_times, table, write_report  # noqa: E402


def timer(device):
    """median_times, each call waiting for its kernels on a GPU."""
    return lambda fns, reps: gpu_times(fns, reps, device) if device.type == "cuda" else median_times(fns, reps)


def torch_backend(name):
    """A context that runs F.scaled_dot_product_attention on one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name is None:
        return contextlib.nullcontext()
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "math": SDPBackend.MATH}[name]])


def inputs(B, H, L, E, dtype, device):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, H, L, E, dtype=dtype, device=device)


def step(f, q, k, v, g, causal, backward, ctx=None, env=None):
    """One call of f (forward, or forward + backward) under a torch backend
    context and with environment variables set for its duration."""
    def go():
        saved = {key: os.environ.get(key) for key in (env or {})}
        os.environ.update(env or {})
        try:
            with ctx() if ctx else contextlib.nullcontext():
                out = f(q, k, v, is_causal=causal)
                if backward:
                    torch.autograd.grad(out, (q, k, v), g)
        finally:
            for key, val in saved.items():
                if val is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = val
    return go


def batch_for(H, L, E, gflop):
    return max(1, round(gflop * 1e9 / (4 * H * L * L * E)))


def against_torch(device, dtypes, dims, lengths, reps, gflop, times):
    """Table 1: mha_ext, torch flash, torch efficient; TFLOP/s and torch / mha_ext."""
    rows = []
    for dt in dtypes:
        for E in dims:
            H = 16 if E == 64 else 8
            for L in lengths:
                B = batch_for(H, L, E, gflop)
                q, k, v, g = inputs(B, H, L, E, dt, device)
                for causal in (False, True):
                    case = "causal" if causal else "plain"
                    row = [str(dt).replace("torch.", ""), f"{H}x{E}", L, B, case]
                    for backward in (False, True):
                        fns = [step(mha_ext.scaled_dot_product_attention, q, k, v, g, causal, backward)]
                        names = ["flash", "efficient"] if device.type == "cuda" else [None, None]
                        fns += [step(F.scaled_dot_product_attention, q, k, v, g, causal, backward,
                                     lambda n=n: torch_backend(n)) for n in names]
                        t = times(fns, reps)
                        tf = [attention_flops(case, B, H, L, E, backward) / x / 1e12 for x in t]
                        row += [f"{tf[0]:.1f}", f"{tf[1]:.1f}", f"{tf[2]:.1f}", f"{t[0] / t[1]:.2f}",
                                f"{t[2] / t[0]:.2f}"]
                    rows.append(row)
                    print(" | ".join(map(str, row)), flush=True)
    head = ["dtype", "HxE", "L", "B", "case"]
    for part in ("fwd", "fwd+bwd"):
        head += [f"{part} TFLOP/s mha_ext", f"{part} flash", f"{part} efficient", f"{part} mha_ext / flash (time)",
                 f"{part} efficient / mha_ext (time)"]
    return table(head, rows)


def switches(device, lengths, reps, gflop, times):
    """Table 2: each value of a run-time switch against the default, as time /
    default time (below 1: faster than the default)."""
    variants = [
        (torch.float16, 128, "MHA_EXT_CUDA_FWD_WARP_ROWS", ["auto", "16"]),
        (torch.bfloat16, 64, "MHA_EXT_CUDA_FWD_WARP_ROWS", ["auto", "16", "16&MHA_EXT_CUDA_FWD_ROWS=128"]),
        (torch.float16, 128, "MHA_EXT_CUDA_FWD_ROWS", ["auto", "64", "128"]),
        (torch.float16, 64, "MHA_EXT_CUDA_FWD_ROWS", ["auto", "64", "128"]),
        (torch.bfloat16, 128, "MHA_EXT_CUDA_OPERANDS", ["ldmatrix", "scalar"]),
        (torch.float32, 64, "MHA_EXT_CUDA_FLOAT32", ["auto", "auto+tf32", "3xtf32", "cuda-cores"]),
        (torch.float32, 128, "MHA_EXT_CUDA_FLOAT32", ["auto", "auto+tf32", "3xtf32", "cuda-cores"]),
    ]
    rows = []
    for dt, E, var, values in variants:
        if var == "MHA_EXT_CUDA_OPERANDS" and not scalar_operands_built(device):
            print("skipped: MHA_EXT_CUDA_OPERANDS=scalar (built without MHA_EXT_SCALAR_OPERANDS=1)", flush=True)
            continue
        H = 16 if E == 64 else 8
        for L in lengths:
            B = batch_for(H, L, E, gflop)
            q, k, v, g = inputs(B, H, L, E, dt, device)
            for backward in (False, True):
                fns = []
                for val in values:
                    tf32 = val.endswith("+tf32")
                    ctx = (lambda t=tf32: tf32_matmuls(t))
                    fns.append(step(mha_ext.scaled_dot_product_attention, q, k, v, g, True, backward, ctx,
                                    switch_env(var, val)))
                if dt == torch.float32:  # torch's own float32 attention beside them
                    fns.append(step(F.scaled_dot_product_attention, q, k, v, g, True, backward,
                                    lambda: torch_backend("efficient" if device.type == "cuda" else None)))
                t = times(fns, reps)
                tf = [attention_flops("causal", B, H, L, E, backward) / x / 1e12 for x in t]
                cells = [f"{val}: {x:.1f} ({t[i] / t[0]:.2f})" for i, (val, x) in enumerate(zip(values, tf))]
                if dt == torch.float32:
                    cells.append(f"torch efficient: {tf[-1]:.1f} ({t[-1] / t[0]:.2f})")
                row = [str(dt).replace("torch.", ""), f"{H}x{E}", L, B, "fwd+bwd" if backward else "fwd", var,
                       "; ".join(cells)]
                rows.append(row)
                print(" | ".join(map(str, row)), flush=True)
    return table(["dtype", "HxE", "L", "B", "pass", "switch", "value: TFLOP/s (time / first value's), causal"], rows)


def scalar_operands_built(device):
    """Whether MHA_EXT_CUDA_OPERANDS=scalar runs here: the plain-load operand
    path is in a CUDA build made with MHA_EXT_SCALAR_OPERANDS=1 only."""
    if device.type != "cuda":
        return True
    q = torch.randn(1, 1, 8, 64, device=device, dtype=torch.float16)
    old = os.environ.get("MHA_EXT_CUDA_OPERANDS")
    os.environ["MHA_EXT_CUDA_OPERANDS"] = "scalar"
    try:
        mha_ext.scaled_dot_product_attention(q, q, q)
        return True
    except (RuntimeError, ValueError):
        return False
    finally:
        if old is None:
            del os.environ["MHA_EXT_CUDA_OPERANDS"]
        else:
            os.environ["MHA_EXT_CUDA_OPERANDS"] = old


def switch_env(var, val):
    """The environment of a switches-table value: "v" sets var to v, "v+tf32"
    also allows TF32 matmuls (the caller's context), "v&NAME=x" also sets
    NAME (e.g. the general kernel's 16-row warps in 128-row blocks, the
    plain kernel's block size at head dim 64)."""
    value, *extra = val.replace("+tf32", "").split("&")
    env = {var: value}
    env.update(e.split("=", 1) for e in extra)
    return env


def decode(device, dtypes, lengths, reps, times):
    """Table 3: one query row against S keys (a decode step), mha_ext with its
    key splits ("auto", the default) and without ("1": one block a head),
    beside torch's flash and memory-efficient backends; K/V bytes read per
    second beside the GPU's copy bandwidth measured in the same run."""
    n = 256 * 1024 * 1024 if device.type == "cuda" else 1024 * 1024
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    copy_gbs = 2 * n / times([lambda: dst.copy_(src)], reps)[0] / 1e9  # read + write
    rows = []
    for dt in dtypes:
        for B in (1, 8):
            for hq, hkv, E in ((32, 8, 128), (12, 12, 64)):
                for S in lengths:
                    torch.manual_seed(0)
                    q = torch.randn(B, hq, 1, E, dtype=dt, device=device)
                    k, v = (torch.randn(B, hkv, S, E, dtype=dt, device=device) for _ in range(2))
                    gqa = hq != hkv
                    ours = lambda *a, **kw: mha_ext.scaled_dot_product_attention(*a, **kw, enable_gqa=gqa)  # noqa: E731
                    fns = [step(ours, q, k, v, None, False, False, None, {"MHA_EXT_CUDA_KV_SPLITS": val})
                           for val in ("auto", "1")]
                    # the plain kernel instead of the decode kernel (one warp doing a block's products)
                    fns.append(step(ours, q, k, v, None, False, False, None, {"MHA_EXT_CUDA_DECODE": "off"}))
                    for name in ("flash", "efficient"):
                        fns.append(step(lambda *a, **kw: F.scaled_dot_product_attention(*a, **kw, enable_gqa=gqa),
                                        q, k, v, None, False, False,
                                        lambda n=name: torch_backend(n if device.type == "cuda" else None)))
                    t = times_or_nan(times, fns, reps)
                    kv = 2 * k.numel() * k.element_size()
                    row = [str(dt).replace("torch.", ""), B, f"{hq}, {hkv}, {E}", S] + [f"{x * 1e3:.3f}" for x in t]
                    row += [f"{kv / t[0] / 1e9:.0f}", f"{t[3] / t[0]:.2f}", f"{t[1] / t[0]:.2f}", f"{t[2] / t[0]:.2f}"]
                    rows.append(row)
                    print(" | ".join(map(str, row)), flush=True)
    head = ["dtype", "B", "Hq, Hkv, D", "S", "ms mha_ext (splits auto)", "ms mha_ext (splits 1)",
            "ms mha_ext (decode kernel off)", "ms flash", "ms efficient", "mha_ext K/V GB/s", "flash / mha_ext",
            "splits 1 / auto", "decode off / auto"]
    return f"Copy bandwidth (read + write of {n >> 20} MiB): {copy_gbs:.0f} GB/s.\n\n" + table(head, rows)


def queued_times(fns, reps, device, calls=20):
    """Median time a call of each fn with `calls` calls queued back to back and
    one wait at the end: the GPU's own time a call where it is the slower side
    (a synchronised call also counts the host's launch work and the wait)."""
    def queued(fn):
        def go():
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return go
    return [t / calls for t in median_times([queued(fn) for fn in fns], reps)]


SWEEP_SPLITS = ("auto", "1", "2", "4", "8", "16", "32", "64")


def split_sweep(device, dt, lengths, reps, times):
    """Table 4: a decode step's key splits swept (MHA_EXT_CUDA_KV_SPLITS), one
    query row against S keys for each S of lengths, each call synchronised and
    20 calls queued: the data a split rule is set by (the tiles a split against
    the blocks a wave holds)."""
    rows = []
    for S, B, (hq, hkv, E) in itertools.product(lengths, (1, 8), ((32, 8, 128), (12, 12, 64))):
        torch.manual_seed(0)
        q = torch.randn(B, hq, 1, E, dtype=dt, device=device)
        k, v = (torch.randn(B, hkv, S, E, dtype=dt, device=device) for _ in range(2))
        ours = lambda *a, **kw: mha_ext.scaled_dot_product_attention(*a, **kw, enable_gqa=hq != hkv)  # noqa: E731
        fns = [step(ours, q, k, v, None, False, False, None, {"MHA_EXT_CUDA_KV_SPLITS": val}) for val in SWEEP_SPLITS]
        for how, t in (("synchronised", times(fns, reps)), ("queued", queued_times(fns, reps, device))):
            row = [str(dt).replace("torch.", ""), B, f"{hq}, {hkv}, {E}", S, how] + [f"{x * 1e3:.3f}" for x in t]
            rows.append(row)
            print(" | ".join(map(str, row)), flush=True)
    head = ["dtype", "B", "Hq, Hkv, D", "S", "timing"] + [f"ms splits {val}" for val in SWEEP_SPLITS]
    return table(head, rows)


def times_or_nan(times, fns, reps):
    """times of fns, NaN for one that raises (a torch backend that does not
    take the case, such as flash with GQA in some torch versions)."""
    ok = []
    for fn in fns:
        try:
            fn()
            ok.append(fn)
        except RuntimeError as e:
            print(f"skipped: {str(e).splitlines()[0]}", flush=True)
    t = iter(times(ok, reps))
    return [next(t) if fn in ok else float("nan") for fn in fns]


def masks(device, lengths, reps, gflop, times):
    """Table 5: bool masks with MHA_EXT_CUDA_MASK_RANGES auto and off, and
    torch's memory-efficient backend; TFLOP/s counted on the full L x S."""
    dt, H, E = (torch.bfloat16, 8, 128) if device.type == "cuda" else (torch.float32, 2, 16)
    rows = []
    for L in lengths:
        B = batch_for(H, L, E, gflop)
        lens = torch.linspace(0.25, 1.0, B) if B > 1 else torch.tensor([0.6])
        pad = torch.arange(L)[None, :] < (lens * L).round().long()[:, None]  # (B, S): keys shown
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        cases = {"padding": (pad[:, None, None, :], L),
                 "causal + padding": (causal[None, None] & pad[:, None, None, :], L),
                 "StaticCache prefill": (torch.cat([causal, torch.zeros(L, 3 * L, dtype=torch.bool)], 1)[None, None],
                                         4 * L)}
        for name, (mask, S) in cases.items():
            torch.manual_seed(0)
            q = torch.randn(B, H, L, E, dtype=dt, device=device, requires_grad=True)
            k, v = (torch.randn(B, H, S, E, dtype=dt, device=device, requires_grad=True) for _ in range(2))
            g = torch.randn(B, H, L, E, dtype=dt, device=device)
            m = mask.to(device)
            for backward in (False, True):
                def call(f, env=None, ctx=None):
                    return step(lambda q, k, v, is_causal: f(q, k, v, attn_mask=m), q, k, v, g, False, backward, ctx,
                                env)
                fns = [call(mha_ext.scaled_dot_product_attention, {"MHA_EXT_CUDA_MASK_RANGES": "auto"}),
                       call(mha_ext.scaled_dot_product_attention, {"MHA_EXT_CUDA_MASK_RANGES": "off"}),
                       call(F.scaled_dot_product_attention,
                            ctx=lambda: torch_backend("efficient" if device.type == "cuda" else None))]
                t = times(fns, reps)
                flops = 4 * B * H * L * S * E * (3.5 if backward else 1.0)
                tf = [flops / x / 1e12 for x in t]
                row = [name, L, S, B, "fwd+bwd" if backward else "fwd", f"{tf[0]:.1f}", f"{tf[1]:.1f}", f"{tf[2]:.1f}",
                       f"{t[1] / t[0]:.2f}", f"{t[2] / t[0]:.2f}"]
                rows.append(row)
                print(" | ".join(map(str, row)), flush=True)
    return table(["mask", "L", "S", "B", "pass", "TFLOP/s ranges auto", "ranges off", "torch efficient",
                  "off / auto (time)", "efficient / auto (time)"], rows)


@contextlib.contextmanager
def tf32_matmuls(on):
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (checks the script)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", choices=["torch", "switches", "decode", "splits", "masks"], help="one table alone")
    ap.add_argument("--gflop", type=float, default=200.0, help="forward work per case, picks the batch")
    args = ap.parse_args()
    if args.dry_run:
        device, lengths, reps, gflop = torch.device("cpu"), [64, 96], 2, 0.01
        dtypes = [torch.float32]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_cuda.py needs a CUDA GPU (or --dry-run to check the script on the CPU)")
        device, reps, gflop = torch.device("cuda"), args.reps, args.gflop
        lengths = [512, 2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
        dtypes = [torch.float16, torch.bfloat16]
    times = timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    lines = [f"# CUDA: mha_ext against torch's SDPA, {datetime.date.today()}", "",
             f"{name}, torch {torch.__version__}; `python bench/bench_cuda.py {' '.join(sys.argv[1:])}`; medians of "
             f"{reps} interleaved runs, each synchronised.", "",
             ]
    want = lambda name: args.only in (None, name)  # noqa: E731
    if want("torch"):
        lines += ["## mha_ext against torch's flash and memory-efficient backends", "",
                  against_torch(device, dtypes, [64, 128], lengths, reps, gflop, times), ""]
    if want("switches"):
        lines += ["## The CUDA backend's run-time switches (causal)", "",
                  switches(device, lengths[-2:] if not args.dry_run else lengths, reps, gflop, times), ""]
    if want("decode"):
        lines += ["## Decoding: one query row, key splits on and off", "",
                  decode(device, dtypes, [64, 300] if args.dry_run else [2048, 8192, 32768], reps, times), ""]
    if want("splits"):
        lines += ["## Decoding: key splits swept", "",
                  split_sweep(device, dtypes[0], [300] if args.dry_run else [8192, 32768], reps, times), ""]
    if want("masks"):
        lines += ["## Bool masks: the ranges they show on and off (bfloat16, 8 x 128 heads)", "",
                  masks(device, lengths[-2:] if not args.dry_run else lengths, reps, gflop, times), ""]
    write_report("cuda.md", lines)


if __name__ == "__main__":
    main()
