"""Context-parallel (ring) attention over torch.distributed.

Each rank holds a shard of the sequence of q, k and v; the key/value shards
travel around the ring with point-to-point sends (public torch.distributed
APIs; gloo on CPUs, NCCL on GPUs), the next shard's transfer overlapped with
the attention on the shard in hand, and the partial outputs merge by their
logsumexp (mha_ext's op returns the natural-log LSE of what it attended). The
backward is a second turn: the shards travel again, overlapped with the
attention backward on the shard in hand, and their gradients follow one step
behind, so after the turn each rank holds the gradients of its own keys and
values.

Sharding layouts (dim -2 of (..., H, L, D) tensors, W ranks):
  "contiguous": rank r holds rows [r n, (r + 1) n) of the L = W n rows;
  "zigzag":     the sequence cut into 2W chunks; rank r holds chunks r and
                2W - 1 - r, so under causal attention every rank does the same
                work (shard() / unshard() convert).
"""
import time
from typing import Optional

import torch
import torch.distributed as dist

from .checks import check_attention_inputs

__all__ = ["ring_attention", "shard", "unshard"]

_LAYOUTS = ("contiguous", "zigzag")


def _chunks_of(rank, world, layout):
    """Global chunk indices of a rank's local chunks, in local order."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """This rank's shard of a whole-sequence tensor (along `dim`)."""
    _check_layout(layout)
    n = 1 if layout == "contiguous" else 2
    if x.shape[dim] % (n * world) != 0:
        raise ValueError(f"sequence length ({x.shape[dim]}) must be a multiple of {n * world} for the {layout!r} "
                         f"layout over {world} ranks")
    pieces = x.chunk(n * world, dim=dim)
    return torch.cat([pieces[c] for c in _chunks_of(rank, world, layout)], dim=dim)


