"""Train a small character-level transformer language model on the CPU with
mha_ext.MultiheadAttention, then compare speed and peak memory with the same
model built on torch.nn.MultiheadAttention.

The text is the Python documentation's topic pages that ship with CPython
(pydoc_data.topics), so nothing is downloaded.

    python examples/train_lm.py [--steps 300] [--compare-steps 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import mha_ext  # noqa: E402
from peakmem import peak_extra_mib, reexec_with_fixed_mmap_threshold  # noqa: E402


def load_text():
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    return data, chars


class Block(nn.Module):
    def __init__(self, mha_cls, d, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = mha_cls(d, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, mha_cls, vocab, d=128, heads=4, layers=2, block=256, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(mha_cls, d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        L = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(L))
        mask = torch.ones(L, L, dtype=torch.bool).triu(1)  # True = masked, as torch's module expects
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def batches(data, batch, block, gen):
    while True:
        ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + block + 1] for i in ix])
        yield x, y


def make(impl, vocab, args):
    torch.manual_seed(0)
    cls = mha_ext.MultiheadAttention if impl == "mha_ext" else nn.MultiheadAttention
    model = CharLM(cls, vocab, d=args.d_model, heads=args.heads, layers=args.layers, block=args.block)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def step(model, opt, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def sample(model, chars, prompt, n, temperature=0.8):
    model.eval()
    gen = torch.Generator().manual_seed(0)
    stoi = {c: i for i, c in enumerate(chars)}
    idx = torch.tensor([[stoi.get(c, 0) for c in prompt]])
    for _ in range(n):
        logits = model(idx[:, -model.pos.num_embeddings :])[:, -1]
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt], dim=1)
    model.train()
    return "".join(chars[i] for i in idx[0].tolist())


def measure(impl, args):
    """Run in a child process: time and peak extra memory of training steps."""
    data, chars = load_text()
    model, opt = make(impl, len(chars), args)
    gen = torch.Generator().manual_seed(1)
    it = batches(data, args.batch, args.block, gen)
    for _ in range(3):
        step(model, opt, *next(it))
    times, losses = [], []

    def run():
        for _ in range(args.compare_steps):
            x, y = next(it)
            t = time.perf_counter()
            losses.append(step(model, opt, x, y))
            times.append(time.perf_counter() - t)

    _, peak = peak_extra_mib(run)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "peak_mib": peak, "loss": losses[-1]}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--compare-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--measure", choices=["mha_ext", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        reexec_with_fixed_mmap_threshold()
        return measure(args.measure, args)

    from tqdm import tqdm

    data, chars = load_text()
    print(f"mha_ext demo: char-level LM on {len(data):,} characters of CPython's docs, vocab {len(chars)}, "
          f"{args.layers} layers x {args.heads} heads x d_model {args.d_model}, context {args.block}, "
          f"batch {args.batch}, {torch.get_num_threads()} CPU threads")
    model, opt = make("mha_ext", len(chars), args)
    it = batches(data, args.batch, args.block, torch.Generator().manual_seed(1))
    first, losses = None, []
    bar = tqdm(range(args.steps), desc="training (mha_ext)", unit="step")
    t0 = time.perf_counter()
    for i in bar:
        loss = step(model, opt, *next(it))
        first = loss if first is None else first
        losses.append(loss)
        if i % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")
    elapsed = time.perf_counter() - t0
    tail = statistics.mean(losses[-20:])
    print(f"loss: {first:.3f} at step 1 -> {tail:.3f} (mean of the last 20 steps) after {args.steps} steps, "
          f"{elapsed:.1f} s")
    print("sample (temperature 0.8):", repr(sample(model, chars, "The ", 120)))

    print(f"\nSame model, same seed, {args.compare_steps} training steps each, in fresh processes:")
    rows = {}
    for impl in ("mha_ext", "torch"):
        cmd = [sys.executable, os.path.abspath(__file__), "--measure", impl] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("measure", "steps")
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[impl] = json.loads(res.stdout.strip().splitlines()[-1])
    name = {"mha_ext": "mha_ext.MultiheadAttention", "torch": "torch.nn.MultiheadAttention"}
    print(f"{'attention module':<30}{'ms / step (median)':>20}{'peak extra MiB':>16}{'loss':>8}")
    for impl, r in rows.items():
        print(f"{name[impl]:<30}{r['ms']:>20.1f}{r['peak_mib']:>16.1f}{r['loss']:>8.3f}")
    print(f"speed-up {rows['torch']['ms'] / rows['mha_ext']['ms']:.2f}x, "
          f"peak memory {rows['mha_ext']['peak_mib'] / rows['torch']['peak_mib']:.2f}x of torch's "
          f"(dropout 0.1 in attention: torch's module takes its unfused path)")


if __name__ == "__main__":
    main()
