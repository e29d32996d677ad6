"""Solution: the backward of the scaled dot-product scores."""

import numpy as np


def scores_backward(dscores, queries, keys):
    """attn_scores = queries @ keysᵀ / √d_k.
    dscores: (..., Tq, Tk)   queries: (..., Tq, d_k)   keys: (..., Tk, d_k)
    Returns (dqueries, dkeys), shaped like queries and keys.

    ω_ij = Σ_d q_id k_jd / √d_k, so dq_id = Σ_j dω_ij k_jd / √d_k and
    dk_jd = Σ_i dω_ij q_id / √d_k.
    """
    d_k = keys.shape[-1]
    dqueries = dscores @ keys / np.sqrt(d_k)
    dkeys = np.swapaxes(dscores, -1, -2) @ queries / np.sqrt(d_k)
    return dqueries, dkeys
