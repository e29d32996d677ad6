"""Centred finite differences: an oracle for gradients that needs no PyTorch.

For a function ``f`` and an upstream gradient ``dout`` (the gradient of some
scalar loss L with respect to ``f``'s output), the gradient of L with respect to
one entry ``x[i]`` is approximately::

    dL/dx[i] ~ sum((f(x + h e_i) - f(x - h e_i)) * dout) / (2 h)

with an error of order h^2 (truncation) plus eps * |f| / h (rounding).  In float64
with h = 1e-5 both are far below the 1e-7 relative error the tests allow.

Use a *random* ``dout``: with ``dout = ones`` a softmax row sums to 1 whatever its
input, so its gradient is ~0 and the check would pass for almost any backward.
"""

import copy

import numpy as np

DEFAULT_STEP = 1e-5


def fd_jacobian(f, x, h=1e-6):
    """Explicit Jacobian ``J[..., i, j] = d f_i / d x_j`` along the last axis of ``x``,
    one column per perturbed entry: ``J[..., :, j] = (f(x + h e_j) - f(x - h e_j)) / 2h``.

    Divided by the step float64 actually took, ``(x_j + h) - (x_j - h)``, not by
    ``2h``: for a large ``x_j`` the two differ by up to ``|x_j| * eps``, an error
    of ``|x_j| * eps / h`` relative (2e-6 at x_j = 1e4, h = 1e-6) that has
    nothing to do with ``f``."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    cols = []
    for j in range(n):
        plus, minus = x.copy(), x.copy()
        plus[..., j] += h
        minus[..., j] -= h
        step = (plus[..., j] - minus[..., j])[..., None]     # exact: the step taken
        cols.append((f(plus) - f(minus)) / step)
    return np.stack(cols, axis=-1)


def eval_numerical_gradient_array(f, x, dout, h=DEFAULT_STEP):
    """dL/dx for L = sum(f() * dout), by centred differences.

    ``f`` takes no argument and reads ``x`` (modified in place, one entry at a time,
    and restored).  Returns an array shaped like ``x``.
    """
    grad = np.zeros_like(x, dtype=np.float64)
    for ix in np.ndindex(x.shape):
        old = x[ix]
        x[ix] = old + h
        plus = np.array(f(), dtype=np.float64)
        x[ix] = old - h
        minus = np.array(f(), dtype=np.float64)
        x[ix] = old
        grad[ix] = np.sum((plus - minus) * dout) / (2 * h)
    return grad


def rel_error(actual, expected, floor=0.0):
    """Largest absolute difference over the larger of the two largest magnitudes
    (and ``floor``).

    Scale-aware on purpose: an entry-by-entry ratio blows up on entries that are
    ~0 (masked positions, tiny softmax tails) where finite differences only reach
    absolute, not relative, accuracy.  ``floor`` gives a scale to a gradient that
    is exactly zero in theory, where both sides are pure rounding noise.  Two
    all-zero arrays give 0.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: actual {actual.shape}, expected {expected.shape}")
    if actual.size == 0:
        return 0.0
    scale = max(np.max(np.abs(actual)), np.max(np.abs(expected)), floor)
    diff = np.max(np.abs(actual - expected))
    return 0.0 if diff == 0 else float(diff / scale)


def _float64_copy(module):
    """A deep copy of the module with every parameter and buffer in float64."""
    m = copy.deepcopy(module)
    m.load_state_dict({k: v.astype(np.float64) for k, v in m.state_dict().items()})
    return m


def _forward(module, x, keep_mask):
    return module.forward(x) if keep_mask is None else module.forward(x, keep_mask)


def numerical_grads(module, x, dout, keep_mask=None, h=DEFAULT_STEP):
    """Finite-difference gradients of ``sum(module(x) * dout)`` in float64.

    Returns ``{"input": dx, <name>: dparam, ...}`` with one entry per name of
    ``module.named_parameters()``.  The module itself is not touched (a float64
    copy is used).  Dropout must be deterministic: pass ``keep_mask`` or put the
    module in eval mode; a forward that changes between two calls is refused.
    """
    m = _float64_copy(module)
    x = np.array(x, dtype=np.float64)
    dout = np.asarray(dout, dtype=np.float64)
    first, second = _forward(m, x, keep_mask), _forward(m, x, keep_mask)
    if not np.array_equal(first, second, equal_nan=True):
        raise ValueError("the forward is not deterministic (dropout drawing masks?): "
                         "pass keep_mask or call module.eval()")
    f = lambda: _forward(m, x, keep_mask)
    grads = {"input": eval_numerical_gradient_array(f, x, dout, h)}
    for name, param in m.named_parameters():
        grads[name] = eval_numerical_gradient_array(f, param, dout, h)
    return grads


def analytic_grads(module, x, dout, keep_mask=None):
    """The module's own backward on a float64 copy, keyed like `numerical_grads`."""
    m = _float64_copy(module)
    x = np.array(x, dtype=np.float64)
    _forward(m, x, keep_mask)
    grads = {"input": m.backward(np.asarray(dout, dtype=np.float64))}
    grads.update(m.grads)
    return grads


# A tensor's error is measured on its own scale, or on this fraction of the
# module's largest gradient if that is larger.  The key bias needs it: adding b
# to every key adds q.b to a whole row of scores, which the softmax ignores, so
# its exact gradient is 0 and both sides hold only rounding noise (~1e-17 / 1e-11).
SCALE_FLOOR_FRACTION = 1e-3


def gradient_errors(module, x, dout, keep_mask=None, h=DEFAULT_STEP):
    """``{tensor: rel_error(backward, finite differences)}`` for the input and
    every parameter (see SCALE_FLOOR_FRACTION).  Raises ValueError if the
    backward's keys differ from named_parameters()."""
    analytic = analytic_grads(module, x, dout, keep_mask)
    numeric = numerical_grads(module, x, dout, keep_mask, h)
    if list(analytic) != list(numeric):
        raise ValueError(f"backward filled grads {list(analytic)[1:]}, "
                         f"named_parameters() has {list(numeric)[1:]}")
    floor = SCALE_FLOOR_FRACTION * max(np.max(np.abs(g)) for g in numeric.values())
    return {name: rel_error(analytic[name], numeric[name], floor) for name in numeric}
