"""The chapter verbs: the chapter's worked examples and statements, checked.

- ``replay``, ``replay_causal``  ``attention-parity chapter``: every worked example,
                                 NumPy and PyTorch beside the printed numbers
                                 (``compare`` holds their shared helpers)
- ``jacobian``                   ``attention-parity jacobian``: the softmax Jacobian
- ``claims``, ``claims_stats``, ``claims_memory``
                                 ``attention-parity claims``: the numeric claims, measured
"""
