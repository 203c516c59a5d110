"""Whether a shared library of ours takes libstdc++'s stream code from
libstdc++.so (mha_ext/_cxx_runtime.py says why it must)."""
import shutil
import subprocess


def insert_long_kinds(library):
    """nm's kind letters of std::ostream::_M_insert<long> in `library`'s dynamic
    symbols: ["U"] where it is imported (undefined here), a defining letter
    ("T", "W") where the library holds a private copy, [] where it is absent."""
    nm = shutil.which("nm")
    assert nm, "binutils' nm is needed to read the library's symbols"
    symbols = subprocess.run([nm, "-D", library], capture_output=True, text=True, check=True).stdout
    return [f[-2] for f in map(str.split, symbols.splitlines())
            if len(f) >= 2 and f[-1].split("@")[0] == "_ZNSo9_M_insertIlEERSoT_"]
