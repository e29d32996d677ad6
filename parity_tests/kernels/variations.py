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

each with the mask it matters with (`CLASSES`), at its own small shape first and,
when the kernel refuses that (a block kernel that needs T a multiple of 128, Tq = Tk),
at the grid's shapes the kernel accepts (the user's ``--tokens`` and ``--head-dim``
first): a class that no shape could carry is a *gap*, named in the report
(``Report.gaps``) with the kernel's reasons.  Magnitudes are chosen so that a correct kernel in
bfloat16 still passes: the bound is the baseline's own error times
``CHECK_FACTOR`` (``tolerances``), and the baseline meets the same large logits.
"""

from dataclasses import dataclass

import numpy as np

from parity_tests.kernels.cases import Case

__all__ = ["grid_cases", "label", "draw", "views", "viewed", "STRIDE_PAD", "CLASSES", "InputClass",
           "Variation", "VARIATIONS"]

# Elements of padding past D in each row of a "strides padded" buffer.
STRIDE_PAD = 8
OUTLIER_CHANNELS, OUTLIER_FACTOR, OUTLIER_DF = (0, 1), 20.0, 4


@dataclass(frozen=True)
class InputClass:
    """One kind of input every run draws: its name in a report, the case's ``varies``
    (feature-like (name, value) pairs), its own small shape (B, H, Tq, Tk, D), the masks it
    matters with, and which of the grid's shapes can carry it (`fits`)."""
    name: str
    varies: tuple
    shape: tuple
    masks: tuple
    fits: object = lambda tq, tk, d: True


# A variation that matters with one mask only is drawn with that one when the run has it
# (the run's own masks otherwise), which keeps a run's added cases to seven.
CLASSES = (
    InputClass("q, k, v views of a fused qkv buffer", (("strides", "fused"),), (2, 2, 77, 77, 64), (True,),
               lambda tq, tk, d: tq == tk),
    InputClass("q, k, v rows padded past D", (("strides", "padded"),), (1, 2, 45, 77, 40), (False,)),
    InputClass("scale ≠ 1/√D", (("scale", 0.3),), (1, 2, 64, 64, 64), (True,)),
    InputClass("large logits (heavy-tailed inputs with outlier channels)", (("inputs", "outliers"),),
               (1, 2, 77, 77, 64), (True, False), lambda tq, tk, d: d > max(OUTLIER_CHANNELS)),
    InputClass("small integers", (("inputs", "integers"),), (1, 2, 45, 45, 64), (False,)),
    InputClass("Tq > Tk", (), (1, 2, 77, 45, 64), (True,), lambda tq, tk, d: tq > tk),
)


