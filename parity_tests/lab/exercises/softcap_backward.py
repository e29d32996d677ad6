"""Exercise: the softcap's backward.

Gemma 2 and FlashAttention's ``softcap`` squash every score smoothly into (−c, c)
before the softmax:   S ← c · tanh(S / c).
Write the backward pass: given dL/d(capped S) and the raw scores S, return dL/dS.

Check it:   attention-parity grade softcap_backward.py
"""

import numpy as np


def softcap_backward(dS, S, cap):
    """capped = cap * tanh(S / cap), elementwise.
    dS: (..., Tq, Tk) = dL/dcapped   S: (..., Tq, Tk) the raw scores   cap: c > 0
    Returns dS_raw = dL/dS, same shape.

    Hint, the derivation's first line (the chain rule through tanh):
        d/dS [c · tanh(S / c)] = c · (1 − tanh²(S / c)) · d(S / c)/dS
    """
    raise NotImplementedError("softcap_backward: fill in the body")
