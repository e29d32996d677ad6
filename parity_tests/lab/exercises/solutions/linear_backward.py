"""Solution: the backward of nn.Linear, out = x Wᵀ + b."""

import numpy as np


def linear_backward(dout, x, W, b):
    """out = x @ W.T + b, as nn.Linear computes it.
    dout: (B, T, d_out)   x: (B, T, d_in)   W: (d_out, d_in)   b: (d_out,) or None
    Returns (dx, dW, db): shaped like x, W and b (db is None when b is None).

    out[n, o] = Σ_i x[n, i] W[o, i] + b[o], n running over every (batch, token):
    dx = dout W,  dW = doutᵀ x summed over every n,  db = dout summed over every n.
    """
    dx = dout @ W
    dout2 = dout.reshape(-1, dout.shape[-1])     # (B*T, d_out): every row shares W
    x2 = x.reshape(-1, x.shape[-1])              # (B*T, d_in)
    dW = dout2.T @ x2
    db = None
    if b is not None:
        db = dout.sum(axis=(0, 1))
    return dx, dW, db