def grid_cases(causal, shapes=()):
    """The cases every run adds, for the run's masks ``causal`` (a tuple of bools), as
    ``[(class name, [case, fallback, ...])]``: each class at its own shape first, then at
    each of the grid's ``shapes`` (B, H, Tq, Tk, D) that can carry it -- those a kernel
    refusing the small shape may take (``run``: a class runs at the first it accepts).
    Tq > Tk is also tried at (T, T/2) for each of the grid's T x T shapes."""
    out = []
    for c in CLASSES:
        tried = [c.shape] + [s for s in shapes if c.fits(*s[2:])]
        if not c.varies:                              # Tq > Tk: halve the keys of square shapes
            tried += [(b, h, tq, tk // 2, d) for b, h, tq, tk, d in shapes if tq == tk >= 2]
        tried = list(dict.fromkeys(tried))
        for m in (tuple(m for m in c.masks if m in causal) or causal):
            out.append((c.name, [Case(b, h, tq, tk, d, m, c.varies) for b, h, tq, tk, d in tried]))
    return out


def label(name, value):
    return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"


def _redrawn(case, kind, rng, inputs):
    """Redraw q, k, v, dout the way the case's ``inputs`` entry asks."""
    if kind == "outliers":
        for n in ("q", "k", "v", "dout"):
            x = rng.standard_t(OUTLIER_DF, size=inputs[n].shape)
            if n in ("q", "k"):
                x[..., list(OUTLIER_CHANNELS)] *= OUTLIER_FACTOR
            inputs[n] = x
    elif kind == "integers":
        for n in ("q", "k", "v", "dout"):
            inputs[n] = rng.integers(-1, 2, size=inputs[n].shape).astype(np.float64)


def _bytes(x):
    """A float8 tensor as its bytes, every other dtype as it is: PyTorch 2.1 has no stack or
    pad of float8 on the CPU, so both are done on the bytes and read back (``.view(dtype)``)."""
    import torch
    return x.view(torch.uint8) if x.is_floating_point() and x.element_size() == 1 else x


def _fused(t, layout, grad):
    """q, k, v as views of one (B, T, 3, H, D) buffer, as a fused qkv projection leaves; where q
    is kept in another dtype than k and v (an FP8 KV cache), k and v of one (B, T, 2, H, D)
    buffer, as a fused kv cache, and q contiguous."""
    import torch

    from parity_tests.kernels.targets import from_layout, to_layout
    names = [n for n in ("q", "k", "v") if t[n].dtype == t["k"].dtype]
    buf = torch.stack([_bytes(t[n]).transpose(1, 2) for n in names], dim=2).view(t["k"].dtype).requires_grad_(grad)
    given = {n: to_layout(buf[:, :, i].transpose(1, 2), layout) for i, n in enumerate(names)}
    read = {n: (lambda i=i: None if buf.grad is None else buf.grad[:, :, i].transpose(1, 2)) for i, n in enumerate(names)}
    if "q" not in names:
        q = to_layout(t["q"], layout).clone(memory_format=torch.contiguous_format).requires_grad_(grad)
        given["q"], read["q"] = q, lambda: None if q.grad is None else from_layout(q.grad, layout)
    return {n: given[n] for n in t}, {n: read[n] for n in t}


def _padded(t, layout, grad):
    """q, k, v with their rows padded past D by `STRIDE_PAD` elements (a last-dim stride past D)."""
    import torch

    from parity_tests.kernels.targets import from_layout, to_layout
    given, read = {}, {}
    for n, x in t.items():
        x = to_layout(x, layout)
        leaf = torch.nn.functional.pad(_bytes(x), (0, STRIDE_PAD)).view(x.dtype).contiguous().requires_grad_(grad)
        given[n] = leaf[..., : x.shape[-1]]
        read[n] = lambda leaf=leaf, d=x.shape[-1]: None if leaf.grad is None else from_layout(leaf.grad[..., :d], layout)
    return given, read


@dataclass(frozen=True)
class Variation:
    """One way the runs vary the grid's inputs, declared as a feature is: its name in a case's
    ``features`` (its value beside it) and the hooks the runner asks instead of the name.
    ``draw(case, value, rng, inputs)``: q, k, v, dout drawn again; ``views(value)``: how
    q, k, v are handed as views of a larger buffer, ``(t, layout, grad) -> (given, read)``
    as `call.Strided.handed`."""
    name: str
    draw: object = None
    views: object = None


VARIATIONS = {v.name: v for v in (
    Variation("strides", views=lambda value: {"fused": _fused, "padded": _padded}[value]),
    Variation("scale"),                                  # cases.Case.scale: the scale handed and judged
    Variation("inputs", draw=_redrawn),
)}


def draw(case, rng, inputs):
    """The case's variations that draw q, k, v, dout again, applied to ``inputs``."""
    for name, value in case.features:
        if name in VARIATIONS and VARIATIONS[name].draw is not None:
            VARIATIONS[name].draw(case, value, rng, inputs)


def views(case):
    """``(t, layout, grad) -> (given, read)`` of the case's variation that hands q, k, v as
    views of a larger buffer, or None (contiguous)."""
    for name, value in case.features:
        if name in VARIATIONS and VARIATIONS[name].views is not None:
            return VARIATIONS[name].views(value)
    return None


def viewed(names):
    """Whether a case with these feature and variation names hands q, k, v as views."""
    return any(VARIATIONS[n].views is not None for n in names if n in VARIATIONS)
