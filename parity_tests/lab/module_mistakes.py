"""The module exercises' mistakes: ``numpy_ref``'s module run with one op slipped.

Each entry either names a planted fault of `common.faults` (the parity suite's
catalogue) or lists its own swaps of ``numpy_ref.ops`` functions; `candidate`
runs the reference module under it and returns every tensor the grader compares.
"""

import contextlib

import numpy as np

import numpy_ref.ops as ops
from parity_tests.common import faults
from parity_tests.lab import exercises_catalog as catalog
from parity_tests.lab.mistakes import SOFTMAX_LINE, Mistake, LINEAR_LINE, SCORES_LINE


def _softmax_diagonal(m):
    def softmax_backward(w, grad_w, axis=-1, out=None):
        return w * (1 - w) * grad_w
    return [(ops, "softmax_backward", softmax_backward)]


def _mask_backward_diagonal(m):
    original = ops.causal_mask_backward

    def causal_mask_backward(dout, cache, inplace=False):   # triu(k=0): the diagonal too
        return original(dout, cache | np.eye(cache.shape[-1], dtype=bool), inplace)
    return [(ops, "causal_mask_backward", causal_mask_backward)]


def _dropout_backward_unscaled(m):
    def dropout_backward(dout, cache):
        keep_mask, _ = cache
        return dout * keep_mask
    return [(ops, "dropout_backward", dropout_backward)]


def _bias_per_sequence(m):
    original = ops.linear_backward

    def linear_backward(dout, cache):
        dx, dW, db = original(dout, cache)
        return dx, dW, (None if db is None else dout.sum(axis=-2))   # (B, d_out)
    return [(ops, "linear_backward", linear_backward)]


def _weight_grad_transposed(m):
    original = ops.linear_backward

    def linear_backward(dout, cache):
        dx, dW, db = original(dout, cache)
        return dx, dW.T, db                                       # (d_in, d_out)
    return [(ops, "linear_backward", linear_backward)]


def _road_missing(layer):
    def swaps(m):
        original = m._linear_backward          # the module's backward of one projection

        def linear_backward(name, dout, cache, grads):
            dx = original(name, dout, cache, grads)
            return np.zeros_like(dx) if name == layer else dx          # this road dropped
        return [(m, "_linear_backward", linear_backward)]
    return swaps


