"""Solution: the blockwise backward of one tile."""

import numpy as np


def tile_backward(q, k, v, dO, L, D):
    """S = q kᵀ / √d for the tile, P = exp(S − L) its (already normalised) weights.
    q, dO: (B_r, d)   k, v: (B_c, d)   L, D: (B_r,), the rows' log-sum-exp and rowsum(dO ∘ O)
    Returns (dq, dk, dv): this tile's contributions, shaped like q, k and v.

    P_ij = exp(S_ij) / Σ_all j' exp(S_ij') = exp(S_ij − L_i): the whole row's weights,
    though only B_c of them are here.  ⟨P_i, dP_i⟩ runs over the whole row too, and
    Σ_j P_ij dO_i · v_j = dO_i · O_i = D_i, so no other tile is needed.
    """
    d = q.shape[-1]
    S = q @ k.T / np.sqrt(d)                 # (B_r, B_c)
    P = np.exp(S - L[:, None])
    dv = P.T @ dO
    dP = dO @ v.T
    dS = P * (dP - D[:, None])
    dq = dS @ k / np.sqrt(d)
    dk = dS.T @ q / np.sqrt(d)
    return dq, dk, dv
