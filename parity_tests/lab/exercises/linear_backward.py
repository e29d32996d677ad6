"""Exercise: the backward of a linear layer.

nn.Linear(d_in, d_out) stores its weight as (d_out, d_in) and computes
out = x @ W.T + b on every row of x: here x is a batch of sequences, (B, T, d_in).
Write the backward pass: given dL/dout, return dL/dx, dL/dW and dL/db.

Check it:   attention-parity grade linear_backward.py
"""

import numpy as np


def linear_backward(dout, x, W, b):
    """out = x @ W.T + b, as nn.Linear computes it.
    dout: (B, T, d_out)   x: (B, T, d_in)   W: (d_out, d_in)   b: (d_out,) or None
    Returns (dx, dW, db): shaped like x, W and b (db is None when b is None).

    Hint, the derivation's first line:
        out[n, o] = Σ_i x[n, i] W[o, i] + b[o]   for every row n = (batch, token)
    """
    raise NotImplementedError("linear_backward: fill in the body")
