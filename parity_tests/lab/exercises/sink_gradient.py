"""Exercise: the gradient of an attention sink.

A sink (gpt-oss, StreamingLLM) is one more logit s_h per head, appended to every
row's scores as an extra softmax column whose value vector is 0: it takes a share
p_sink,i of row i's weight and contributes nothing to the output.  Write its
gradient: given the upstream gradient dO, the output O and each row's sink weight,
return dL/ds, one number per head.

Check it:   attention-parity grade sink_gradient.py
"""

import numpy as np


def sink_gradient(dO, O, p_sink):
    """P = softmax([S, s]) row by row, O = P[..., :Tk] @ V (the sink's value is 0).
    dO, O: (H, Tq, d)   p_sink: (H, Tq), the sink column of P
    Returns dsink: (H,).

    Hint, the derivation's first line (the softmax backward, for the sink column):
        dL/ds = Σ_i p_sink,i (dP_i,sink − ⟨P_i, dP_i⟩),   with dP_i,sink = dO_i · 0 = 0
    """
    raise NotImplementedError("sink_gradient: fill in the body")
