"""Attention heatmaps, one per head (needs matplotlib: the `plot` extra)."""
from typing import Optional, Sequence

import torch


def plot_attention(weights: torch.Tensor, tokens: Sequence[str], key_tokens: Optional[Sequence[str]] = None,
                   path: Optional[str] = None, cols: int = 4, title: Optional[str] = None, cmap: str = "viridis"):
    """Draws the attention weights of every head as a heatmap with token labels.

    weights: (H, L, S) or (L, S) (one layer of one sequence, e.g. a slice of
    what output_attentions / need_weights return); tokens: the L query
    tokens; key_tokens: the S key tokens (default: tokens). Writes a PNG to
    `path` when given. Returns the matplotlib figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = weights.detach().float().cpu()
    if w.dim() == 2:
        w = w.unsqueeze(0)
    if w.dim() != 3:
        raise ValueError(f"weights must be (H, L, S) or (L, S), got shape {tuple(weights.shape)}")
    key_tokens = list(tokens if key_tokens is None else key_tokens)
    heads, L, S = w.shape
    if len(tokens) != L or len(key_tokens) != S:
        raise ValueError(f"tokens must give {L} query and {S} key labels, got {len(tokens)} and {len(key_tokens)}")
    cols = max(1, min(cols, heads))
    rows = (heads + cols - 1) // cols
    size = 0.28 * max(L, S) + 1.5
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size), squeeze=False)
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        ax.imshow(w[h].numpy(), cmap=cmap, vmin=0.0, vmax=float(w[h].max()) or 1.0)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(S), key_tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(L), list(tokens), fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
