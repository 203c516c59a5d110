"""The per-head heatmap helper and the MiniLM heatmap example."""
import os
import subprocess
import sys

import pytest
import torch

import mha_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plot_attention_draws_one_labelled_heatmap_per_head(tmp_path):
    w = torch.softmax(torch.randn(3, 4, 5), -1)
    path = tmp_path / "heads.png"
    fig = mha_ext.plot_attention(w, ["a", "b", "c", "d"], ["k0", "k1", "k2", "k3", "k4"], path=str(path), cols=2)
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = [ax for ax in fig.axes if ax.images]
    assert len(drawn) == 3  # the fourth cell of the 2 x 2 grid is off
    assert [t.get_text() for t in drawn[0].get_yticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in drawn[2].get_xticklabels()] == ["k0", "k1", "k2", "k3", "k4"]
    torch.testing.assert_close(torch.tensor(drawn[1].images[0].get_array()), w[1])


def test_plot_attention_errors():
    with pytest.raises(ValueError, match=r"weights must be \(H, L, S\) or \(L, S\), got shape \(5,\)"):
        mha_ext.plot_attention(torch.rand(5), ["a"] * 5)
    with pytest.raises(ValueError, match="tokens must give 4 query and 4 key labels, got 3 and 3"):
        mha_ext.plot_attention(torch.rand(2, 4, 4), ["a", "b", "c"])


def test_minilm_heatmap_example_writes_every_head(tmp_path):
    out = tmp_path / "minilm.png"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "attention_heatmaps.py"), "--layer", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "12 heads" in res.stdout and out.stat().st_size > 10000
