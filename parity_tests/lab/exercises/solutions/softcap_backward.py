"""Solution: the softcap's backward."""

import numpy as np


def softcap_backward(dS, S, cap):
    """capped = cap * tanh(S / cap), elementwise.
    dS: (..., Tq, Tk) = dL/dcapped   S: (..., Tq, Tk) the raw scores   cap: c > 0
    Returns dS_raw = dL/dS, same shape.

    d/dS [c · tanh(S / c)] = c · (1 − tanh²(S / c)) · (1 / c) = 1 − tanh²(S / c)
    """
    t = np.tanh(S / cap)
    dS_raw = dS * (1 - t**2)
    return dS_raw
