"""Inputs as kernels meet them: the cases every run adds to its grid.

The grid's own cases hand a kernel contiguous standard-normal tensors and
``scale = 1/√D``; kernels in use meet more than that (cuDNN's and
FlashAttention 4's tests draw all of these):

=========================  =====================================================
case                       what a kernel must get right
=========================  =====================================================
``strides fused``          q, k, v are views into one fused (B, T, 3, H, D)
                           buffer, as after a fused qkv projection: read through
                           the strides, or make them contiguous first
``strides padded``         a last-dim stride past D (rows padded to D + 8)
``scale 0.3``              a scale other than 1/√D: use the one given
``inputs outliers``        heavy-tailed inputs (Student's t, 4 degrees of freedom)
                           with two channels 20× the rest, as real activations
                           have: logits of 900 to 2900, so a softmax without its
                           max subtracted overflows
``inputs integers``        small integers (−1, 0, 1) and D = 64: every score is a
                           multiple of 1/8 below 8 in magnitude, exact in every
                           dtype, so the golden result is the kernel's own up to
                           the softmax's rounding
Tq > Tk (77 x 45)          with ``--align bottom-right``, query rows that see no key
=========================  =====================================================

each with the mask it matters with (`VARIATIONS`).  Magnitudes are chosen so that a correct kernel in
bfloat16 still passes: the bound is the baseline's own error times
``CHECK_FACTOR`` (``tolerances``), and the baseline meets the same large logits.
"""

import numpy as np

from parity_tests.kernels.cases import Case

__all__ = ["grid_cases", "label", "draw", "STRIDE_PAD"]

# Elements of padding past D in each row of a "strides padded" buffer.
STRIDE_PAD = 8
OUTLIER_CHANNELS, OUTLIER_FACTOR, OUTLIER_DF = (0, 1), 20.0, 4


# (B, H, Tq, Tk, D, what the case varies, the masks it is drawn with): a variation that
# matters with one mask only is drawn with that one when the run has it (the run's own
# masks otherwise), which keeps a run's added cases to seven.
VARIATIONS = (
    (2, 2, 77, 77, 64, (("strides", "fused"),), (True,)),
    (1, 2, 45, 77, 40, (("strides", "padded"),), (False,)),
    (1, 2, 64, 64, 64, (("scale", 0.3),), (True,)),
    (1, 2, 77, 77, 64, (("inputs", "outliers"),), (True, False)),
    (1, 2, 45, 45, 64, (("inputs", "integers"),), (False,)),
    (1, 2, 77, 45, 64, (), (True,)),                 # Tq > Tk: rows that see no key when causal
)


def grid_cases(causal):
    """The cases every run adds, for the run's masks ``causal`` (a tuple of bools)."""
    out = []
    for b, h, tq, tk, d, varies, masks in VARIATIONS:
        out += [Case(b, h, tq, tk, d, c, varies) for c in (tuple(m for m in masks if m in causal) or causal)]
    return out


def label(name, value):
    return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"


def draw(case, rng, inputs):
    """Redraw q, k, v, dout the way the case's ``inputs`` entry asks."""
    kind = case.get("inputs")
    if kind == "outliers":
        for n in ("q", "k", "v", "dout"):
            x = rng.standard_t(OUTLIER_DF, size=inputs[n].shape)
            if n in ("q", "k"):
                x[..., list(OUTLIER_CHANNELS)] *= OUTLIER_FACTOR
            inputs[n] = x
    elif kind == "integers":
        for n in ("q", "k", "v", "dout"):
            inputs[n] = rng.integers(-1, 2, size=inputs[n].shape).astype(np.float64)
