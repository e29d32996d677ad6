"""Solution: the gradient of an attention sink."""

import numpy as np


def sink_gradient(dO, O, p_sink):
    """P = softmax([S, s]) row by row, O = P[..., :Tk] @ V (the sink's value is 0).
    dO, O: (H, Tq, d)   p_sink: (H, Tq), the sink column of P
    Returns dsink: (H,).

    dL/ds = Σ_i p_sink,i (dP_i,sink − ⟨P_i, dP_i⟩); dP_i,sink = 0 (its value is 0) and
    ⟨P_i, dP_i⟩ = Σ_j P_ij dO_i · v_j = dO_i · O_i = D_i, FlashAttention's D, so
    dL/ds = −Σ_i p_sink,i D_i
    """
    D = np.sum(dO * O, axis=-1)                 # D_i = rowsum(dO ∘ O), (H, Tq)
    dsink = -np.sum(p_sink * D, axis=-1)
    return dsink
