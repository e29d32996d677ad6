"""``unfused``: FlexAttention on the CPU without the dynamo trace PyTorch wraps it in.

Without ``torch.compile``, ``flex_attention`` runs its unfused implementation
(``math_attention``: the scores in full, ``score_mod`` and ``mask_mod`` applied by vmap)
inside a ``torch.compile(..., backend="eager")`` of its own, which dynamo traces again for
each new shape, dtype, ``score_mod`` or mask: 0.2-0.6 s a call on the shapes the check
draws, for a few milliseconds of arithmetic.  Under ``torch.compiler.set_stance("force_eager")``
the same implementation runs untraced: the same operations, bit for bit
(``tests/kernels/test_check_targets.py`` holds the two to ``torch.equal``).  On CUDA, where
flex is compiled into a fused kernel, nothing changes.
"""

import contextlib

import torch

__all__ = ["unfused"]


def unfused(device):
    """A context for ``flex_attention`` calls on ``device``: untraced on the CPU (PyTorch
    2.6 and later; before, the call as it is)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return set_stance("force_eager")
