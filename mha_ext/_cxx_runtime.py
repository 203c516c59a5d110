"""The link flags that give a library of ours the shared C++ runtime.

setup.py reads this file by its path (before the package can be imported) for
the library's link line; the tests' emulated CUDA backend, built at test time
by torch.utils.cpp_extension.load, takes the same flags.

Where a toolchain or LDFLAGS links the C++ runtime statically
(-static-libstdc++), a library's private copy of the stream and locale code
does not match the facets of the process's runtime, and integers formatted
into an error message stop the message (g++ 12 here) or crash the process
(seen on a GPU machine's image whenever a C++ input check threw). On one such
image the compiler's search path held only the static archive, so naming
-lstdc++ was not enough: the file itself is named where it can be found, the
libstdc++.so.6 this process (and torch) runs on.
"""
import os
import sys


def shared_libstdcxx():
    """The path of the libstdc++ shared object mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # address perms offset dev inode path (the path may hold spaces)
                fields = line.rstrip("\n").split(None, 5)
                path = fields[5] if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def link_flags():
    """Linker arguments that make the shared C++ runtime a needed library,
    named before the driver's own -lstdc++ (which may be the static one)."""
    if not sys.platform.startswith("linux"):  # GNU ld's options; elsewhere the toolchain's default
        return []
    runtime = shared_libstdcxx()
    return ["-Wl,--push-state,-Bdynamic,--no-as-needed", runtime if runtime else "-lstdc++", "-Wl,--pop-state"]
