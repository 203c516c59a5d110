"""Ring attention on this machine: 1, 2 and 4 processes (gloo), a causal
forward+backward over a sequence sharded in the zigzag layout; per rank the
median time, how much the process's peak resident memory grew during its
first step (the inputs were already allocated), and how much of the ring's
communication compute hid.
With 2 cores, 4 processes share them: the times show the work split, not a
speed-up.

    python bench/bench_ring.py            # total lengths 4k, 8k, 16k, 32k
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
    from mha_ext.distributed import _Ring, ring_attention, shard

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(1, H, L, D, generator=g), rank, world).requires_grad_() for _ in range(3))

    def step():
        out = ring_attention(q, k, v, causal=True)
        out.sum().backward()

    def transfers_alone():
        # the step's transfers with no compute between start and finish: the
        # forward's W - 1 key/value shards, the backward's W - 1 key/value
        # shards and W float32 gradient sums of their shape
        ring = _Ring(None, rank, world)
        for _ in range(world - 1):
            _Ring.finish(ring.start([k.detach(), v.detach()]))
        for _ in range(world - 1):
            _Ring.finish(ring.start([k.detach(), v.detach()]))
        for _ in range(world if world > 1 else 0):
            _Ring.finish(ring.start([torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB -> bytes
    times, waits, alone = [], [], []
    for _ in range(reps):
        dist.barrier()
        _Ring.waited_s = 0.0
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        waits.append(_Ring.waited_s)
        dist.barrier()
        t = time.perf_counter()
        transfers_alone()
        alone.append(time.perf_counter() - t)
    results.put((rank, times, grown, waits, statistics.median(alone)))
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
    # per step the slowest rank: its time is the step's, and its waits are the
    # transfer time left on the critical path (a faster rank also waits for it)
    reps = len(got[0][1])
    slowest = [max(got, key=lambda g: g[1][i]) for i in range(reps)]
    step_t = statistics.median(g[1][i] for i, g in enumerate(slowest))
    waited = statistics.median(g[3][i] for i, g in enumerate(slowest))
    return step_t, max(g[2] for g in got), waited, max(g[4] for g in got)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from bench_attention import cpu_name, write_report

    lengths = [4096] if args.quick else [4096, 8192, 16384, 32768]
    H, D = 4, 64
    lines = [f"# Ring attention, causal forward+backward, {datetime.date.today()}", "",
             f"{cpu_name()}, {torch.get_num_threads()} threads shared by the processes, torch {torch.__version__}; "
             f"`python bench/bench_ring.py {' '.join(sys.argv[1:])}`; 1 x {H} heads x {D}, float32, zigzag layout, "
             f"gloo; the median over {args.reps} steps of the slowest rank's time and the largest growth of a rank's peak resident "
             "memory during its first step (its shards of q, k, v already allocated). Communication: the time "
             "the slowest rank of each step spent blocked on ring transfers (`waited`, median over steps; a "
             "faster rank also waits for the slowest one's compute, which is not transfer time) beside the "
             "largest over the ranks of the median time of the same transfers run alone, one after another with no compute "
             "(`alone`); hidden = 1 - waited / alone. The backward's last transfer (the gradient sums reaching "
             "their owners) has no compute left to hide behind: 1 of the step's 3W - 2 transfers.", "",
             "| total L | processes | step s | peak growth MiB per rank | waited s | transfers alone s | hidden |",
             "|---|---|---|---|---|---|---|"]
    for L in lengths:
        for world in (1, 2, 4):
            t, peak, waited, alone = run(world, L, H, D, args.reps)
            hidden = f"{max(0.0, 1 - waited / alone):.0%}" if world > 1 else "-"
            lines.append(f"| {L} | {world} | {t:.2f} | {peak / 2**20:.1f} | {waited:.3f} | {alone:.3f} | {hidden} |")
    write_report("ring.md", lines)


if __name__ == "__main__":
    main()
