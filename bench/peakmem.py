"""Peak resident memory of a piece of work, on Linux, in-process.

Resets the kernel's high-water mark (/proc/self/clear_refs, "5"), runs the
work and reads VmHWM back: peak extra = VmHWM - VmRSS before. For the number to
mean what it says, freed buffers must go back to the OS; processes started
through `reexec_with_fixed_mmap_threshold()` get glibc's mmap threshold fixed
at 128 KiB (it otherwise grows up to 32 MiB and keeps freed blocks).
"""
import ctypes
import os
import sys

_ENV = "MALLOC_MMAP_THRESHOLD_"


def reexec_with_fixed_mmap_threshold():
    if os.environ.get(_ENV) is None:
        os.environ[_ENV] = str(128 * 1024)
        os.execv(sys.executable, [sys.executable] + sys.argv)


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mib(fn):
    """Runs fn() and returns (its result, peak extra resident MiB during it)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    result = fn()
    return result, (_status_kib("VmHWM") - base) / 1024.0
