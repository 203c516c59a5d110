"""Whether a shared library of ours takes libstdc++'s stream code from
libstdc++.so (mha_ext/_cxx_runtime.py says why it must), and a toolchain that
would give it a private copy, as a GPU machine's image did."""
import os
import shutil
import subprocess

# A compiler that links the C++ runtime statically, from a folder that holds
# only the archive (first on the library path)
HOSTILE_CXX = """#!/bin/sh
case " $* " in *" -shared "*) exec '{cxx}' -L'{archive_dir}' -static-libstdc++ "$@";; esac
exec '{cxx}' "$@"
"""


def hostile_toolchain(tmp_path):
    """The path of that compiler (a wrapper of the g++ on PATH) in tmp_path."""
    real = shutil.which("g++")
    assert real, "the hostile toolchain wraps g++ (the suite's compiler), and none is on PATH"
    archive = subprocess.run([real, "-print-file-name=libstdc++.a"], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert os.path.isabs(archive), f"g++ has no libstdc++.a to link statically (libstdc++-dev): {archive!r}"
    archive_dir = tmp_path / "static_only"
    archive_dir.mkdir()
    os.symlink(archive, archive_dir / "libstdc++.a")
    cxx = tmp_path / "static-g++"
    cxx.write_text(HOSTILE_CXX.format(cxx=real, archive_dir=archive_dir))
    cxx.chmod(0o755)
    return str(cxx)


def insert_long_kinds(library):
    """nm's kind letters of std::ostream::_M_insert<long> in `library`'s dynamic
    symbols: ["U"] where it is imported (undefined here), a defining letter
    ("T", "W") where the library holds a private copy, [] where it is absent."""
    nm = shutil.which("nm")
    assert nm, "binutils' nm is needed to read the library's symbols"
    symbols = subprocess.run([nm, "-D", library], capture_output=True, text=True, check=True).stdout
    return [f[-2] for f in map(str.split, symbols.splitlines())
            if len(f) >= 2 and f[-1].split("@")[0] == "_ZNSo9_M_insertIlEERSoT_"]
