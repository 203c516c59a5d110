"""mha_ext.distributed.ring_attention on real torch.distributed process
groups (gloo, 2 and 4 CPU processes on this machine): each rank's shard of
the output and of the q, k, v gradients against single-process
mha_ext.scaled_dot_product_attention on the whole sequence, for both
layouts, causal and not, GQA, dropout (the mask of the whole sequence for
the same seed), float64 and float32 (half and bfloat16 to one rounding); a group of size 1; and
mismatched shards raising the same error on every rank (never a hang: each
launch has a timeout). Data-parallel training of a model built on
mha_ext.MultiheadAttention under DDP (also compiled) and FSDP2 against one
process on the whole batch. NCCL: the same code; the GPU test skips with a
reason without two GPUs."""
import os
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 240


def _worker(rank, world, init_file, task, results, backend="gloo"):
    import torch.distributed as dist

    import mha_ext
    from mha_ext.distributed import ring_attention, shard

    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = []
        if task == "parity":
            for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
                for causal in (False, True):
                    for layout in ("contiguous", "zigzag"):
                        for hkv, p in ((4, 0.0), (2, 0.0), (2, 0.25)):
                            g = torch.Generator().manual_seed(7)
                            # with dropout, chunks of 5: the blocks start at columns off the Philox groups of 4
                            L = 2 * world * (5 if p > 0 else 6)
                            q = torch.randn(2, 4, L, 16, generator=g, dtype=torch.float64).to(dev, dtype)
                            k = torch.randn(2, hkv, L, 16, generator=g, dtype=torch.float64).to(dev, dtype)
                            v = torch.randn(2, hkv, L, 8, generator=g, dtype=torch.float64).to(dev, dtype)
                            go = torch.randn(2, 4, L, 8, generator=g, dtype=torch.float64).to(dev, dtype)
                            xs = [t.clone().requires_grad_() for t in (q, k, v)]
                            torch.manual_seed(11)
                            ref = mha_ext.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=hkv != 4,
                                                                      dropout_p=p)
                            ref_grads = torch.autograd.grad(ref, xs, go)
                            mine = [shard(t, rank, world, layout).detach().requires_grad_() for t in (q, k, v)]
                            torch.manual_seed(11)
                            o = ring_attention(*mine, causal=causal, layout=layout, dropout_p=p)
                            grads = torch.autograd.grad(o, mine, shard(go, rank, world, layout))
                            errs = [(o - shard(ref, rank, world, layout)).abs().max().item()]
                            errs += [(a - shard(b, rank, world, layout)).abs().max().item()
                                     for a, b in zip(grads, ref_grads)]
                            if p > 0:  # the mask matters: without it the output is far from the reference
                                plain = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                            enable_gqa=True)
                                assert (plain - ref).abs().max().item() > 0.1
                            out.append(((str(dtype), causal, layout, hkv, p), max(errs), tol))
        elif task == "halfs":  # half and bfloat16: the error of one rounding of the inputs' dtype
            for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
                for causal in (False, True):
                    g = torch.Generator().manual_seed(5)
                    L = 2 * world * 16
                    q, k, v, go = (torch.randn(2, h, L, 32, generator=g).to(dev, dtype) for h in (4, 2, 2, 4))
                    xs = [t.clone().requires_grad_() for t in (q, k, v)]
                    ref = mha_ext.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=True)
                    ref_grads = torch.autograd.grad(ref, xs, go)
                    mine = [shard(t, rank, world).detach().requires_grad_() for t in (q, k, v)]
                    o = ring_attention(*mine, causal=causal)
                    grads = torch.autograd.grad(o, mine, shard(go, rank, world))
                    assert all(t.dtype == dtype for t in (o, *grads))
                    errs = [((a - shard(b, rank, world)).abs() / (1 + shard(b, rank, world).abs())).max().item()
                            for a, b in zip((o, *grads), (ref, *ref_grads))]
                    out.append(((str(dtype), causal), max(errs), tol))
        elif task in ("ddp", "fsdp", "ddp+compile"):
            out.append(_train(task, rank, world))
        elif task == "mismatch":
            L = 8 if rank == 0 else 10  # shards of unequal length
            q = torch.randn(1, 2, L, 8)
            try:
                ring_attention(q, q, q, layout="contiguous")
                out.append("no error")
            except RuntimeError as e:
                out.append(str(e))
            # 3 key/value heads (not dividing 4) fail the op's checks, run before any transfer:
            # on rank 1 only, then on every rank
            for heads in (4 if rank == 0 else 3, 3):
                kv = torch.randn(1, heads, 8, 8)
                try:
                    ring_attention(torch.randn(1, 4, 8, 8), kv, kv, dropout_p=0.1)
                    out.append("no error")
                except RuntimeError as e:
                    out.append(str(e))
        results.put((rank, out))
    except Exception:
        results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class _Tiny(torch.nn.Module):
    """A small attention model built on mha_ext.MultiheadAttention."""

    def __init__(self):
        super().__init__()
        import mha_ext

        self.inp = torch.nn.Linear(8, 32)
        self.attn = mha_ext.MultiheadAttention(32, 4, batch_first=True)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.attn(h, h, h, need_weights=False)[0])


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 10, 8, generator=g), torch.randn(8, 10, 8, generator=g)


