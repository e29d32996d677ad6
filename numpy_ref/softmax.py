"""Softmax, its Jacobian, and the sum normalisation the chapter compares it with.

Shape legend: ``n`` is the length of the axis being normalised; ``...`` is any
number of leading axes (batch, heads, query tokens).

The chapter derives, with the quotient rule on ``w_i = exp(x_i) / Z``::

    dw_i/dx_j = w_i (delta_ij - w_j)        i.e.  J = diag(w) - w w^T

The backward pass never forms J.  For an upstream gradient ``g = dL/dw``::

    dL/dx_j = sum_i g_i J_ij = sum_i g_i w_i (delta_ij - w_j)
            = w_j g_j - w_j sum_i w_i g_i
            = w_j (g_j - <w, g>)

so it needs only the softmax *output* ``w``: nothing else is kept from the forward.
"""

import numpy as np

from numpy_ref.module import read_array

__all__ = [
    "softmax",
    "softmax_naive",
    "softmax_jacobian",
    "softmax_backward",
    "sum_normalize",
    "sum_normalize_jacobian",
]


def _floating(x, name):
    """``x`` as a floating-point array with at least one axis to normalise along."""
    x = read_array(x, name)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must hold floating-point numbers, got dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d array")
    return x


def softmax(x, axis=-1):
    """Stable softmax along ``axis``: ``exp(x - max x) / sum exp(x - max x)``.

    Subtracting the maximum changes nothing mathematically (``exp(-max)`` cancels
    between numerator and denominator) but keeps every exponent <= 0, so ``exp``
    cannot overflow.  A row that is entirely ``-inf`` yields NaN, as in PyTorch;
    an empty axis yields an empty result, as in PyTorch (``initial=-inf`` gives
    the maximum of nothing a value instead of a reduction error).
    """
    x = _floating(x, "x")
    shifted = x - np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    e = np.exp(shifted, out=shifted)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def softmax_naive(x, axis=-1):
    """``exp(x) / sum exp(x)``, kept for teaching: in float32 ``exp`` overflows to
    inf once x exceeds about 88.72, and ``inf / inf`` is NaN."""
    x = _floating(x, "x")
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def softmax_jacobian(w):
    """Explicit Jacobian of the softmax, from its output ``w`` of shape (..., n).

    Returns (..., n, n) with ``J[..., i, j] = w_i (delta_ij - w_j)``, that is
    ``diag(w) - w w^T``.  For teaching and tests: modules use `softmax_backward`.
    """
    w = _floating(w, "w")
    outer = w[..., :, None] * w[..., None, :]          # w_i w_j, (..., n, n)
    diag = np.zeros_like(outer)
    idx = np.arange(w.shape[-1])
    diag[..., idx, idx] = w                              # delta_ij w_i
    return diag - outer


def softmax_backward(w, grad_w, axis=-1, out=None):
    """Vector-Jacobian product of the softmax without forming J.

    ``w`` is the forward's output, ``grad_w = dL/dw`` the upstream gradient, both
    of the same shape.  Returns ``dL/dx = w * (grad_w - sum(w * grad_w))`` with the
    sum taken along ``axis`` (derivation in the module docstring).

    ``out``, if given, receives the result; it may be ``grad_w`` itself (then
    overwritten), which saves one array of the scores' size.  It may also be
    ``w`` (or overlap it): ``w`` is then read in full before ``out`` is written,
    at the cost of one temporary array.
    """
    w = _floating(w, "w")
    grad_w = _floating(grad_w, "grad_w")
    if w.shape != grad_w.shape:
        raise ValueError(f"grad_w must have the shape of w {w.shape}, got {grad_w.shape}")
    if out is not None:
        _check_out(out, w)
    # <w, g> per row; einsum sums the products without storing them
    dot = np.einsum("...n,...n->...", np.moveaxis(w, axis, -1), np.moveaxis(grad_w, axis, -1))
    dot = np.expand_dims(dot, axis)
    if out is not None and np.shares_memory(out, w):
        # g - <w, g> written into out first would overwrite the w it is then multiplied by
        out[...] = w * (grad_w - dot)
        return out
    grad_x = np.subtract(grad_w, dot, out=out)          # g - <w, g>
    grad_x *= w
    return grad_x


def _check_out(out, w):
    """``out`` as a floating array of w's shape (``softmax_backward`` writes into it)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, got {type(out).__name__}")
    if not np.issubdtype(out.dtype, np.floating):
        raise TypeError(f"out must hold floating-point numbers, got dtype {out.dtype}")
    if out.shape != w.shape:
        raise ValueError(f"out must have the shape of w {w.shape}, got {out.shape}")


def sum_normalize(x, axis=-1):
    """The chapter's first attempt: ``w_i = x_i / S`` with ``S = sum_j x_j``.

    Only meaningful for positive scores; kept to show why softmax is preferred.
    """
    x = _floating(x, "x")
    return x / np.sum(x, axis=axis, keepdims=True)


def sum_normalize_jacobian(x):
    """Explicit Jacobian of `sum_normalize` along the last axis of ``x`` (..., n).

    Quotient rule on ``w_i = x_i / S``::

        dw_i/dx_j = (delta_ij S - x_i) / S^2

    It scales with 1/S: the larger the raw scores, the smaller the gradient.
    """
    x = _floating(x, "x")
    s = np.sum(x, axis=-1, keepdims=True)[..., None]     # (..., 1, 1)
    n = x.shape[-1]
    eye = np.eye(n, dtype=x.dtype)
    return (eye * s - x[..., :, None]) / s**2
