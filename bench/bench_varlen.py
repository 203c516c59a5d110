"""Variable-length batches: sequences whose lengths are uniform in 25-100% of
the longest, run packed (mha_ext.varlen_attention, no work on padding)
against the padded batch with a key padding mask (mha_ext's dense op and
F.scaled_dot_product_attention), and mha_ext.MultiheadAttention (which packs
a bool key_padding_mask itself) against torch.nn.MultiheadAttention, and
the same lengths as nested tensors of the jagged layout through both SDPAs. One
process, interleaved, medians. The attention op's allocations are shown too:
the fused paths never hold an L x S matrix per head.

    python bench/bench_varlen.py            # a few minutes
    python bench/bench_varlen.py --quick

Writes markdown to bench/out/varlen.md and prints it.
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
from bench_attention import cpu_name, geomean, median_times, write_report  # noqa: E402


def lengths_for(B, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo = max(1, L // 4)
    return torch.randint(lo, L + 1, (B,), generator=g).tolist()


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def op_fns(B, H, L, D, dtype, backward, seed=0):
    """(packed mha_ext, padded mha_ext, padded torch SDPA) on the same data."""
    lens = lengths_for(B, L, seed)
    pad = torch.arange(L)[None, :] >= torch.tensor(lens)[:, None]  # (B, L) True = padding
    x = [torch.randn(B, L, H, D, dtype=dtype) for _ in range(3)]
    keep = ~pad
    packed = [t[keep].clone().requires_grad_(backward) for t in x]  # (total, H, D)
    dense = [t.transpose(1, 2).clone().requires_grad_(backward) for t in x]  # (B, H, L, D)
    mask = keep[:, None, None, :]  # (B, 1, 1, L): True = may attend
    c = cu(lens)

    def run(fn):
        def go():
            out = fn()
            if backward:
                out.sum().backward()
        return go

    fns = [run(lambda: mha_ext.varlen_attention(*packed, c, c, L, L)),
           run(lambda: mha_ext.scaled_dot_product_attention(*dense, attn_mask=mask)),
           run(lambda: F.scaled_dot_product_attention(*dense, attn_mask=mask))]
    return fns, sum(lens) / (B * L)


def module_fns(B, L, E, H, dtype, backward, seed=0):
    lens = lengths_for(B, L, seed)
    pad = torch.arange(L)[None, :] >= torch.tensor(lens)[:, None]
    ours = mha_ext.MultiheadAttention(E, H, batch_first=True).to(dtype)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(B, L, E, dtype=dtype, requires_grad=backward)
    # the same padding as a float mask (-inf): mha_ext's module masks it in the dense op instead
    float_pad = torch.zeros(B, L, dtype=dtype).masked_fill(pad, float("-inf"))

    def run(m, mask):
        def go():
            out = m(x, x, x, key_padding_mask=mask, need_weights=False)[0]
            if backward:
                out.sum().backward()
        return go

    # the same rows as a nested tensor (N, j, E): no padding at all
    xn = torch.nested.nested_tensor([x[b, :n].detach() for b, n in enumerate(lens)], layout=torch.jagged,
                                    requires_grad=backward)

    def nested():
        out = ours(xn, xn, xn, need_weights=False)[0]
        if backward:
            torch.autograd.grad(out.values().sum(), [xn] + list(ours.parameters()))

    return [run(ours, pad), run(ours, float_pad), run(theirs, pad), nested]


def nested_fns(B, H, L, D, dtype, backward, is_causal, seed=0):
    """(mha_ext's SDPA, torch's SDPA) on the same jagged nested tensors
    (B, H, j, D), lengths as op_fns's."""
    lens = lengths_for(B, L, seed)
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.nested.nested_tensor([torch.randn(n, H * D, generator=g).to(dtype) for n in lens],
                                         layout=torch.jagged, requires_grad=backward) for _ in range(3)]

    def run(fn):
        def go():
            q, k, v = (t.unflatten(-1, [H, D]).transpose(1, 2) for t in leaves)
            out = fn(q, k, v, is_causal=is_causal)
            if backward:  # (into fresh grads: accumulating nested grads fails inside torch)
                torch.autograd.grad(out.values().sum(), leaves)
        return go

    return [run(mha_ext.scaled_dot_product_attention), run(F.scaled_dot_product_attention)]


def cases(args, shapes):
    """(dtype name, dtype, backward, pass label, shape) of a table, in its order."""
    for name in args.dtypes.split(","):
        for backward in (False, True):
            for shape in shapes:
                yield name, getattr(torch, name), backward, "fwd+bwd" if backward else "fwd", shape


