"""Build-time report of the CUDA kernels, without a GPU: nvcc compiles
tests/ptx/attention_kernels_ptx.cu (the device code of
csrc/cuda/attention_kernels.h, every configuration launch.h instantiates) and
this prints, per kernel and architecture, ptxas's registers and spills, the
shared memory per block, the resident warps per SM those allow, and static
counts read from the sm_80 PTX of each kernel's main loop (the outermost loop
holding tensor-core mma instructions): PTX instructions per mma, ldmatrix and
cp.async instructions, and the global and shared loads by width.

    python scripts/kernel_report.py              # markdown to stdout
    python scripts/kernel_report.py --ptx F.ptx  # only the PTX counts of a file

tests/test_kernel_ptx.py reads the PTX with the functions below.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "ptx", "attention_kernels_ptx.cu")

# Per-SM limits of the architectures built (CUDA C Programming Guide, compute
# capabilities table): registers, resident warps and blocks, shared memory per
# SM and the most one block may use (each block also reserves 1 KiB).
LIMITS = {"sm_80": dict(regs=65536, warps=64, blocks=32, smem_sm=164 * 1024, smem_block=163 * 1024),
          "sm_90": dict(regs=65536, warps=64, blocks=32, smem_sm=228 * 1024, smem_block=227 * 1024)}


def nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    path = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return path if os.path.exists(path) else None


def compile_ptx(out_path, arch="sm_80", all_configs=False, scalar_operands=False):
    """PTX of the kernels; scalar_operands=True builds in the plain-load
    operand path (MHA_EXT_CUDA_OPERANDS=scalar, a build with
    MHA_EXT_SCALAR_OPERANDS=1); without it only the default's remain."""
    cmd = [nvcc(), "-std=c++20", "-O3", "-ptx", f"-arch={arch}", SOURCE, "-o", out_path]
    if all_configs:
        cmd.insert(1, "-DMHA_PTX_ALL")
    if scalar_operands:
        cmd.insert(1, "-DMHA_SCALAR_OPERANDS")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    with open(out_path) as f:
        return f.read()


def kernels(ptx):
    """{mangled name: body lines} of every entry in a PTX file."""
    out = {}
    for part in re.split(r"(?m)^(?=\.visible \.entry )", ptx):
        m = re.match(r"\.visible \.entry (\S+)\(", part)
        if not m:
            continue  # the module's header
        name = m.group(1)
        out[name] = [line.strip() for line in part.splitlines()]
    return out


def describe(mangled):
    """('fwd' | 'fwd-plain' | 'decode' | 'bwd' | 'dq', dtype, head dim) of a
    mangled kernel name (fwd-plain: the forward's plain kernel, 32 rows a
    warp; decode: the forward of at most 16 rows, warps sharing key tiles)."""
    kind = ("dq" if "bwd_dq_kernel" in mangled else "bwd" if "bwd_kernel" in mangled
            else "decode" if "decode_kernel" in mangled
            else "fwd-plain" if re.search(r"Li\d+ELb1E", mangled) else "fwd")
    dtype = ("bf16" if "nv_bfloat16" in mangled else "f16" if "__half" in mangled
             else "float" if "IfLi" in mangled else "double")
    return kind, dtype, int(re.search(r"Li(\d+)E", mangled).group(1))


def _instructions(lines):
    return [ln for ln in lines if ln and not ln.endswith(":") and ln[0] not in "/{}." and not ln.startswith("$")]


def main_loop(lines):
    """The instructions of the outermost loop (a backward branch and its
    target) that holds mma instructions; [] when none does."""
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"(\$L__BB\d+_\d+):", ln)
        if m:
            labels[m.group(1)] = i
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and labels.get(m.group(1), len(lines)) < i:
            lo = labels[m.group(1)]
            body = lines[lo:i + 1]
            if any("mma.sync" in x for x in body) and (best is None or i - lo > best[1] - best[0]):
                best = (lo, i)
    return _instructions(lines[best[0]:best[1] + 1]) if best else []


