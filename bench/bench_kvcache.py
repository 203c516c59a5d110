"""A generation loop against a KV cache: mha_ext.kvcache_attention on a
preallocated cache written in place (contiguous, and paged: blocks of 256
rows at shuffled places of a pool), against what transformers' DynamicCache
does (the whole history concatenated every step, then attention) with
F.scaled_dot_product_attention and with mha_ext's SDPA. One process, the
loops interleaved, medians.

    python bench/bench_kvcache.py            # 512 steps after a 1024-token prompt
    python bench/bench_kvcache.py --quick

A second table: one decode step of a batch whose caches hold different
numbers of keys (one long among short ones), mha_ext.kvcache_attention
against F.scaled_dot_product_attention on the padded cache with a key mask
(what a torch user runs for such a batch), calls interleaved, medians.

A third: one step of 1 or 4 query rows a head (4 or 16 rows a key/value
head) against a full (B, S, H, D) cache and the same cache stored head-major
((B, H, S, D) in memory, passed as (B, S, H, D) views), beside a streaming
read, interleaved, medians.

    python bench/bench_kvcache.py --tables layout   # only that table

Writes markdown to bench/out/kvcache.md and prints it.
"""
import argparse
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mha_ext  # noqa: E402
from bench_attention import cpu_name, median_times, write_report  # noqa: E402
import bench_decode  # noqa: E402  (its interleaved streaming read)


def loops(B, hq, hkv, D, prompt, steps, dtype):
    """(in-place cache, concatenating cache + torch SDPA, concatenating cache + mha_ext SDPA, paged
    in-place cache): each a function running the whole decode loop (one new token a step) after
    the prompt is cached."""
    g = torch.Generator().manual_seed(0)
    new = [(torch.randn(B, 1, hq, D, generator=g).to(dtype), torch.randn(B, 1, hkv, D, generator=g).to(dtype),
            torch.randn(B, 1, hkv, D, generator=g).to(dtype)) for _ in range(steps)]
    pk, pv = torch.randn(B, prompt, hkv, D, generator=g).to(dtype), torch.randn(B, prompt, hkv, D, generator=g).to(dtype)

    def in_place():
        kc = torch.zeros(B, prompt + steps, hkv, D, dtype=dtype)
        vc = torch.zeros(B, prompt + steps, hkv, D, dtype=dtype)
        kc[:, :prompt], vc[:, :prompt] = pk, pv
        sl = torch.full((B,), prompt, dtype=torch.int32)
        for q, k, v in new:
            mha_ext.kvcache_attention(q, kc, vc, sl, k, v)
            sl += 1

    def paged(block=256):
        per = (prompt + steps + block - 1) // block
        table = torch.randperm(B * per, generator=torch.Generator().manual_seed(1)).view(B, per).to(torch.int32)
        kc, vc = torch.zeros(B * per, block, hkv, D, dtype=dtype), torch.zeros(B * per, block, hkv, D, dtype=dtype)
        for b in range(B):
            for i in range(prompt // block + 1):
                n = min(block, prompt - i * block)
                if n > 0:
                    kc[table[b, i], :n], vc[table[b, i], :n] = pk[b, i * block:i * block + n], pv[b, i * block:i * block + n]
        sl = torch.full((B,), prompt, dtype=torch.int32)
        for q, k, v in new:
            mha_ext.kvcache_attention(q, kc, vc, sl, k, v, block_table=table)
            sl += 1

    def concatenating(attend):
        def run():
            hk, hv = pk.transpose(1, 2), pv.transpose(1, 2)  # (B, Hkv, S, D) as DynamicCache keeps them
            for q, k, v in new:
                hk, hv = torch.cat([hk, k.transpose(1, 2)], 2), torch.cat([hv, v.transpose(1, 2)], 2)
                attend(q.transpose(1, 2), hk, hv, enable_gqa=True)
        return run

    return [in_place, concatenating(F.scaled_dot_product_attention),
            concatenating(mha_ext.scaled_dot_product_attention), paged]


def ragged_rows(reps):
    """Markdown rows: one step (a query row a head) against caches of different lengths."""
    cases = [((32768, 1024, 1024, 1024), 32, 8, 128), ((16384, 16384) + (512,) * 6, 32, 8, 128),
             ((8192,) + (256,) * 15, 12, 12, 64)]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for lens, hq, hkv, D in cases:
            g = torch.Generator().manual_seed(0)
            B, S = len(lens), max(lens)
            q = torch.randn(B, 1, hq, D, generator=g).to(dtype)
            kc, vc = (torch.randn(B, S, hkv, D, generator=g).to(dtype) for _ in range(2))
            seqlens = torch.tensor(lens, dtype=torch.int32)
            keep = (torch.arange(S) < seqlens[:, None])[:, None, None, :]  # (B, 1, 1, S)
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            # the same caches stored head-major, (B, H, S, D) in memory, passed as (B, S, H, D) views
            kh, vh = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
            fns = [lambda: mha_ext.kvcache_attention(q, kc, vc, seqlens),
                   lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, enable_gqa=hq != hkv),
                   lambda: mha_ext.kvcache_attention(q, kh, vh, seqlens), bench_decode.stream_read]
            ta, tb, th, ts = median_times(fns, reps)
            kv = 2 * sum(lens) * hkv * D * kc.element_size()
            sb = bench_decode.STREAM.numel() * 4 / ts / 1e9
            shown = ", ".join(str(n) for n in lens[:3]) + (", .." if B > 3 else "")
            rows.append(f"| {str(dtype).replace('torch.', '')} | {B}, {hq}, {hkv}, {D} | {shown} | {ta * 1e3:.3f} | "
                        f"{tb * 1e3:.3f} | {tb / ta:.2f} | {kv / ta / 1e9:.1f} | {kv / th / 1e9:.1f} | {sb:.1f} | "
                        f"{100 * kv / ta / 1e9 / sb:.0f}% | {100 * kv / th / 1e9 / sb:.0f}% |")
            print(rows[-1], flush=True)
    return rows


