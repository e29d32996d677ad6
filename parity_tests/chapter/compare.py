"""Comparing a computed value, NumPy's and PyTorch's, with what the chapter prints:
the helpers of ``attention-parity chapter``'s sections (`replay`, `replay_causal`)."""

import numpy as np
import torch

from parity_tests.common import chapter_values
from parity_tests.common.verdicts import FAIL, fmt, verdict


def _np(a):
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def agrees(computed, printed, atol):
    """Same shape, same -inf positions, finite parts within ``atol``."""
    c = np.asarray(_np(computed), dtype=np.float64)
    p = np.asarray(printed, dtype=np.float64)
    if c.shape != p.shape:
        return False
    inf_c, inf_p = np.isinf(c), np.isinf(p)
    if not np.array_equal(inf_c, inf_p) or not np.array_equal(c[inf_c], p[inf_p]):
        return False
    return bool(np.all(np.abs(c[~inf_c] - p[~inf_p]) <= atol))


def value_row(claim, t, n, printed, atol):
    """One printed vector (or scalar): torch's value, NumPy's if it prints otherwise."""
    t_s, n_s = fmt(_np(t)), fmt(_np(n))
    computed = t_s if t_s == n_s else f"torch {t_s} ; numpy {n_s}"
    ok = agrees(t, printed, atol) and agrees(n, printed, atol)
    return (claim, computed, fmt(printed), verdict(ok))


def matrix_rows(name, t, n, printed, atol):
    """A printed matrix, one table row per matrix row (as the chapter prints it)."""
    t, n, printed = _np(t), _np(n), np.asarray(printed, dtype=np.float64)
    if t.shape != printed.shape or n.shape != printed.shape:
        return [(f"{name}.shape", f"torch {t.shape} ; numpy {n.shape}", str(printed.shape), FAIL)]
    return [value_row(f"{name}[{i}]", t[i], n[i], printed[i], atol) for i in range(len(printed))]


def shape_row(claim, t, n, printed):
    ts, ns = tuple(_np(t).shape), tuple(_np(n).shape)
    return (claim, str(ts) if ts == ns else f"torch {ts} ; numpy {ns}", str(tuple(printed)),
            verdict(ts == ns == tuple(printed)))


def inputs(dtype=torch.float32):
    return torch.tensor(chapter_values.INPUTS, dtype=dtype)


def seeded(cls_t, cls_n, seed, *args):
    """(torch module after manual_seed(seed), NumPy module with its weights)."""
    torch.manual_seed(seed)
    m_t = cls_t(*args)
    m_n = cls_n(*args)
    m_n.load_state_dict(m_t.state_dict())
    return m_t, m_n
