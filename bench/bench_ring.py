"""Ring attention on this machine: 1, 2 and 4 processes (gloo), a causal
forward+backward over a sequence sharded in the zigzag layout; per rank the
median time and how much the process's peak resident memory grew during its
first step (the inputs were already allocated).
With 2 cores, 4 processes share them: the times show the work split, not a
speed-up.

    python bench/bench_ring.py            # total lengths 4k, 8k, 16k
    python bench/bench_ring.py --quick

Writes markdown to bench/out/ring.md and prints it.
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _worker(rank, world, init_file, L, H, D, reps, results):
    import torch.distributed as dist

    import resource

    import mha_ext  # noqa: F401
    from mha_ext.distributed import ring_attention, shard

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(1, H, L, D, generator=g), rank, world).requires_grad_() for _ in range(3))

    def step():
        out = ring_attention(q, k, v, causal=True)
        out.sum().backward()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB -> bytes
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    results.put((rank, statistics.median(times), grown))
    dist.destroy_process_group()


def run(world, L, H, D, reps):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(d, "init"), L, H, D, reps, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = [results.get(timeout=1800) for _ in range(world)]
        for p in procs:
            p.join()
    return max(t for _, t, _ in got), max(m for _, _, m in got)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from bench_attention import cpu_name, write_report

    lengths = [4096] if args.quick else [4096, 8192, 16384]
    H, D = 4, 64
    lines = [f"# Ring attention, causal forward+backward, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads shared by the processes, torch {torch.__version__}; "
             f"`python bench/bench_ring.py {' '.join(sys.argv[1:])}`; 1 x {H} heads x {D}, float32, zigzag layout, "
             f"gloo; the slowest rank's median of {args.reps} steps and the largest growth of a rank's peak resident "
             "memory during its first step (its shards of q, k, v already allocated).", "",
             "| total L | processes | step s | peak growth MiB per rank |", "|---|---|---|---|"]
    for L in lengths:
        for world in (1, 2, 4):
            t, peak = run(world, L, H, D, args.reps)
            lines.append(f"| {L} | {world} | {t:.2f} | {peak / 2**20:.1f} |")
    write_report("ring.md", lines)


if __name__ == "__main__":
    main()
