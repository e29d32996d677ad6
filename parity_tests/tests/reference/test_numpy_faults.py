"""The finite-difference checks have teeth: plant a fault in one op's backward and
the module's gradient check must fail."""

import numpy as np
import pytest

import numpy_ref as nr
from numpy_ref import ops
from parity_tests.common.finite_diff import gradient_errors
from parity_tests.common.tolerances import FINITE_DIFF_BOUND as FD_BOUND
_scores_backward, _linear_backward = ops.scores_backward, ops.linear_backward  # sound ones


def softmax_backward_without_sum_term(w, grad_w, axis=-1, out=None):
    return w * grad_w                                    # drops "- sum(w * grad_w)"


def scores_backward_without_scale(dout, cache):
    queries, keys, _ = cache
    return _scores_backward(dout, (queries, keys, False))


def dropout_backward_without_scale(dout, cache):
    keep_mask, _ = cache
    return dout * keep_mask


def linear_backward_bias_from_first_row(dout, cache):
    dx, dW, db = _linear_backward(dout, cache)
    return dx, dW, dout.reshape(-1, dout.shape[-1])[0]


def split_heads_backward_wrong_order(dout, cache):
    b, h, t, d = dout.shape
    return dout.reshape(b, t, h * d)                     # forgets the transpose


FAULTS = {
    "softmax_sum_term": ("softmax_backward", softmax_backward_without_sum_term),
    "scores_scale": ("scores_backward", scores_backward_without_scale),
    "dropout_scale": ("dropout_backward", dropout_backward_without_scale),
    "linear_bias_sum": ("linear_backward", linear_backward_bias_from_first_row),
    "split_heads_transpose": ("split_heads_backward", split_heads_backward_wrong_order),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_fault_is_caught(fault, monkeypatch):
    op_name, broken = FAULTS[fault]
    m = nr.MultiHeadAttention(3, 4, 5, 0.5, 2, qkv_bias=True, rng=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3))
    keep_mask = rng.random((2, 2, 5, 5)) >= 0.5
    dout = rng.normal(size=(2, 5, 4))
    assert max(gradient_errors(m, x, dout, keep_mask).values()) <= FD_BOUND  # sound first
    monkeypatch.setattr(ops, op_name, broken)
    errors = gradient_errors(m, x, dout, keep_mask)
    assert max(errors.values()) > 1e-3, f"{fault} went unnoticed: {errors}"
