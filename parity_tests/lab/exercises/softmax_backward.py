"""Exercise: the softmax backward.

The chapter derives the softmax Jacobian with the quotient rule on
w_i = exp(x_i) / Z:   ∂w_i/∂x_j = w_i (δ_ij − w_j),   J = diag(w) − w wᵀ.
Write the backward pass: given the softmax's output w and the upstream gradient
g = dL/dw, return dL/dx, without building J (one row of J per weight is n² numbers;
the answer needs only w and g).

Check it:   attention-parity grade softmax_backward.py
"""

import numpy as np


def softmax_backward(w, g):
    """w = softmax(x) along the last axis, shape (..., n); g = dL/dw, same shape.
    Returns dx = dL/dx, same shape.

    Hint, the derivation's first line:
        dL/dx_j = Σ_i g_i ∂w_i/∂x_j = Σ_i g_i w_i (δ_ij − w_j)
    """
    raise NotImplementedError("softmax_backward: fill in the body")
