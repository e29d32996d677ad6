"""``attend``: FlexAttention as the built-in targets and the mirror's witness call it.

On CUDA, ``torch.compile(flex_attention)`` (once per process): its fused kernel.  Elsewhere
its unfused implementation (``math_attention``: the scores in full, ``score_mod`` and
``mask_mod`` applied by vmap), which PyTorch runs inside a ``torch.compile(...,
backend="eager")`` of its own, traced again by dynamo for each new shape, dtype,
``score_mod`` or mask: 0.2-0.6 s a call on the shapes the check draws, for a few
milliseconds of arithmetic.  ``unfused`` runs it under
``torch.compiler.set_stance("force_eager")``: the same operations untraced, bit for bit
(``tests/kernels/test_check_targets.py`` holds the two to ``torch.equal``).
"""

import contextlib
import warnings

import torch

__all__ = ["attend", "unfused"]

_COMPILED = {}


def unfused(device):
    """A context for ``flex_attention`` calls on ``device``: untraced on the CPU (PyTorch
    2.6 and later; before, the call as it is)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or torch.device(device).type != "cpu":
        return contextlib.nullcontext()
    return set_stance("force_eager")


def attend(q, k, v, **kwargs):
    """``flex_attention(q, k, v, **kwargs)``: compiled on CUDA, unfused and untraced on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention
    fn = flex_attention
    if q.is_cuda:
        fn = _COMPILED.get("flex") or _COMPILED.setdefault("flex", torch.compile(flex_attention))
    with warnings.catch_warnings(), unfused(q.device):
        warnings.simplefilter("ignore")      # "called without torch.compile": unfused off CUDA on purpose
        return fn(q, k, v, **kwargs)