def unshard(shards, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The whole-sequence tensor from every rank's shard (a list in rank order)."""
    _check_layout(layout)
    world = len(shards)
    n = 1 if layout == "contiguous" else 2
    pieces = [None] * (n * world)
    for r, s in enumerate(shards):
        for c, piece in zip(_chunks_of(r, world, layout), s.chunk(n, dim=dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim=dim)


def _check_layout(layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")


def _check_same_on_every_rank(q, k, v, group, world, layout, dropout_p, rng, failure):
    """Shapes, dtypes, dropout_p and the layout's divisibility, compared across
    ranks with one all_gather: every rank sees the same list, so every rank
    raises the same error (no rank is left waiting in a send). The same
    all_gather hands every rank rank 0's dropout (seed, offset), returned, and
    tells every rank whether drawing it failed on some rank (`failure`: this
    rank's error, re-raised here)."""
    def code(t):
        return [t.dim()] + list(t.shape) + [0] * (8 - t.dim())

    p_bits = torch.tensor([dropout_p], dtype=torch.float64).view(torch.int64).item()
    mine = torch.tensor(code(q) + code(k) + code(v) + [_FLOAT_CODES.get(q.dtype, -1), p_bits, int(failure is not None)],
                        dtype=torch.int64)
    mine = torch.cat([mine.to(rng.device), rng])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = [e.cpu().tolist() for e in every]
    if any(r[:-3] != rows[0][:-3] for r in rows):
        bad = [i for i, r in enumerate(rows) if r[:-3] != rows[0][:-3]]
        raise RuntimeError(f"ring_attention: q, k, v must have the same shapes and dtype, and dropout_p the same "
                           f"value, on every rank; ranks {bad} differ from rank 0 (shards of unequal length?)")
    failed = [i for i, r in enumerate(rows) if r[-3]]
    if failure is not None:
        raise RuntimeError(f"ring_attention: invalid inputs on ranks {failed}: {failure}") from failure
    if failed:
        raise RuntimeError(f"ring_attention: invalid inputs on ranks {failed} (their error names the argument)")
    if q.shape[-2] != k.shape[-2]:
        raise RuntimeError(f"ring_attention: q and k shards must have the same length, got {q.shape[-2]} and "
                           f"{k.shape[-2]}")
    if layout == "zigzag" and q.shape[-2] % 2 != 0:
        raise RuntimeError(f"ring_attention: a zigzag shard holds two equal chunks; its length must be even, got "
                           f"{q.shape[-2]}")
    return every[0][-2:]


_FLOAT_CODES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


def _merge(out, lse, part, part_lse):
    """Two attention results over disjoint keys merged by their logsumexp
    (out (..., L, Ev) float accumulators, lse (..., L)); -inf rows stay 0."""
    new = torch.logaddexp(lse, part_lse)
    finite = new > float("-inf")
    a = torch.where(finite, torch.exp(lse - new), 0.0).unsqueeze(-1)
    b = torch.where(finite, torch.exp(part_lse - new), 0.0).unsqueeze(-1)
    return out * a + part.to(out.dtype) * b, new


class _Ring:
    """Sends this rank's buffers to the next rank and receives the previous
    rank's, started before the compute on the buffers in hand. waited_s sums
    the time this process spent blocked in finish() (the transfer time not
    hidden behind compute; bench/bench_ring.py reads it)."""

    waited_s = 0.0

    def __init__(self, group, rank, world):
        self.group, self.world = group, world
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        self.next, self.prev = ranks[(rank + 1) % world], ranks[(rank - 1) % world]

    def start(self, tensors):
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        return dist.batch_isend_irecv(ops), recv

    @staticmethod
    def finish(pending):
        reqs, recv = pending
        t = time.perf_counter()
        for r in reqs:
            r.wait()
        _Ring.waited_s += time.perf_counter() - t
        return recv


def _draw_rng(q, k, world, dropout_p):
    """The dropout (seed, offset) that one process attending the whole
    sequence would draw (from the generator of q's device, advanced as that
    call advances it); zeros without dropout."""
    if dropout_p == 0.0:
        return torch.zeros(2, dtype=torch.int64, device=q.device)
    return torch.ops.mha_ext.draw_rng_state(q, k.shape[-2] * world)


def _frames(rank, world, layout, chunk, rng):
    """With dropout, the rng_state of every (local q chunk a, global kv chunk)
    pair, frames[a][kb]: (seed, offset) and the pair's place in the whole
    attention (the op's dropout frame), so each block's mask is that of one
    process on the whole sequence. One host-to-device copy per call. None
    without dropout."""
    if rng is None:
        return None
    n = 1 if layout == "contiguous" else 2
    rows = chunk * n * world
    mine = _chunks_of(rank, world, layout)
    places = torch.tensor([[[rows, qa * chunk, kb * chunk] for kb in range(n * world)] for qa in mine],
                          dtype=torch.int64).to(rng.device)
    return torch.cat([rng.expand(len(mine), n * world, 2), places], dim=-1)


def _pairs(rank, src, world, layout, causal, frames):
    """(local q chunk, local kv chunk, is_causal, rng_state) for the chunk pairs
    that attend: a kv chunk after the q chunk is skipped under causal, the same
    chunk is the causal diagonal (equal lengths: top-left); rng_state is the
    pair's frame (None without dropout)."""
    out = []
    for a, qa in enumerate(_chunks_of(rank, world, layout)):
        for b, kb in enumerate(_chunks_of(src, world, layout)):
            if causal and kb > qa:
                continue
            out.append((a, b, causal and kb == qa, None if frames is None else frames[a, kb]))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, dropout_p):
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        gqa = q.shape[-3] != k.shape[-3]
        try:  # the op's own checks, before any transfer
            check_attention_inputs(q, k, v, None, dropout_p, gqa)
            drawn, failure = _draw_rng(q, k, world, dropout_p), None
        except RuntimeError as e:  # invalid inputs here: every rank must hear of it, not wait
            drawn, failure = torch.zeros(2, dtype=torch.int64, device=q.device), e
        rng = _check_same_on_every_rank(q, k, v, group, world, layout, dropout_p, drawn, failure)
        n = 1 if layout == "contiguous" else 2
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qc = q.chunk(n, dim=-2)
        frames = _frames(rank, world, layout, qc[0].shape[-2], rng if dropout_p > 0.0 else None)
        out = [torch.zeros(c.shape[:-1] + (v.shape[-1],), dtype=acc, device=q.device) for c in qc]
        lse = [torch.full(c.shape[:-1], float("-inf"), dtype=acc, device=q.device) for c in qc]
        ring = _Ring(group, rank, world)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(world):
            pending = ring.start(kv) if step + 1 < world else None
            src = (rank - step) % world
            kc, vc = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
            for a, b, diag, frame in _pairs(rank, src, world, layout, causal, frames):
                o, l, _ = torch.ops.mha_ext.attention(qc[a], kc[b], vc[b], None, dropout_p, diag, scale, gqa, frame)
                out[a], lse[a] = _merge(out[a], lse[a], o, l)
            if pending is not None:
                kv = ring.finish(pending)
        out = torch.cat(out, dim=-2).to(q.dtype)
        lse = torch.cat(lse, dim=-2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, layout, dropout_p, frames)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, layout, dropout_p, frames = ctx.args
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        gqa = q.shape[-3] != k.shape[-3]
        n = 1 if layout == "contiguous" else 2
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qc, oc, gc = q.chunk(n, dim=-2), out.chunk(n, dim=-2), grad_out.contiguous().chunk(n, dim=-2)
        lc = lse.chunk(n, dim=-2)
        dq = [torch.zeros(c.shape, dtype=acc, device=q.device) for c in qc]
        ring = _Ring(group, rank, world)
        # The shard in hand goes on to the next rank while this one works on it.
        # Its gradients follow one step behind: each rank sums its part into
        # a fresh buffer while the previous ranks' sum is in flight, adds that
        # when it arrives and sends the total on; after the last step the
        # arriving sum is this rank's own shard's, from every rank.
        kv = [k.contiguous(), v.contiguous()]
        incoming = None
        for step in range(world):
            pending_kv = ring.start(kv) if step + 1 < world else None
            src = (rank - step) % world
            grads = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
            kc, vc = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
            dkc, dvc = grads[0].chunk(n, dim=-2), grads[1].chunk(n, dim=-2)
            for a, b, diag, frame in _pairs(rank, src, world, layout, causal, frames):
                gq, gk, gv, _ = torch.ops.mha_ext.attention_backward(
                    gc[a], qc[a], kc[b], vc[b], oc[a], lc[a].contiguous(), None, dropout_p, diag, scale, gqa,
                    frame if frame is not None else torch.zeros(2, dtype=torch.int64), False)
                dq[a] += gq
                dkc[b].add_(gk)
                dvc[b].add_(gv)
            if incoming is not None:
                for g, earlier in zip(grads, ring.finish(incoming)):
                    g.add_(earlier)
            incoming = ring.start(grads) if world > 1 else None
            if pending_kv is not None:
                kv = ring.finish(pending_kv)
        own = ring.finish(incoming) if incoming is not None else grads
        dq = torch.cat(dq, dim=-2).to(q.dtype)
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of `group` (default:
    the whole world): q (..., Hq, n, E), k (..., Hkv, n, E), v (..., Hkv, n, Ev)
    are this rank's shards (see the module's layouts); returns this rank's
    shard of the output, (..., Hq, n, Ev). Autograd works (the backward is a
    second turn of the ring, its transfers overlapped with compute too). GQA when Hq is a multiple of Hkv; every dtype.
    causal: each query attends to the keys at or before its global position.
    dropout_p: dropout on the attention weights with the mask that
    mha_ext.scaled_dot_product_attention draws for the whole sequence after
    the same torch.manual_seed (rank 0's draw is used on every rank; every
    rank's generator advances as one process's would).
    Every rank must call it with the same shapes (checked on every rank)."""
    _check_layout(layout)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p:g}")
    return _RingAttention.apply(q, k, v, group, causal, scale, layout, float(dropout_p))
