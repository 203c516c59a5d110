"""mha_ext: fused multi-head attention for PyTorch as a custom operator.

    mha_ext.scaled_dot_product_attention   drop-in for torch.nn.functional.scaled_dot_product_attention
                                           (nested tensors of the jagged layout too: mha_ext.nested)
    mha_ext.attention                      the same with causal alignments, windows, softcap, ALiBi
    mha_ext.varlen_attention               sequences of different lengths packed along the rows
    mha_ext.kvcache_attention              decoding against a preallocated KV cache, written in place
    mha_ext.plot_attention                 per-head attention heatmaps (matplotlib)
    mha_ext.integrations.transformers      the "mha_ext" backend of Hugging Face transformers
    mha_ext.MultiheadAttention             drop-in for torch.nn.MultiheadAttention
    torch.ops.mha_ext.attention / attention_backward / dropout_mask
    torch.ops.mha_ext.varlen_attention / varlen_attention_backward / kvcache_attention
"""
import glob
import os

import torch


def _load_library():
    # the library is also the Python module mha_ext._C (its fast calls):
    # imported first, so that torch.ops loads the very file Python chose
    here = os.path.dirname(os.path.abspath(__file__))
    if not glob.glob(os.path.join(here, "_C*.so")):
        raise ImportError(
            f"mha_ext: the compiled library _C*.so is missing from {here}; "
            "build it with `pip install --no-build-isolation -e .`"
        )
    from . import _C
    torch.ops.load_library(_C.__file__)
    return _C.__file__


library_path = _load_library()

from . import ops  # noqa: E402  (registers fake kernels and autograd)
from .modules import MultiheadAttention  # noqa: E402
from .ops import attention, scaled_dot_product_attention  # noqa: E402
from .kvcache import kvcache_attention  # noqa: E402
from .varlen import varlen_attention  # noqa: E402
from .plot import plot_attention  # noqa: E402  (imports matplotlib only when called)

__all__ = ["scaled_dot_product_attention", "attention", "varlen_attention", "kvcache_attention", "MultiheadAttention",
           "plot_attention", "ops", "library_path"]
