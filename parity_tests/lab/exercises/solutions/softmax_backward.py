"""Solution: the softmax backward, without forming the Jacobian."""

import numpy as np


def softmax_backward(w, g):
    """w = softmax(x) along the last axis, shape (..., n); g = dL/dw, same shape.
    Returns dx = dL/dx, same shape.

    dL/dx_j = Σ_i g_i w_i (δ_ij − w_j) = w_j g_j − w_j Σ_i w_i g_i = w_j (g_j − ⟨w, g⟩)
    """
    wg = np.sum(w * g, axis=-1, keepdims=True)   # ⟨w, g⟩, one per row
    dx = w * (g - wg)
    return dx