def loop_counts(body):
    """Static counts of a loop body: instructions, mma, ldmatrix, cp.async
    (16-byte), global / shared loads keyed by their width in bytes, atomics
    on a generic address (ptxas adds a shared-memory fallback to each) and
    global reductions (red.global)."""
    width = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4, "s32": 4, "b32": 4,
             "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}

    def loads(space):
        out = {}
        for ln in body:
            m = re.match(r"(?:@!?%p\d+\s+)?ld\." + space + r"(?:\.nc)?(?:\.(v[24]))?\.(\w+)", ln)
            if m:
                nbytes = width.get(m.group(2), 0) * (int(m.group(1)[1]) if m.group(1) else 1)
                out[nbytes] = out.get(nbytes, 0) + 1
        return out

    mma = sum("mma.sync" in ln for ln in body)
    return dict(instructions=len(body), mma=mma, mma_tf32=sum("mma.sync" in ln and ".tf32" in ln for ln in body),
                ldmatrix=sum(ln.startswith("ldmatrix") for ln in body),
                cp_async_16=sum(bool(re.match(r"(?:@!?%p\d+\s+)?cp\.async\.cg\.shared\.global.*, 16;", ln)) for ln in body),
                global_loads=loads("global"), shared_loads=loads("shared"),
                generic_atomics=sum(bool(re.match(r"(?:@!?%p\d+\s+)?atom\.(?!global|shared)", ln)) for ln in body),
                red_global=sum(bool(re.match(r"(?:@!?%p\d+\s+)?red\.global\.", ln)) for ln in body))


def ptxas_figures(arch, tmp):
    """{mangled name: (registers, spill store bytes)} from ptxas -v."""
    cmd = [nvcc(), "-std=c++20", "-O3", "-DMHA_PTX_ALL", "-cubin", f"-arch={arch}", "-Xptxas", "-v", SOURCE,
           "-o", os.path.join(tmp, f"{arch}.cubin")]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    out, name = {}, None
    for ln in res.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", ln)
        if m and name:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", ln)
        if m and name:
            out[name] = (int(m.group(1)), spill)
    return out


def shared_and_threads(tmp):
    """{(kind, dtype, head dim): (threads, shared bytes)} from TileConfig,
    read by a host program nvcc builds from the same header."""
    src = os.path.join(tmp, "tiles.cu")
    with open(src, "w") as f:
        f.write('#include "%s"\n#include <cstdio>\nusing namespace mha_ext::device;\n' %
                os.path.join(ROOT, "csrc", "cuda", "attention_kernels.h"))
        f.write("template <typename T, int D> void show(const char* n) {\n  using C = TileConfig<T, D>;\n"
                '  printf("fwd %s %d %d %d\\n", n, D, 32 * C::kFwdWarps, C::kFwdSharedBytes);\n'
                '  if (C::kFwdWideWarps != C::kFwdWarps)\n'
                '    printf("fwd128 %s %d %d %d\\n", n, D, 32 * C::kFwdWideWarps, C::fwd_shared_bytes(C::kFwdWideWarps));\n'
                '  if (C::kFwdRowTiles > 1) {\n'
                '    printf("fwd-plain %s %d %d %d\\n", n, D, 32 * C::kFwdWarps / C::kFwdRowTiles, C::kFwdSharedBytes);\n'
                '    printf("fwd-plain128 %s %d %d %d\\n", n, D, 32 * C::kFwdWideWarps / C::kFwdRowTiles,\n'
                '           C::fwd_shared_bytes(C::kFwdWideWarps));\n  }\n'
                '  if (C::kElem == 2)\n'
                '    printf("decode %s %d %d %d\\n", n, D, 32 * C::kFwdBlockN / 16,\n'
                '           C::kElem * (16 + 2 * C::kFwdKVStages * C::kFwdBlockN) * C::kLd);\n'
                '  printf("bwd %s %d %d %d\\n", n, D, 32 * C::kBwdWarps, C::kBwdSharedBytes);\n'
                '  printf("dq %s %d %d %d\\n", n, D, 32 * C::kBwdWarps, C::kBwdDqSharedBytes);\n}\nint main() {\n')
        for t, n in (("f16", "f16"), ("bf16", "bf16"), ("float", "float"), ("double", "double")):
            for d in (64, 128, 256):
                f.write(f'  show<{t}, {d}>("{n}");\n')
        f.write("}\n")
    exe = os.path.join(tmp, "tiles")
    subprocess.run([nvcc(), "-std=c++20", "-arch=sm_80", src, "-o", exe], check=True, capture_output=True, text=True, timeout=300)
    out = {}
    for ln in subprocess.run([exe], check=True, capture_output=True, text=True).stdout.splitlines():
        kind, dtype, d, threads, smem = ln.split()
        out[(kind, dtype, int(d))] = (int(threads), int(smem))
    return out


