"""Exercise: the blockwise backward of one tile (FlashAttention-2's backward).

The forward saved only the output O and, per query row, L = m + log ℓ.  For one
tile (B_r query rows, B_c keys) the backward recomputes the weights from L, and
uses D = rowsum(dO ∘ O), the chapter's ⟨w, g⟩ computed from the output, in the
softmax backward.  Return the tile's contributions to dq, dk and dv (the full
gradients are their sums over tiles).

Check it:   attention-parity grade tile_backward.py
"""

import numpy as np


def tile_backward(q, k, v, dO, L, D):
    """S = q kᵀ / √d for the tile, P = exp(S − L) its (already normalised) weights.
    q, dO: (B_r, d)   k, v: (B_c, d)   L, D: (B_r,), the rows' log-sum-exp and rowsum(dO ∘ O)
    Returns (dq, dk, dv): this tile's contributions, shaped like q, k and v.

    Hint, the derivation's first line (the chapter's softmax backward, row i):
        dS_ij = P_ij (dP_ij − ⟨P_i, dP_i⟩),  dP = dO vᵀ,  ⟨P_i, dP_i⟩ = dO_i · O_i = D_i
    """
    raise NotImplementedError("tile_backward: fill in the body")
