"""Solution: dk and dv under grouped-query attention."""

import numpy as np


def gqa_backward(dS, P, dO, q):
    """S_h = q_h k_{h//G}ᵀ / √d, P_h = softmax(S_h), O_h = P_h v_{h//G}.
    dS, P: (H_q, Tq, Tk)   dO, q: (H_q, Tq, d); H_kv = H_q // 2 here (G = 2)
    Returns (dk, dv): (H_kv, Tk, d) each.

    Each query head's own gradients, as without GQA, then summed over the G query
    heads that share a kv head (a kv head used G times collects G terms):
        dk_j = Σ_{h: h//G = j} dS_hᵀ q_h / √d,   dv_j = Σ_{h: h//G = j} P_hᵀ dO_h
    """
    H_q, Tk, d = dS.shape[0], dS.shape[-1], q.shape[-1]
    G = 2
    dk_heads = np.swapaxes(dS, -1, -2) @ q / np.sqrt(d)     # (H_q, Tk, d)
    dv_heads = np.swapaxes(P, -1, -2) @ dO                  # (H_q, Tk, d)
    dk = dk_heads.reshape(H_q // G, G, Tk, d).sum(axis=1)
    dv = dv_heads.reshape(H_q // G, G, Tk, d).sum(axis=1)
    return dk, dv
