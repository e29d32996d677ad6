"""Hand freed heap memory back to the operating system (glibc's ``malloc_trim``).

A long case's chunks each allocate and free arrays of tens of MiB (the baseline's
(rows, Tk) scores and their autograd, the diagnosis's float64 block of rows).  glibc
keeps such freed blocks in its arenas instead of returning them, and with every chunk
a little differently sized (a causal chunk reads keys up to its last row) they pile up:
measured at T = 65536, 5.9 GiB of resident memory for 1.2 GiB in use.  ``trim()`` after
each chunk keeps the resident memory near what is in use.  Elsewhere than glibc it does
nothing.
"""

import ctypes
import ctypes.util

__all__ = ["trim"]


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


_TRIM = _malloc_trim()


def trim():
    """Return the heap's free pages to the OS; False where there is no glibc to ask."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