def _unmerge_wrong_order(m):
    def merge_heads_backward(dout, cache):
        num_heads = cache
        b, num_tokens, d_out = dout.shape
        d = dout.reshape(b, num_tokens, d_out // num_heads, num_heads)    # (B, T, D, H)
        return np.ascontiguousarray(d.transpose(0, 3, 1, 2))              # (B, H, T, D)
    return [(ops, "merge_heads_backward", merge_heads_backward)]


_ROADS = ("numpy_ref: x fed all three projections, so dL/dx = dQ W_Q + dK W_K + dV W_V "
          "(a sum over every road x takes to the loss)")
_MASK = ("the chapter's mask: torch.triu(torch.ones(T, T), diagonal=1), -inf strictly above "
         "the diagonal; numpy_ref.ops.causal_mask_backward: dω = dω̃ where kept, 0 where masked")
_DROPOUT = ("numpy_ref.ops.dropout_backward: out = x ⊙ m / (1 − p), so dx = dout ⊙ m / (1 − p) "
            "(the same mask, the same scale)")
_HEADS = ("the chapter's merge: context_vec.transpose(1, 2).contiguous().view(b, T, d_out): token "
          "t's row holds head 0's D numbers, then head 1's; the backward undoes the same order")

MODULE = [
    Mistake("softmax-no-sum", "softmax backward without the −w⟨w, g⟩ term",
            "chapter, case i ≠ j: ∂w_i/∂x_j = −w_i w_j, not 0", fault="softmax-backward-no-sum"),
    Mistake("softmax-diagonal-only", "softmax backward with only the Jacobian's diagonal w(1 − w) ⊙ g",
            SOFTMAX_LINE, swaps=_softmax_diagonal),
    Mistake("scores-backward-unscaled", "1/√d_k missing in the scores backward",
            SCORES_LINE, fault="scores-backward-unscaled"),
    Mistake("mask-one-diagonal-high", "the mask one diagonal off: each token also sees the next",
            _MASK, fault="causal-mask-off-by-one"),
    Mistake("mask-one-diagonal-low", "the mask one diagonal off in the backward: the diagonal's "
            "gradient zeroed too", _MASK, swaps=_mask_backward_diagonal),
    Mistake("dropout-backward-not-rescaled", "dropout not rescaled in the backward: dout ⊙ m, "
            "no 1/(1 − p)", _DROPOUT, swaps=_dropout_backward_unscaled),
    Mistake("dropout-not-rescaled", "dropout not rescaled at all (forward and backward)",
            "the chapter: survivors are scaled by 1/(1 − p) so the expected weight is unchanged; "
            + _DROPOUT, fault="dropout-not-rescaled"),
    Mistake("weight-grad-transposed", "a weight gradient transposed: xᵀ dout, (d_in, d_out)",
            "nn.Linear stores W as (d_out, d_in): dW = doutᵀ x", swaps=_weight_grad_transposed),
    Mistake("weight-grad-transposed-reshaped", "a weight gradient transposed, then reshaped into "
            "W's shape", "dW = doutᵀ x: a reshape moves numbers, it does not transpose",
            fault="weight-grad-transposed"),
    Mistake("bias-not-summed-over-batch", "a bias gradient not summed over the batch: (B, d_out)",
            LINEAR_LINE, swaps=_bias_per_sequence),
    Mistake("bias-first-sequence", "a bias gradient summed over the first sequence only",
            LINEAR_LINE, fault="bias-grad-first-batch"),
    Mistake("linear-backward-sign", "the projections' input gradient with the wrong sign",
            "numpy_ref.ops.linear_backward: dx = dout W", fault="linear-backward-sign"),
    Mistake("weighted-sum-no-transpose", "dV = w' dz instead of w'ᵀ dz",
            "numpy_ref.ops.weighted_sum_backward: dv[j, d] = Σ_i w[i, j] dout[i, d], dV = wᵀ dout",
            fault="weighted-sum-no-transpose"),
    Mistake("dx-missing-query-road", "dL/dx missing the road through the queries", _ROADS,
            swaps=_road_missing("W_query")),
    Mistake("dx-missing-key-road", "dL/dx missing the road through the keys", _ROADS,
            swaps=_road_missing("W_key")),
    Mistake("dx-missing-value-road", "dL/dx missing the road through the values", _ROADS,
            swaps=_road_missing("W_value")),
    Mistake("heads-merged-wrong-order", "heads merged as (T, D, H) instead of (T, H, D), "
            "forward and backward", _HEADS, fault="heads-merged-wrong-order",
            only=("MultiHeadAttention",)),
    Mistake("heads-unmerged-wrong-order", "the heads' gradient un-merged as (T, D, H) instead "
            "of (T, H, D)", _HEADS, swaps=_unmerge_wrong_order, only=("MultiHeadAttention",)),
]


@contextlib.contextmanager
def _applied(mistake, module):
    if mistake.fault:
        with faults.plant(mistake.fault):
            yield
        return
    with faults.swapped([(t, a, lambda _original, r=r: r) for t, a, r in mistake.swaps(module)]):
        yield


def mistakes_for(entry):
    return [m for m in MODULE if not m.only or entry in m.only]


def candidate(mistake, entry, c):
    """Every tensor numpy_ref's module computes with ``mistake`` in it, or None if it
    cannot run that way."""
    x, keep_mask, G = c["inputs"]
    m = catalog.reference_module(entry, c["state"])
    try:
        with _applied(mistake, m):
            out = m.forward(x.copy(), keep_mask)
            dx = m.backward(G.copy())
    except (ValueError, TypeError, IndexError):
        return None
    return {"output": out, "input": dx, **m.grads}