def layout_rows(reps):
    """Markdown rows: one step of L query rows a head against a full (B, S, H, D) cache and the same
    cache stored head-major, with a streaming read run between them in each rep."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for B, S in ((1, 32768), (4, 16384)):
            for L in (1, 4):
                hq, hkv, D = 32, 8, 128
                g = torch.Generator().manual_seed(0)
                q = torch.randn(B, L, hq, D, generator=g).to(dtype)
                kc, vc = (torch.randn(B, S, hkv, D, generator=g).to(dtype) for _ in range(2))
                kh, vh = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
                sl = torch.full((B,), S - L, dtype=torch.int32)  # the step's rows are the cache's last L
                fns = [lambda: mha_ext.kvcache_attention(q, kc, vc, sl),
                       lambda: mha_ext.kvcache_attention(q, kh, vh, sl), bench_decode.stream_read]
                ta, th, ts = median_times(fns, reps)
                kv = 2 * B * S * hkv * D * kc.element_size()
                sb = bench_decode.STREAM.numel() * 4 / ts / 1e9
                rows.append(f"| {str(dtype).replace('torch.', '')} | {B}, {hq}, {hkv}, {D} | {S} | {L} | "
                            f"{ta * 1e3:.3f} | {th * 1e3:.3f} | {th / ta:.2f} | {kv / ta / 1e9:.1f} | "
                            f"{kv / th / 1e9:.1f} | {sb:.1f} | {100 * kv / ta / 1e9 / sb:.0f}% | "
                            f"{100 * kv / th / 1e9 / sb:.0f}% |")
                print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tables", default="loop,ragged,layout", help="which tables, comma-separated")
    args = ap.parse_args()
    tables = set(args.tables.split(","))
    steps, prompt = (64, 512) if args.quick else (512, 1024)
    shapes = [(1, 32, 8, 128), (4, 32, 8, 128), (4, 12, 12, 64)]
    machine = (f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, mha_ext CPU path "
               f"{mha_ext.ops.cpu_isa()}; `python bench/bench_kvcache.py {' '.join(sys.argv[1:])}`.")
    lines = [f"# KV-cache decode loop, {datetime.date.today()}", "", machine]
    if "loop" in tables:
        lines[-1] += (
            f" The decode loop: {steps} steps of one token after a {prompt}-token prompt, whole loops interleaved, "
            f"medians of {args.reps}. In place: mha_ext.kvcache_attention writing each step's key and value into a "
            "preallocated cache; concatenating: the history concatenated every step (transformers' DynamicCache), "
            "then attention; paged: the same op on a pool of 256-row blocks at shuffled places (block_table), read "
            "in place.")
        lines += ["", "| dtype | B, Hq, Hkv, D | in place ms/step | concat + torch SDPA ms/step | concat + mha_ext SDPA "
                  "ms/step | torch / in place | paged ms/step | paged / in place |", "|---|---|---|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16) if "loop" in tables else ():
        for B, hq, hkv, D in shapes:
            fns = loops(B, hq, hkv, D, prompt, steps, dtype)
            times = [[] for _ in fns]
            for _ in range(args.reps):
                for i, fn in enumerate(fns):
                    t = time.perf_counter()
                    fn()
                    times[i].append((time.perf_counter() - t) / steps)
            med = [sorted(t)[len(t) // 2] for t in times]
            lines.append(f"| {str(dtype).replace('torch.', '')} | {B}, {hq}, {hkv}, {D} | {med[0] * 1e3:.3f} | "
                         f"{med[1] * 1e3:.3f} | {med[2] * 1e3:.3f} | {med[1] / med[0]:.2f} | {med[3] * 1e3:.3f} | "
                         f"{med[3] / med[0]:.2f} |")
    lines += ["", "One step against caches of different lengths (a query row a head): mha_ext.kvcache_attention "
              "against F.scaled_dot_product_attention on the padded cache with a boolean key mask; medians of "
              f"{3 * args.reps} interleaved calls; K/V GB/s counts the keys each batch holds; beside them, the "
              "same op on the same caches stored head-major ((B, H, S, D) in memory, passed as (B, S, H, D) "
              "views) and a streaming read (a sum over 512 MiB of float32) run between them in each rep, "
              "with both layouts' K/V rate as a share of it.", "",
              "| dtype | B, Hq, Hkv, D | cache lengths | mha_ext ms | torch SDPA + mask ms | torch / mha_ext | "
              "mha_ext K/V GB/s | head-major cache K/V GB/s | stream GB/s | % of stream | head-major % of stream |",
              "|---|---|---|---|---|---|---|---|---|---|---|"] if "ragged" in tables else []
    if "ragged" in tables:
        lines += ragged_rows(3 * args.reps)
    if "layout" in tables:
        lines += ["", "One step of L query rows a head (4 L rows a key/value head) against a full (B, S, H, D) "
                  "cache and the same cache stored head-major ((B, H, S, D) in memory, passed as (B, S, H, D) "
                  f"views), with a streaming read (a sum over 512 MiB of float32) between them; medians of "
                  f"{3 * args.reps} interleaved reps.", "",
                  "| dtype | B, Hq, Hkv, D | S | L | (B, S, H, D) ms | head-major ms | head-major / (B, S, H, D) "
                  "| (B, S, H, D) K/V GB/s | head-major K/V GB/s | stream GB/s | (B, S, H, D) % of stream "
                  "| head-major % of stream |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += layout_rows(3 * args.reps)
    write_report("kvcache.md", lines)


if __name__ == "__main__":
    main()
