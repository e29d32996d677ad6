"""Exercise: the online softmax of one row, tile by tile (FlashAttention-2's forward).

One query's scores s (n keys) and the values V arrive B_c keys at a time.  Keep a
running maximum m, a running sum ℓ and an unnormalised output o; when a tile
raises the maximum, rescale what was summed so far by α = exp(m_old − m_new).  At
the end return the output o / ℓ and the log-sum-exp L = m + log ℓ (all the
backward needs).

Check it:   attention-parity grade online_softmax.py
"""

import numpy as np


def online_softmax(s, V, B_c):
    """s: (n,) one row of scores   V: (n, d) the values   B_c: keys per tile
    Returns (out, L): out = softmax(s) @ V, (d,), and L = log Σ_j exp(s_j), a number,
    computed one tile of B_c keys at a time.

    Hint, the step for tile t (scores s_t, values V_t):
        m_new = max(m, max(s_t));  α = exp(m − m_new)
        ℓ ← α ℓ + Σ exp(s_t − m_new);   o ← α o + exp(s_t − m_new) @ V_t
    """
    raise NotImplementedError("online_softmax: fill in the body")
