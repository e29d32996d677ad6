"""Exercise: the backward of the attention scores.

The chapter's scaled dot-product: attn_scores = queries @ keys.T / √d_k, one score
ω_ij per query i and key j (d_k = keys.shape[-1]).  Write the backward pass: given
dL/dω, return dL/dQ and dL/dK.

Check it:   attention-parity grade scores_backward.py
"""

import numpy as np


def scores_backward(dscores, queries, keys):
    """attn_scores = queries @ keysᵀ / √d_k.
    dscores: (..., Tq, Tk)   queries: (..., Tq, d_k)   keys: (..., Tk, d_k)
    Returns (dqueries, dkeys), shaped like queries and keys.

    Hint, the derivation's first line:
        ω_ij = Σ_d q_id k_jd / √d_k,  so  dL/dq_id = Σ_j dL/dω_ij · ∂ω_ij/∂q_id
    """
    raise NotImplementedError("scores_backward: fill in the body")