def _train(kind, rank, world, steps=3):
    """Trains _Tiny under DDP or FSDP2 on this rank's part of the batch; returns
    the largest difference of its parameters from the same model trained in one
    process on the whole batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ref = _Tiny()
    torch.manual_seed(0)
    model = _Tiny()
    if kind.startswith("ddp"):
        wrapped = DistributedDataParallel(model)
        if kind == "ddp+compile":  # the op's fake kernels let the wrapped model compile
            wrapped = torch.compile(wrapped, backend="aot_eager")
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    x, y = _data()
    n = x.shape[0] // world
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    diff = 0.0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        diff = max(diff, (full.detach() - r.detach()).abs().max().item())
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), _Tiny_init()))
    if kind == "ddp+compile":
        from torch._dynamo.utils import counters

        assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    dist.barrier()
    return diff, moved


def _Tiny_init():
    torch.manual_seed(0)
    return [p.detach().clone() for p in _Tiny().parameters()]


def _launch(world, task, backend="gloo"):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, task, results, backend)) for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in range(world):
                rank, value = results.get(timeout=TIMEOUT_S)
                got[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [got[r] for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_matches_single_process(world):
    per_rank = _launch(world, "parity")
    for rank, cases in enumerate(per_rank):
        assert isinstance(cases, list), f"rank {rank} failed:\n{cases}"
        for case, err, tol in cases:
            assert err <= tol, (rank, case, err)
        assert len(cases) == 24


def test_ring_attention_half_and_bfloat16_match_single_process():
    for rank, cases in enumerate(_launch(2, "halfs")):
        assert isinstance(cases, list), f"rank {rank} failed:\n{cases}"
        assert len(cases) == 4
        for case, err, tol in cases:
            assert err <= tol, (rank, case, err)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "ddp+compile"])
def test_data_parallel_training_matches_one_process(kind):
    # 2 processes on half the batch each, 3 SGD steps: the parameters of one process on the whole batch
    for rank, res in enumerate(_launch(2, kind)):
        assert isinstance(res, list), f"rank {rank} failed:\n{res}"
        diff, moved = res[0]
        assert moved > 1e-3  # training changed the parameters
        assert diff <= 1e-5, (rank, diff)


def test_ring_attention_mismatched_shards_raise_on_every_rank():
    per_rank = _launch(2, "mismatch")
    for rank, msgs in enumerate(per_rank):
        assert isinstance(msgs, list), f"rank {rank} failed:\n{msgs}"
        assert "must have the same shapes and dtype, and dropout_p the same value, on every rank; ranks [1] differ" \
            in msgs[0], msgs[0]
        assert "ranks [1] differ" in msgs[1], msgs[1]  # rank 1's inputs failed the op's checks: no hang
        assert "invalid inputs on ranks [0, 1]: query heads (4) must be a multiple of key/value heads (3)" in msgs[2], \
            msgs[2]


def test_shard_and_unshard_are_inverse():
    from mha_ext.distributed import shard, unshard

    x = torch.arange(2 * 3 * 24 * 4.0).view(2, 3, 24, 4)
    for world in (1, 2, 3):
        for layout in ("contiguous", "zigzag"):
            parts = [shard(x, r, world, layout) for r in range(world)]
            assert torch.equal(unshard(parts, layout), x)
    z = [shard(x, r, 3, "zigzag") for r in range(3)]  # rank 0 holds chunks 0 and 5 of 6
    assert torch.equal(z[0], torch.cat([x[:, :, 0:4], x[:, :, 20:24]], dim=2))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_ring_attention_over_nccl():
    for rank, cases in enumerate(_launch(2, "parity", backend="nccl")):
        assert isinstance(cases, list), f"rank {rank} failed:\n{cases}"
        for case, err, tol in cases:
            assert err <= tol, (rank, case, err)
