"""The package as a user gets it: `pip wheel --no-build-isolation .` on a copy
of the tracked sources gives a wheel (metadata from pyproject.toml, both
packages, the compiled library) that installs into a fresh venv and passes a
smoke test there. The fresh venv gets this environment's torch through a .pth
line (the same torch, without a second multi-GB install); mha_ext must import
from the venv's own site-packages, not from this checkout.

The wheel is built by a hostile toolchain, as a GPU machine's image had: its
compiler links the C++ runtime statically (-static-libstdc++) and its search
path holds only libstdc++.a. A library built so held its own copy of the
stream code, and C++ error messages with integers were cut (here) or crashed
(there); setup.py links the shared libstdc++.so.6 by its path, and the smoke
test checks a message with integers whole and the stream code imported. (The
suite itself runs on the normal toolchain's build.)"""
import os
import subprocess
import sys
import zipfile

from cxx_runtime import hostile_toolchain, insert_long_kinds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMOKE = r"""
import os, sys, torch, mha_ext, mha_ext.integrations.transformers
here = os.path.dirname(mha_ext.__file__)
assert here.startswith(sys.prefix), (here, sys.prefix)
q, k, v = (torch.randn(2, 4, 33, 16, requires_grad=True) for _ in range(3))
out = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
out.sum().backward()
assert torch.isfinite(q.grad).all()
# a C++ check's message with integers in it, whole
q0 = torch.randn(1, 2, 10, 8)
try:
    torch.ops.mha_ext.attention(q0, q0, q0, None, 0.2, False, None, False, torch.tensor([1, 2, 9, 0, 0]))
    raise AssertionError("the bad rng_state was accepted")
except RuntimeError as e:
    assert "and rows >= row0 + 10 (the query length), got (9, 0, 0)" in str(e), str(e)
print("smoke ok", mha_ext.library_path)
"""


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    src = tmp_path / "src"
    files = _run(["git", "ls-files", "-z"], cwd=ROOT).split("\0")
    for f in filter(None, files):
        dst = src / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(open(os.path.join(ROOT, f), "rb").read())
    # CPU only: the packaging is the same with the CUDA build, which takes longer
    cxx = hostile_toolchain(tmp_path)
    env = dict(os.environ, USE_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"), CC=cxx, CXX=cxx)
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
          str(src)], env=env)
    (wheel,) = list((tmp_path / "dist").glob("mha_ext-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("mha_ext/_C") and n.endswith(".so") for n in names)
    assert "mha_ext/integrations/transformers.py" in names
    meta = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Dist: torch==2.14.1" in text and "Provides-Extra: transformers" in text

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    torch_site = os.path.dirname(os.path.dirname(__import__("torch").__file__))
    with open(os.path.join(site, "same_torch.pth"), "w") as f:
        f.write(torch_site + "\n")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    out = _run([py, "-c", SMOKE], cwd=str(tmp_path))
    assert "smoke ok" in out and str(venv) in out
    # std::ostream::_M_insert<long> imported ("U"), not a private copy in the library
    library = out.split()[-1]
    assert insert_long_kinds(library) == ["U"]
