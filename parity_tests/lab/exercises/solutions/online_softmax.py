"""Solution: the online softmax of one row, tile by tile."""

import numpy as np


def online_softmax(s, V, B_c):
    """s: (n,) one row of scores   V: (n, d) the values   B_c: keys per tile
    Returns (out, L): out = softmax(s) @ V, (d,), and L = log Σ_j exp(s_j), a number.

    After tile t, ℓ = Σ_{j seen} exp(s_j − m) and o = Σ_{j seen} exp(s_j − m) v_j for
    the current maximum m; when m grows to m_new every term shrinks by the same
    α = exp(m − m_new), so ℓ and o are both rescaled by α and the tile's terms added.
    At the end out = o / ℓ and log Σ_j exp(s_j) = m + log ℓ.
    """
    m, l, o = -np.inf, 0.0, np.zeros(V.shape[-1])
    for start in range(0, len(s), B_c):
        s_t, V_t = s[start:start + B_c], V[start:start + B_c]
        m_new = max(m, np.max(s_t))
        alpha = np.exp(m - m_new)
        p = np.exp(s_t - m_new)
        l = alpha * l + np.sum(p)
        o = alpha * o + p @ V_t
        m = m_new
    L = m + np.log(l)
    return o / l, L