def peak_bytes(fn):
    """The most bytes any one op allocated while fn ran (torch's profiler,
    summed over that op's calls): for one attention call, its own buffers."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.cpu_memory_usage > 0]
    return max([e.cpu_memory_usage for e in events] + [0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    op_shapes = [(16, 12, 512, 64), (8, 12, 2048, 64)] if not args.quick else [(16, 12, 256, 64)]
    lines = [f"# Variable-length batches: packed vs padded, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, mha_ext CPU path "
             f"{mha_ext.ops.cpu_isa()}; `python bench/bench_varlen.py {' '.join(sys.argv[1:])}`; medians of "
             f"{args.reps} interleaved runs. Lengths uniform in 25-100% of the longest (L); `fill` = real rows / "
             "padded rows. Packed: mha_ext.varlen_attention on the real rows only; padded: the (B, H, L, D) batch "
             "with a (B, 1, 1, L) bool key padding mask.", "",
             "## The op", "",
             "| dtype | pass | B, H, L, D | fill | packed ms | padded mha_ext ms | padded SDPA ms "
             "| padded mha_ext / packed | SDPA / packed |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for name, dtype, backward, pass_, (B, H, L, D) in cases(args, op_shapes):
        fns, fill = op_fns(B, H, L, D, dtype, backward)
        t = median_times(fns, args.reps)
        ratios.append(t[2] / t[0])
        lines.append(f"| {name} | {pass_} | {B}, {H}, {L}, {D} | {fill:.2f} | {t[0] * 1e3:.2f} | {t[1] * 1e3:.2f} | "
                     f"{t[2] * 1e3:.2f} | {t[1] / t[0]:.2f} | {t[2] / t[0]:.2f} |")
    lines += ["", f"Geomean SDPA / packed: {geomean(ratios):.2f}.", "",
              "## MultiheadAttention with a bool key_padding_mask", "",
              "mha_ext.MultiheadAttention packs the unpadded keys (varlen) when key_padding_mask is bool and "
              "there is no attn_mask (packed); given the same padding as a float mask it masks them in the dense op "
              "(masked), as torch.nn.MultiheadAttention does; nested: the real rows as a nested tensor (N, j, E) of "
              "the jagged layout (no padding anywhere: projections included), which torch's module refuses outside "
              "inference. need_weights=False.", "",
              "| dtype | pass | B, L, E, H | torch ms | mha_ext masked ms | mha_ext packed ms | mha_ext nested ms "
              "| masked / packed | torch / packed | torch / nested |", "|---|---|---|---|---|---|---|---|---|---|"]
    mod_shapes = [(16, 512, 768, 12)] if not args.quick else [(8, 256, 256, 4)]
    for name, dtype, backward, pass_, (B, L, E, H) in cases(args, mod_shapes):
        t = median_times(module_fns(B, L, E, H, dtype, backward), args.reps)
        lines.append(f"| {name} | {pass_} | {B}, {L}, {E}, {H} | {t[2] * 1e3:.2f} | {t[1] * 1e3:.2f} | "
                     f"{t[0] * 1e3:.2f} | {t[3] * 1e3:.2f} | {t[1] / t[0]:.2f} | {t[2] / t[0]:.2f} | "
                     f"{t[2] / t[3]:.2f} |")
    lines += ["", "## Nested tensors (torch's jagged layout)", "",
              "The same lengths as nested tensors (B, H, j, D) of layout torch.jagged, through "
              "mha_ext.scaled_dot_product_attention (the varlen op on the packed buffers) and "
              "F.scaled_dot_product_attention (on the CPU: each sequence copied into a strided nested tensor and "
              "run by its math kernel; with is_causal it fails on this machine: a CUDA build of torch without a "
              "GPU). Forward+backward: "
              "to the nested leaves.", "",
              "| dtype | pass | B, H, L, D | causal | mha_ext ms | torch ms | torch / mha_ext |",
              "|---|---|---|---|---|---|---|"]
    nested_ratios = []
    for name, dtype, backward, pass_, (B, H, L, D) in cases(args, op_shapes):
        for causal in (False, True):
            fns = nested_fns(B, H, L, D, dtype, backward, causal)
            row = f"| {name} | {pass_} | {B}, {H}, {L}, {D} | {causal} | "
            try:
                fns[1]()
            except Exception as e:  # torch's jagged path with is_causal, a CUDA build of torch without a GPU
                t = median_times(fns[:1], args.reps)
                lines.append(row + f"{t[0] * 1e3:.2f} | fails ({type(e).__name__}) | |")
                continue
            t = median_times(fns, args.reps)
            nested_ratios.append(t[1] / t[0])
            lines.append(row + f"{t[0] * 1e3:.2f} | {t[1] * 1e3:.2f} | {t[1] / t[0]:.2f} |")
    if nested_ratios:
        lines += ["", f"Geomean torch / mha_ext on nested tensors: {geomean(nested_ratios):.2f}."]
    B, H, L, D = op_shapes[-1]
    fns, _ = op_fns(B, H, L, D, torch.float32, False)
    peaks = [peak_bytes(f) for f in fns]
    lines += ["", f"Bytes allocated by the attention op in one float32 forward at B, H, L, D = {B}, {H}, {L}, {D} "
              "(torch profiler, the op with the most): "
              f"packed {peaks[0] / 2**20:.1f} MiB, padded mha_ext {peaks[1] / 2**20:.1f} MiB, padded SDPA "
              f"{peaks[2] / 2**20:.1f} MiB; one L x L float32 score matrix per head would be "
              f"{B * H * L * L * 4 / 2**20:.0f} MiB."]
    write_report("varlen.md", lines)


if __name__ == "__main__":
    main()
