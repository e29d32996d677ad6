"""How many threads NumPy's OpenBLAS uses, changed for a while (standard library only).

Blockwise attention calls the BLAS on many small tiles.  On such products a
multi-threaded OpenBLAS spends more time waking and joining its threads than
multiplying (measured on 2 cores: up to 20x slower for a (128, 64) @ (64, 1024)
product), so the tiles run with one BLAS thread; where the cores really run in
parallel, a thread pool over heads can then use them, exponentials included.

NumPy offers no call for this, so ``blas_threads(n)`` finds the loaded OpenBLAS
(Linux: /proc/self/maps) and calls its ``openblas_set_num_threads`` through
ctypes, as threadpoolctl does.  Where it cannot (no OpenBLAS, another BLAS,
another system), ``available()`` is False and the callers run single-threaded
with the BLAS left as it is.
"""

import contextlib
import ctypes

_NAMES = ("scipy_openblas_{}_num_threads64_", "scipy_openblas_{}_num_threads",
          "openblas_{}_num_threads64_", "openblas_{}_num_threads")
_functions = None


def _find():
    """(set, get) of the loaded OpenBLAS, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _NAMES:
            setter = getattr(lib, name.format("set"), None)
            getter = getattr(lib, name.format("get"), None)
            if setter is not None and getter is not None:
                getter.restype = ctypes.c_int
                return setter, getter
    return None


def _get_functions():
    global _functions
    if _functions is None:
        import numpy  # noqa: F401  (the BLAS is loaded with NumPy)
        _functions = _find() or False
    return _functions


def available():
    """True when the number of BLAS threads can be changed."""
    return bool(_get_functions())


@contextlib.contextmanager
def blas_threads(n):
    """Within the block, OpenBLAS uses ``n`` threads (no-op when not available)."""
    functions = _get_functions()
    if not functions:
        yield
        return
    setter, getter = functions
    before = getter()
    setter(int(n))
    try:
        yield
    finally:
        setter(before)