def warps_per_sm(arch, regs, threads, smem):
    lim = LIMITS[arch]
    warps = threads // 32
    regs_per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = lim["regs"] // regs_per_warp // warps
    by_smem = lim["smem_sm"] // (smem + 1024) if smem <= lim["smem_block"] else 0
    by_warps = lim["warps"] // warps
    return min(by_regs, by_smem, by_warps, lim["blocks"]) * warps


def fmt_loads(d):
    return ", ".join(f"{n} x {b} B" for b, n in sorted(d.items())) or "none"


def ptx_table(ptx):
    rows = ["| kernel | PTX instr. / mma | mma | ldmatrix | cp.async 16 B | global loads (count x bytes) | shared loads |",
            "|---|---|---|---|---|---|---|"]
    for name, lines in kernels(ptx).items():
        kind, dtype, d = describe(name)
        c = loop_counts(main_loop(lines))
        if not c["mma"]:
            continue
        rows.append(f"| {kind} {dtype} {d} | {c['instructions'] / c['mma']:.1f} | {c['mma']} | {c['ldmatrix']} | "
                    f"{c['cp_async_16']} | {fmt_loads(c['global_loads'])} | {fmt_loads(c['shared_loads'])} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx", help="print the main-loop counts of this PTX file only")
    args = ap.parse_args()
    if nvcc() is None:
        sys.exit("needs nvcc (a CUDA toolkit)")
    if args.ptx:
        print("\n".join(ptx_table(open(args.ptx).read())))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tiles = shared_and_threads(tmp)
        figs = {arch: ptxas_figures(arch, tmp) for arch in LIMITS}
        ptx = compile_ptx(os.path.join(tmp, "all.ptx"), all_configs=True, scalar_operands=False)
    rows = ["| kernel | threads | shared KiB | registers sm_80 / sm_90 | spill stores (bytes) | warps / SM sm_80 / sm_90 |",
            "|---|---|---|---|---|---|"]
    # (the attention kernels, each of a head dim; not the bool mask's range scan)
    attention = [n for n in figs["sm_80"] if "mask_ranges" not in n]
    for name in sorted(attention, key=lambda n: (describe(n)[0], describe(n)[1], describe(n)[2])):
        base = describe(name)
        # the forward also runs with 128-row tiles (16-bit types): the same kernel, more threads
        wide = (base[0] + "128",) + base[1:]
        for key in [base] + ([wide] if base[0].startswith("fwd") and wide in tiles else []):
            threads, smem = tiles[key]
            r80, s80 = figs["sm_80"][name]
            r90, s90 = figs["sm_90"][name]
            spills = "0" if s80 == s90 == 0 else f"{s80} / {s90}"
            rows.append(f"| {key[0]} {key[1]} {key[2]} | {threads} | {smem / 1024:.1f} | {r80} / {r90} | {spills} | "
                        f"{warps_per_sm('sm_80', r80, threads, smem)} / {warps_per_sm('sm_90', r90, threads, smem)} |")
    print("\n".join(rows + ["", "Main loops, sm_80 PTX without the plain-load operand path (static counts):", ""] +
                    ptx_table(ptx)))


if __name__ == "__main__":
    main()
