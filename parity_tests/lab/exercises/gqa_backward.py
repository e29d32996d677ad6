"""Exercise: dk and dv under grouped-query attention (GQA).

With GQA, H_q query heads share H_kv < H_q key/value heads: query head h reads kv
head h // G, G = H_q / H_kv (MQA: H_kv = 1).  Each query head's backward gives its
own dS_h (the scores' gradient) and P_h (its weights), exactly as without GQA.
Write the keys' and values' gradients from them.

Check it:   attention-parity grade gqa_backward.py
"""

import numpy as np


def gqa_backward(dS, P, dO, q):
    """S_h = q_h k_{h//G}ᵀ / √d, P_h = softmax(S_h), O_h = P_h v_{h//G}.
    dS, P: (H_q, Tq, Tk)   dO, q: (H_q, Tq, d); H_kv = H_q // 2 here (G = 2)
    Returns (dk, dv): (H_kv, Tk, d) each.

    Hint, the derivation's first line: kv head j is used by every query head h with
    h // G = j, so its gradient collects a term from each of them:
        dk_j = Σ_{h: h//G = j} dS_hᵀ q_h / √d
    """
    raise NotImplementedError("gqa_backward: fill in the body")
