"""``numpy_ref``'s side of the walkthrough: the module's own backward, tapped.

The NumPy modules call every op through ``numpy_ref.ops`` (``ops.softmax_backward``
...).  `tap` swaps each backward op for a wrapper that records a copy of what
goes in and what comes out, then puts the originals back.  So every number shown
is computed by ``numpy_ref``'s own code, in its own order; nothing is recomputed.

Copies matter: the modules write some gradients over others to save memory
(the softmax backward over its upstream gradient, the mask backward over the
softmax's result).
"""

import contextlib

import numpy as np

import numpy_ref.ops as ops
from parity_tests.common import faults

TAPPED = ("weighted_sum_backward", "dropout_backward", "softmax_backward",
          "causal_mask_backward", "scores_backward", "linear_backward",
          "linear_v1_backward", "merge_heads_backward", "split_heads_backward",
          "concat_heads_backward")


def _copy(value):
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    return value


@contextlib.contextmanager
def tap():
    """Within the block, every call of a TAPPED op appends ``(name, args, result)``
    (copies) to the yielded list."""
    calls = []

    def wrap(name, original):
        def recorded(*args, **kwargs):
            args_copy = _copy(args)
            result = original(*args, **kwargs)
            calls.append((name, args_copy, _copy(result)))
            return result
        return recorded

    with faults.swapped([(ops, name, lambda original, n=name: wrap(n, original)) for name in TAPPED]):
        yield calls


def run(m, x, G, keep_masks=None):
    """Forward and backward of NumPy module ``m``; returns ``(out, dx, grads, calls)``.

    ``keep_masks`` maps a head prefix (``""``, ``"heads.0."`` ...) to the dropout
    keep-mask autograd's side drew, so both sides drop the same weights.
    """
    keep_mask = None
    if keep_masks and m.training:
        if "" in keep_masks:
            keep_mask = keep_masks[""]
        else:
            keep_mask = np.stack([keep_masks[f"heads.{i}."] for i in range(len(keep_masks))])
    out = m.forward(x) if keep_mask is None else m.forward(x, keep_mask)
    with tap() as calls:
        dx = m.backward(G)
    return out, dx, dict(m.grads), calls
