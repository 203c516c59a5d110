"""bench/cuda_ab.py, the harness that times versions of the plain CUDA
forward kernel side by side on a lent GPU: here on the CPU emulation, where
it builds two source trees (the working tree's csrc/ and a copy) into one
library, runs each version on every dtype / head dim / causal case it times
and holds the outputs to the float64 reference (within twice torch's own
error in the dtype: the script exits non-zero past it). What a GPU session's
one call relies on: the parameters and launch it gives the kernel, and the
renamed namespaces that let versions share a process."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cuda_ab_harness_on_the_emulation(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(ROOT, "csrc"), copy / "csrc")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "cuda_ab.py"), "--emulate", ROOT, str(copy)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if "max error" in line]
    assert len(rows) == 2 * 2 * 2 * 2, run.stdout  # versions x dtypes x head dims x causal
    # the two copies of one tree compute the same bits
    assert all(re.search(r", 0 elements differ from the first version's$", line) for line in rows), run.stdout
